"""The edit plan of the tensor-parallel rewrite, and the transform that applies it.

:class:`TpEdits` is the base of
:class:`~annot.rewriters.tp.rewrite.TensorParallelTransformer` and of the
planners it is made of (constructors, local sizes, sharded values, losses).
It holds the rewrite's state (``tp``, the module's scopes, the locator for
refusals, the imports the result needs) and the edits, keyed by original
node: :meth:`TpEdits.edit` records one for the class and method being
planned (:attr:`TpEdits.at`). The transform then enters only the nodes that
hold an edit (:meth:`TpEdits.holding_edits`), and ``on_leave`` applies the
edits to the updated nodes. :meth:`TpEdits.qualified` matches a node by
qualified name, names from relative imports resolved against the file's
package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import libcst as cst
from libcst.codemod import CodemodContext

from annot.core.hints import ShardSpec
from annot.rewriters.analysis.scope_model import Assignment
from annot.rewriters.analysis.scopes import ModuleScopes
from annot.rewriters.source.diagnostics import Locator, children

__all__ = ["Edit", "TpEdits", "Target"]

Edit = Callable[[cst.CSTNode], cst.CSTNode]
# (class node, its hints, the @shard decorator or None when from extra_hints)
Target = tuple[cst.ClassDef, ShardSpec, Optional[cst.Decorator]]
# a class, and the method of it being planned (None: the class itself)
_Where = tuple[cst.ClassDef, Optional[cst.FunctionDef]]


def _absolute(name: str, package: Optional[str]) -> str:
    """``...pytorch_utils.Conv1D`` in package ``transformers.models.gpt2`` ->
    ``transformers.pytorch_utils.Conv1D`` (a name from a relative import, as
    ``QualifiedNameProvider`` reports it). Other names are returned as they are."""
    if not name.startswith(".") or package is None:
        return name
    rest = name.lstrip(".")
    up = len(name) - len(rest)
    base = package.split(".")
    if up - 1 >= len(base):
        return name  # beyond the top-level package: leave it unresolved
    base = base[: len(base) - (up - 1)]
    return ".".join(base + ([rest] if rest else []))


class TpEdits(cst.CSTTransformer):
    """The state and the edits of a tensor-parallel rewrite, and their application.

    ``visit_Module`` (in the subclass) plans; the transform then enters only
    the nodes that hold an edit, and ``on_leave`` applies the edits.
    """

    def __init__(
        self,
        context: CodemodContext,
        tp: int,
        targets: Iterable[Target],
        locate: Locator,
        package: Optional[str] = None,
        *,
        scopes: Optional[ModuleScopes] = None,
        text: Optional[str] = None,
        extra_by_path: bool = False,
    ) -> None:
        super().__init__()
        self.context = context
        # an extra hint on an attribute the class's own __init__ does not assign
        # (a base's does): left to the caller's conversion by path, not refused
        self.extra_by_path = extra_by_path
        self.tp = tp
        self.package = package  # resolves names from relative imports
        self.targets = {id(cls): (cls, spec, dec) for cls, spec, dec in targets}
        self.locate = locate
        self.scopes = scopes
        self.needed_imports: set[tuple[str, str]] = set()
        self.loss_modules = text is None or "CrossEntropyLoss" in text
        self._edits: dict[int, Edit] = {}
        # the class and method being planned; those edited, to enter them
        self.at: Optional[_Where] = None
        self._edited: dict[int, tuple[_Where, list[cst.CSTNode]]] = {}
        self.enter: set[int] = set()
        self.reached: dict[int, Optional[list[Assignment]]] = {}
        self.returns: dict[int, list[cst.Return]] = {}  # forward's, read at every round

    # ---- traversal ---------------------------------------------------------

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.Module):
            return self.visit_Module(node) is not False  # None visits too, as in libcst
        return id(node) in self.enter  # leave alone what holds no edit

    def on_leave(self, original_node, updated_node):
        updated = super().on_leave(original_node, updated_node)
        edit = self._edits.get(id(original_node))
        return edit(updated) if edit is not None else updated

    def edit(self, node: cst.CSTNode, edit: Edit) -> None:
        prev = self._edits.get(id(node))
        self._edits[id(node)] = edit if prev is None else (lambda n: edit(prev(n)))
        assert self.at is not None
        cls, fn = self.at
        self._edited.setdefault(id(fn if fn is not None else cls), (self.at, []))[1].append(node)

    def holding_edits(self, module: cst.Module) -> set[int]:
        """The nodes the transform must enter: those with an edited node below."""
        assert self.scopes is not None
        enter = {id(module)}
        for (cls, fn), nodes in self._edited.values():
            enter.update(id(n) for n in self.scopes.ancestors(cls))
            if fn is not None:
                enter.update((id(cls), id(cls.body)))
                if not self._climb(fn, nodes, enter):
                    self._mark(fn, enter)
        return enter

    def _climb(self, fn: cst.FunctionDef, nodes: list[cst.CSTNode], enter: set[int]) -> bool:
        """Enter the ancestors of ``nodes`` up to ``fn``, by the parents an
        analysed method knows; False when it was not analysed."""
        assert self.scopes is not None
        found: list[int] = []
        for node in nodes:
            cur = self.scopes.parent(node)
            while cur is not None and cur is not fn:
                found.append(id(cur))
                cur = self.scopes.parent(cur)
            if cur is None:
                return False
        enter.update(found)
        enter.add(id(fn))
        return True

    def _mark(self, node: cst.CSTNode, enter: set[int]) -> bool:
        below = False
        for child in children(node):
            below = self._mark(child, enter) or below
        if below:
            enter.add(id(node))
        return below or id(node) in self._edits

    def qualified(self, node: cst.CSTNode, names: frozenset[str]) -> bool:
        assert self.scopes is not None
        qnames = self.scopes.qualified_names(node)
        if not qnames.isdisjoint(names):
            return True
        return any(q.startswith(".") and _absolute(q, self.package) in names for q in qnames)
