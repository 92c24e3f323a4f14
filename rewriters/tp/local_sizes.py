"""Step 3 of the tensor-parallel rewrite: per-rank sizes (``local=``).

In every method but ``__init__`` (constructors keep full sizes; the parallel
layers divide internally), :meth:`LocalSizeEdits.plan_locals` divides by tp
the reads of ``self.<name>`` and of a plain local variable with a listed name
(``B, T, C = x.size()``: reads of ``C`` become ``C // 2``), with parentheses
only where precedence needs them. A dotted name is a path from ``self``:
``"config.n_head"`` divides the reads of ``self.config.n_head`` in this
class's methods, so a config object shared with other modules (the root's
embedding sizes) is never changed. Method parameters with a listed name are
left alone (a caller in the class already passes the divided value). Refused:
a listed name updated in place (``+=``), declared ``global``/``nonlocal``,
both a parameter and reassigned, or assigned both from per-rank sizes of
``self`` and from other values.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from annot.rewriters.analysis.scope_model import LOAD
from annot.rewriters.source.diagnostics import node_source
from annot.rewriters.tp.edits import Edit, TpEdits
from annot.rewriters.tp.syntax import first_param, self_path, walk

__all__ = ["LocalSizeEdits"]


class LocalSizeEdits(TpEdits):
    """Plans the division by tp of the reads of per-rank sizes."""

    def plan_locals(self, cls: cst.ClassDef, fn: cst.FunctionDef, local: tuple[str, ...]) -> None:
        if not local:
            return
        names = set(local)
        static = any(
            self.qualified(
                d.decorator, frozenset({"builtins.staticmethod", "builtins.classmethod"})
            )
            for d in fn.decorators
        )
        first = None if static else first_param(fn)
        self_name = first.name.value if first is not None else None
        where = f"{cls.name.value}.{fn.name.value}"
        for node in walk(fn.body):
            if isinstance(node, cst.AugAssign):
                t = node.target
                if isinstance(t, cst.Name):
                    name = t.value
                elif self_name is not None and self_path(t, self_name) is not None:
                    name = ".".join(self_path(t, self_name) or ())
                else:
                    continue
                if name in names:
                    raise self.locate.error(
                        node,
                        f"{name} is a per-rank size (local=) but {where} updates it with "
                        f"{node_source(node).strip()!r}; annot divides reads of {name} by tp "
                        "and cannot keep an in-place update correct: assign the result to a "
                        f"new name instead ({name}2 = {name} + ...)",
                    )
            elif isinstance(node, (cst.Global, cst.Nonlocal)):
                kw = "global" if isinstance(node, cst.Global) else "nonlocal"
                for item in node.names:
                    if item.name.value in names:
                        raise self.locate.error(
                            node,
                            f"{item.name.value} is a per-rank size (local=) but {where} "
                            f"declares it {kw}; annot divides reads of local names inside a "
                            "method only, so keep it a plain local variable or an attribute "
                            "of self",
                        )
        assert self.scopes is not None
        self.scopes.prepare(cls, fn)
        scope = self.scopes.scope(fn.body)
        if scope is None:
            return
        reads: list[cst.CSTNode] = []
        for name in sorted(n for n in names if "." not in n):  # local variables
            assignments = scope.own(name)
            params = [a for a in assignments if isinstance(a.node, cst.Param)]
            if params and len(params) != len(assignments):
                raise self.locate.error(
                    params[0].target,
                    f"{name} is a per-rank size (local=) and both a parameter of {where} and "
                    "reassigned in it; annot leaves parameters as passed (callers in the class "
                    "already pass divided sizes) and divides reads of local variables, so "
                    "give the reassigned value a different name",
                )
            if params:
                continue
            divided = [self._reads_divided(a.target, self_name, names) for a in assignments]
            if all(divided):
                continue  # e.g. kv = self.n_head if ... else self.n_kv: already per rank
            if any(divided):
                a = assignments[divided.index(True)]
                raise self.locate.error(
                    a.target,
                    f"{name} is a per-rank size (local=) that {where} assigns both from "
                    "per-rank sizes of self (here) and from other values; annot cannot "
                    "tell whether a read is already divided, so give one of them another name",
                )
            for a in assignments:
                for access in a.references:
                    if isinstance(access.node, cst.Name) and self._is_load(access.node):
                        reads.append(access.node)
        if self_name is not None:
            for a in scope.own(self_name):
                if not isinstance(a.node, cst.Param):
                    continue
                for access in a.references:
                    read = self._listed_read(access.node, names)
                    if read is not None:
                        reads.append(read)
        seen: set[int] = set()
        for node in reads:
            if id(node) in seen:
                continue
            seen.add(id(node))
            self.edit(node, self._divider(self._needs_parens(node)))

    def _listed_read(self, self_ref: cst.Name, names: set[str]) -> Optional[cst.Attribute]:
        """The read of a listed size that the reference ``self_ref`` to
        ``self`` begins (``self.n_head``, ``self.config.n_head`` for
        ``"config.n_head"``), if it is one and a load."""
        assert self.scopes is not None
        node: cst.CSTNode = self_ref
        parts: list[str] = []
        parent = self.scopes.parent(node)
        while isinstance(parent, cst.Attribute) and parent.value is node:
            parts.append(parent.attr.value)
            node = parent
            if ".".join(parts) in names:
                return node if self._is_load(node) else None
            parent = self.scopes.parent(node)
        return None

    def _reads_divided(
        self, target: cst.CSTNode, self_name: Optional[str], names: set[str]
    ) -> bool:
        """Whether the value assigned to ``target`` reads ``self.<name>`` for a
        listed name (whose reads are divided already)."""
        assert self.scopes is not None
        node: Optional[cst.CSTNode] = target
        while node is not None and not isinstance(node, (cst.Assign, cst.AnnAssign)):
            if isinstance(node, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                return False
            node = self.scopes.parent(node)
        if node is None or node.value is None or self_name is None:
            return False
        return any(
            ".".join(self_path(a, self_name) or ()) in names
            for a in m.findall(node.value, m.Attribute())
            if isinstance(a, cst.Attribute)  # what the matcher found, typed
        )

    def _is_load(self, node: cst.CSTNode) -> bool:
        assert self.scopes is not None
        return self.scopes.context(node) == LOAD

    def _divider(self, parens: bool) -> Edit:
        tp = self.tp

        def divide(n: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(n, cst.BaseExpression)
            op = cst.BinaryOperation(left=n, operator=cst.FloorDivide(), right=cst.Integer(str(tp)))
            if parens:
                op = op.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            return op

        return divide

    def _needs_parens(self, node: cst.CSTNode) -> bool:
        """Does ``node // tp`` need parentheses where ``node`` stands?"""
        assert self.scopes is not None
        parent = self.scopes.parent(node)
        if isinstance(parent, cst.Arg):
            return parent.star != ""
        if isinstance(parent, cst.BinaryOperation):
            if isinstance(parent.operator, (cst.Add, cst.Subtract)):
                return False
            return not (
                parent.left is node
                and isinstance(
                    parent.operator,
                    (cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo, cst.MatrixMultiply),
                )
            )
        if isinstance(parent, cst.UnaryOperation):
            return not isinstance(parent.operator, cst.Not)
        return not isinstance(
            parent,
            (
                cst.Element,
                cst.Index,
                cst.Slice,
                cst.Assign,
                cst.AnnAssign,
                cst.AugAssign,
                cst.Return,
                cst.Expr,
                cst.Comparison,
                cst.ComparisonTarget,
                cst.BooleanOperation,
                cst.IfExp,
                cst.DictElement,
                cst.FormattedStringExpression,
                cst.ListComp,
                cst.SetComp,
                cst.GeneratorExp,
                cst.DictComp,
                cst.CompFor,
                cst.CompIf,
                cst.If,
                cst.While,
                cst.For,
                cst.Assert,
                cst.Yield,
                cst.Lambda,
            ),
        )
