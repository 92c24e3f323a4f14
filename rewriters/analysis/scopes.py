"""What a name refers to, computed with a plain walk and only where it is asked.

libcst's ``ScopeProvider``, ``QualifiedNameProvider``, ``ExpressionContextProvider``
and ``ParentNodeProvider`` each run a visitor over the whole module: on a large
model file that costs several times the parse, while a rewriter needs their
answers for a few methods. :class:`ModuleScopes` gives the same answers,
libcst's rules ported (assignment order within a scope, class scopes hidden
from their methods, comprehension and lambda scopes, ``global`` and
``nonlocal``), one unit at a time::

    scopes = ModuleScopes(module)
    scopes.classes                      # every ClassDef, nested ones too, in source order
    scopes.qualified_names(node)        # {"torch.nn.Linear"} for nn.Linear
    scopes.prepare(cls, method)         # analyse one method (and what encloses it)
    scopes.scope(name), scopes.parent(node), scopes.context(node), scopes.span(node)

The module's top level is analysed at once (without the bodies of its classes
and functions); a top-level class without its methods' bodies, and one method,
when :meth:`ModuleScopes.prepare` asks for them. A file with ``global`` or
``nonlocal`` is analysed whole, as libcst does, since those statements add names
to scopes analysed before.

Qualified names are resolved against the module's top-level bindings (imports,
classes, functions, assignments), as libcst resolves a name that no enclosing
function rebinds; a local variable shadowing an import is not seen. Not
modelled (libcst's own corner cases): names inside string annotations and
``typing.cast`` strings, and accesses through a dotted import (``import a.b``
then ``a.b.c`` resolved as ``a.b``).

The scope model (:class:`Scope`, :class:`Assignment`, :class:`Access`, the
expression contexts) is :mod:`annot.rewriters.analysis.scope_model`. The walk that fills
it is :mod:`annot.rewriters.analysis.scope_walk`: a ModuleScopes holds one
:class:`~annot.rewriters.analysis.scope_walk.ScopeWalk`, tells it which units to walk,
reads its maps and takes the reads it recorded. Here the units, the inference
of what each read refers to, and the queries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional

import libcst as cst
from libcst.helpers import get_full_name_for_node

from annot.rewriters.analysis.scope_model import Access, Assignment, Scope
from annot.rewriters.analysis.scope_walk import Defn, ScopeWalk
from annot.rewriters.source.diagnostics import children, is_a

__all__ = ["ModuleScopes"]

# statements (and their parts) that may hold a class: where ModuleScopes.classes looks
_BLOCKS = (
    cst.BaseCompoundStatement,
    cst.IndentedBlock,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)
_GLOBAL_OR_NONLOCAL = re.compile(r"\b(?:global|nonlocal)\b")


class ModuleScopes:
    """Scopes, expression contexts, parents and source order of one module's
    nodes, analysed a unit at a time (see the module docstring)."""

    def __init__(self, module: cst.Module, text: Optional[str] = None) -> None:
        self.module = module
        self.globals = Scope("global", Scope("builtin", None, None), module)
        self.classes: list[cst.ClassDef] = []
        self._enclosing: dict[int, tuple[Defn, ...]] = {}  # class -> its def/class ancestors
        self._chain: dict[int, tuple[cst.CSTNode, ...]] = {}  # class -> all its ancestors
        self._qualified: dict[int, frozenset[str]] = {}  # id(node) -> qualified names
        self._dotted: dict[str, frozenset[str]] = {}  # full name -> qualified names
        self._walk = ScopeWalk(self.globals)
        self._eager = text is None or _GLOBAL_OR_NONLOCAL.search(text) is not None
        self._find_classes(module.body, (), (module,))
        self._walk.walk_unit(module, self.globals)
        while self._eager:  # every unit, then every access (global statements add names)
            todo = self._walk.waiting()
            for node, scope, level in todo:
                self._walk.walk_unit(node, scope, level)
            self._eager = bool(todo)
        self._infer()

    # ---- queries ------------------------------------------------------------------

    def enclosing(self, cls: cst.ClassDef) -> tuple[Defn, ...]:
        """The functions and classes ``cls`` is nested in, outermost first."""
        return self._enclosing.get(id(cls), ())

    def ancestors(self, cls: cst.ClassDef) -> tuple[cst.CSTNode, ...]:
        """Every node from the module down to ``cls`` (the module first, ``cls`` left out)."""
        return self._chain.get(id(cls), ())

    def prepare(self, cls: cst.ClassDef, method: Optional[cst.FunctionDef] = None) -> None:
        """Analyse the unit holding ``method`` (a ``FunctionDef`` in the body of
        ``cls``), or the class-level statements of ``cls``, and what encloses them."""
        self._prepare(cls, method)
        self._infer()

    def scope(self, node: cst.CSTNode) -> Optional[Scope]:
        """The scope a ``Name`` is in (for a function's body: the function's scope)."""
        return self._walk.scopes.get(id(node))

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._walk.parents.get(id(node))

    def context(self, node: cst.CSTNode) -> Optional[str]:
        """LOAD / STORE / DEL for a ``Name`` or ``Attribute``, as libcst's
        ``ExpressionContextProvider`` says; None for other nodes."""
        return self._walk.contexts.get(id(node))

    def span(self, node: cst.CSTNode) -> Optional[tuple[int, int]]:
        """``[first, end)`` numbers of ``node``'s subtree in visiting order, for a
        ``Name``, ``Param`` or statement: within one function, ``a`` is wholly
        before ``b`` when ``span(a)[1] <= span(b)[0]``."""
        first = self._walk.first.get(id(node))
        return None if first is None else (first, self._walk.end[id(node)])

    def qualified_names(self, node: cst.CSTNode) -> frozenset[str]:
        """What libcst's ``QualifiedNameProvider`` says of ``node`` (a ``Name``,
        ``Attribute``, ``Call``, ...) read where no enclosing function rebinds it."""
        known = self._qualified.get(id(node))
        if known is not None:
            return known
        full = get_full_name_for_node(node)
        access = self.globals.by_node.get(id(node))  # a read at the top level: ordered
        if full is None:
            known = frozenset()
        elif access is not None:
            known = frozenset(q for r in access.referents for q in r.qualified_names(r.name))
        else:
            known = self._dotted.get(full)
            if known is None:
                known = self._dotted[full] = self._resolve(full)
        self._qualified[id(node)] = known
        return known

    def _resolve(self, full: str) -> frozenset[str]:
        """The qualified names of a dotted name read below the top level."""
        prefix: Optional[str] = full
        found: list[Assignment] = []
        while prefix:
            if self.globals.contains(prefix):
                found = self.globals.resolve(prefix, self.globals)
                break
            cut = prefix.rfind(".")
            prefix = None if cut == -1 else prefix[:cut]
        return frozenset(q for a in found for q in a.qualified_names(full))

    # ---- units --------------------------------------------------------------------

    def _find_classes(
        self,
        nodes: Iterable[cst.CSTNode],
        outer: tuple[Defn, ...],
        chain: tuple[cst.CSTNode, ...],
    ) -> None:
        for node in nodes:
            if not is_a(node, _BLOCKS):
                continue
            if isinstance(node, cst.ClassDef):
                self.classes.append(node)
                self._enclosing[id(node)] = outer
                self._chain[id(node)] = chain
            if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
                self._find_classes((node.body,), (*outer, node), (*chain, node))
            else:
                self._find_classes(children(node), outer, (*chain, node))

    def _prepare(self, cls: cst.ClassDef, method: Optional[cst.FunctionDef]) -> None:
        path = (*self.enclosing(cls), cls) + ((method,) if method is not None else ())
        for node in path:  # each unit is known to be deferred once the one around it is done
            self._walk.walk_deferred(node)

    def _infer(self) -> None:
        """libcst's ``infer_accesses`` for the accesses recorded since the last call."""
        if self._eager:
            return
        pending = self._walk.take_accesses()
        groups: dict[tuple[int, str], list[Access]] = {}
        for access in pending:
            scope, name = access.scope, access.node.value
            found = scope.resolve(name, scope)
            seen = [a for a in found if a.scope is not scope or a.index < access.index]
            if not seen and found and scope.parent is not scope:
                access.referents = scope.parent.resolve(name, scope)
            else:  # the scopes' own lists are shared, not copied: they are complete by now
                access.referents = found if len(seen) == len(found) else seen
            scope.accesses.setdefault(name, []).append(access)
            if scope.kind == "global":
                scope.by_node[id(access.node)] = access
            groups.setdefault((id(scope), name), []).append(access)
        for accesses in groups.values():
            scope, name = accesses[0].scope, accesses[0].node.value
            for assignment in list(scope.resolve(name, scope)):
                assignment.record_accesses(accesses)
