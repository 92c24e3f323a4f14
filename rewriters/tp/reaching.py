"""Which assignments reach a read of a name, for following sharded values.

libcst's scopes know every assignment of a name in its scope, not which reach
a read. :meth:`ReachingAssignments.reaching` keeps those that can (the last
one on the straight-line path to the read and what follows it, plus later
ones in a loop around the read), memoized per read;
:meth:`ReachingAssignments.assigned_value` is the value of ``name = value``.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from annot.rewriters.analysis.scope_model import Assignment
from annot.rewriters.tp.edits import TpEdits

__all__ = ["ReachingAssignments"]


class ReachingAssignments(TpEdits):
    """The assignments that may give a read its value (in the method being planned)."""

    def reaching(self, name: cst.Name) -> Optional[list[Assignment]]:
        """The assignments that may give ``name`` (a read) its value; None when
        one of them is not a plain assignment (a builtin, an import, ...).

        libcst's scopes know every assignment of a name in its scope, not which
        reach a read. This keeps the ones that can: those that end before the
        read, from the last one on the straight-line path to it (an earlier
        statement of an enclosing block: ``h = self.transform(h); h =
        self.decoder(h); return h`` reads the second), plus those later in a
        loop around the read that does not hold that last one. A read from a
        nested scope (a closure) keeps them all.

        Scopes come from :mod:`annot.rewriters.analysis.scopes` (the method being planned is
        analysed on the first call); "before" compares the numbers it gives
        the nodes of one function, in source order.
        """
        if id(name) not in self.reached:
            self.reached[id(name)] = self._reaching_uncached(name)
        return self.reached[id(name)]

    def _reaching_uncached(self, name: cst.Name) -> Optional[list[Assignment]]:
        assert self.scopes is not None
        assert self.at is not None
        self.scopes.prepare(*self.at)
        scope = self.scopes.scope(name)
        if scope is None:
            return None
        refs = [r for access in scope.accesses_of(name) for r in access.referents]
        if any(r.builtin for r in refs):
            return None
        here = self.scopes.span(name)
        if here is None or any(r.scope is not scope for r in refs):
            return refs
        # libcst leaves out assignments after the read: a loop can bring them back
        refs = list(scope.own(name.value))
        scopes = self.scopes
        refs.sort(key=lambda r: _start(scopes.span(r.target)))
        at = here[0]
        # the straight-line statements before the read: block id -> index of its ancestor
        blocks: dict[int, int] = {}
        loops: list[cst.CSTNode] = []
        node: cst.CSTNode = name
        while not isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef, cst.Module)):
            parent = self.scopes.parent(node)
            if parent is None:
                break
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                blocks[id(parent)] = next(i for i, b in enumerate(parent.body) if b is node)
            if isinstance(parent, (cst.For, cst.While)) and node is parent.body:
                loops.append(parent)
            node = parent
        before: list[tuple[int, Assignment]] = []
        later: list[Assignment] = []
        last: Optional[tuple[int, Assignment]] = None
        for ref in refs:
            stmt, line = self._statement(ref.target)
            pos = self.scopes.span(stmt) if stmt is not None else None
            if pos is None:
                return refs
            if pos[1] <= at:
                start = pos[0]
                before.append((start, ref))
                block = self.scopes.parent(line) if line else None
                if block is not None and id(block) in blocks:
                    index = next(i for i, b in enumerate(block.body) if b is line)  # type: ignore[attr-defined]
                    if index < blocks[id(block)] and (last is None or start > last[0]):
                        last = (start, ref)
            else:
                later.append(ref)
        out = [r for start, r in before if last is None or start >= last[0]]
        for ref in later:
            for loop in loops:
                inside = self._inside(ref.target, loop)
                if inside and (last is None or not self._inside(last[1].target, loop)):
                    out.append(ref)
                    break
        return out

    def _statement(
        self, node: cst.CSTNode
    ) -> tuple[Optional[cst.CSTNode], Optional[cst.SimpleStatementLine]]:
        """The statement holding an assignment target, and its line when that
        statement is a simple one (``x = ...``) that can dominate a later read."""
        assert self.scopes is not None
        cur: Optional[cst.CSTNode] = node
        while cur is not None and not isinstance(
            cur, (cst.BaseSmallStatement, cst.BaseCompoundStatement)
        ):
            cur = self.scopes.parent(cur)
        if isinstance(cur, (cst.Assign, cst.AnnAssign)):
            line = self.scopes.parent(cur)
            if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
                return cur, line
        return cur, None

    def _inside(self, node: cst.CSTNode, ancestor: cst.CSTNode) -> bool:
        assert self.scopes is not None
        cur: Optional[cst.CSTNode] = node
        while cur is not None:
            if cur is ancestor:
                return True
            cur = self.scopes.parent(cur)
        return False

    def assigned_value(self, node: cst.CSTNode) -> Optional[cst.BaseExpression]:
        """The value of ``node = value`` when ``node`` is the only target."""
        assert self.scopes is not None
        parent = self.scopes.parent(node)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            stmt = self.scopes.parent(parent)
            if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
                return stmt.value
        if isinstance(parent, cst.AnnAssign) and parent.target is node:
            return parent.value
        return None


def _start(span: Optional[tuple[int, int]]) -> int:
    return span[0] if span is not None else 0
