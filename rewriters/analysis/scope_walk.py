"""The walk behind :class:`annot.rewriters.analysis.scopes.ModuleScopes`: libcst's
``ScopeVisitor`` and ``ExpressionContextVisitor`` ported, in one.

A :class:`ScopeWalk` belongs to one ModuleScopes and fills the maps it answers
from. :meth:`ScopeWalk.walk_unit` analyses one unit (the module's top level,
or the deferred body of a class or function): it binds names in their scopes,
records each read for later inference (:meth:`ScopeWalk.take_accesses`),
notes every node's parent, scope and expression context (:attr:`parents`,
:attr:`scopes`, :attr:`contexts`), and numbers names, parameters and
statements in visiting order (:attr:`first`, :attr:`end`). A def or class
body met at the level where units are deferred is left for its own unit
(:meth:`ScopeWalk.walk_deferred`, :meth:`ScopeWalk.waiting`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import libcst as cst
from libcst.helpers import get_full_name_for_node

from annot.rewriters.analysis.scope_model import DEL, LOAD, STORE, Access, Assignment, Scope
from annot.rewriters.source.diagnostics import children, is_a

__all__ = ["BITS", "LEVELS", "Defn", "ScopeWalk"]

# A node's number: each unit numbers its nodes in a field of BITS bits of an
# int, below the number of the def or class it is the body of (so numbers of
# nested units fall between that node's number and the next one's).
BITS = 24
LEVELS = 6  # units nested deeper than this are analysed with the unit around them
# nodes given source-order numbers (spans): those the rewriters compare
_NUMBERED = (cst.Name, cst.Param, cst.BaseSmallStatement, cst.BaseCompoundStatement)

Defn = Union[cst.FunctionDef, cst.ClassDef]


class ScopeWalk:
    """The walk of one module's units into the maps
    :class:`~annot.rewriters.analysis.scopes.ModuleScopes` answers from (see the module
    docstring); ``module_scope`` is the module's global scope."""

    def __init__(self, module_scope: Scope) -> None:
        self.globals = module_scope
        self.parents: dict[int, cst.CSTNode] = {}
        self.scopes: dict[int, Scope] = {}
        self.contexts: dict[int, str] = {}
        self.first: dict[int, int] = {}  # id(node) -> its number
        self.end: dict[int, int] = {}  # id(node) -> the number after its subtree's
        # a def / class whose body waits for its own unit -> (it, its scope, its unit's level)
        self._deferred: dict[int, tuple[Defn, Scope, int]] = {}
        self._done: set[int] = set()
        # Names, parameters and statements are numbered in visiting order (source
        # order, but for the parts libcst visits out of it: a function's
        # decorators after its body, a comprehension's element last).
        self._level = 0
        self._base = 0
        self._shift = BITS * (LEVELS - 1)
        self._count = 0
        self._pending: list[Access] = []
        self._current: Scope = module_scope
        self._defer_in: Optional[Scope] = None

    def waiting(self) -> list[tuple[Defn, Scope, int]]:
        """The deferred units not walked yet: (the def or class, the scope it
        is in, its unit's level), the arguments of :meth:`walk_unit`."""
        return [d for k, d in self._deferred.items() if k not in self._done]

    def walk_deferred(self, node: cst.CSTNode) -> None:
        """Walk the body of ``node``, a def or class, if it waits for its own unit."""
        if id(node) in self._deferred and id(node) not in self._done:
            self.walk_unit(*self._deferred[id(node)])

    def take_accesses(self) -> list[Access]:
        """The reads recorded since the last call, handed over (libcst infers
        what they refer to once the scopes they may see are walked)."""
        pending, self._pending = self._pending, []
        return pending

    def walk_unit(self, root: cst.CSTNode, outer: Scope, level: int = 0) -> None:
        """Analyse the module's top level, or the deferred body of ``root``, a
        class or function in ``outer``."""
        self._done.add(id(root))
        self._level = level
        self._base = self.first.get(id(root), 0)
        self._shift = BITS * (LEVELS - 1 - level)
        self._count = 0
        self._current = outer
        if isinstance(root, cst.Module):
            self._defer_in = outer
            for stmt in root.body:
                self._visit(stmt, root, LOAD)
        elif isinstance(root, cst.ClassDef):
            scope = Scope("class", outer, root)
            self._defer_in = scope
            self._current = scope
            self.parents[id(root.body)] = root
            for line in root.body.body:
                self._visit(line, root.body, LOAD)
        else:
            assert isinstance(root, cst.FunctionDef)
            self._defer_in = None
            scope = Scope("function", outer, root)
            self._current = scope
            self._parameters(root.params, root, defaults=False)
            self._visit(root.body, root, LOAD)
            self.scopes[id(root.body)] = scope
        self._current = self.globals
        self._defer_in = None

    # ---- the walk (libcst's ScopeVisitor and ExpressionContextVisitor, in one) ----------

    def _number(self, node: cst.CSTNode) -> None:
        self._count += 1
        self.first[id(node)] = self._base + (self._count << self._shift)

    def _close(self, node: cst.CSTNode) -> None:
        self.end[id(node)] = self._base + ((self._count + 1) << self._shift)

    def _visit(self, node: cst.CSTNode, parent: cst.CSTNode, ctx: str) -> None:
        self.parents[id(node)] = parent
        numbered = is_a(node, _NUMBERED)
        if numbered:
            self._number(node)
        visit = _VISITS.get(type(node))
        if visit is None:
            for child in children(node):
                self._visit(child, node, ctx)
        else:
            visit(self, node, ctx)
        if numbered:
            self._close(node)

    def _bind(self, name: str, node: cst.CSTNode, as_name: Optional[cst.CSTNode] = None) -> None:
        target = self._current.target(name)
        binding = Assignment(name, target, node, target.count, as_name)
        target.assignments.setdefault(name, []).append(binding)

    def _in(self, scope: Scope) -> Scope:
        outer, self._current = self._current, scope
        return outer

    def _name(self, node: cst.Name, ctx: str) -> None:
        self.contexts[id(node)] = ctx
        self.scopes[id(node)] = self._current
        if ctx == STORE:
            self._bind(node.value, node)
        else:
            self._pending.append(Access(node, self._current))

    def _attribute(self, node: cst.Attribute, ctx: str) -> None:
        self.contexts[id(node)] = ctx
        self._visit(node.value, node, LOAD)

    def _subscript(self, node: cst.Subscript, ctx: str) -> None:
        self._visit(node.value, node, LOAD)
        for element in node.slice:
            self._visit(element, node, LOAD)

    def _stores(self, node: cst.CSTNode, targets: Iterable[cst.CSTNode], ctx: str) -> None:
        """Assignment-like statements: targets stored, then the rest read."""
        done = set()
        for target in targets:
            done.add(id(target))
            self._visit(target, node, STORE)
        for child in children(node):
            if id(child) not in done:
                self._visit(child, node, ctx)
        self._current.count += 1

    def _assign(self, node: cst.Assign, ctx: str) -> None:
        self._stores(node, node.targets, ctx)

    def _ann_assign(
        self, node: Union[cst.AnnAssign, cst.AugAssign, cst.NamedExpr], ctx: str
    ) -> None:
        self._stores(node, (node.target,), ctx)

    def _as_name(self, node: cst.AsName, ctx: str) -> None:
        self._stores(node, (node.name,), ctx)

    def _counted(self, node: cst.CSTNode, ctx: str) -> None:
        for child in children(node):
            self._visit(child, node, ctx)
        self._current.count += 1

    def _del(self, node: cst.Del, ctx: str) -> None:
        self._visit(node.target, node, DEL)

    def _for(self, node: cst.For, ctx: str) -> None:
        self._visit(node.target, node, STORE)
        self._current.count += 1
        for child in (node.iter, node.body, node.orelse):
            if child is not None:
                self._visit(child, node, ctx)

    def _comp_for(self, node: cst.CompFor, ctx: str) -> None:
        self._visit(node.target, node, STORE)
        for child in (node.iter, *node.ifs, node.inner_for_in):
            if child is not None:
                self._visit(child, node, ctx)
        self._current.count += 1

    def _comprehension(
        self, node: Union[cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp], ctx: str
    ) -> None:
        for_in = node.for_in
        self.parents[id(for_in)] = node
        self._visit(for_in.iter, for_in, ctx)  # the first iterable is read outside
        outer = self._in(Scope("comprehension", self._current, node))
        self._visit(for_in.target, for_in, STORE)
        self._current.count += 1
        for child in (*for_in.ifs, for_in.inner_for_in):
            if child is not None:
                self._visit(child, for_in, ctx)
        if isinstance(node, cst.DictComp):
            self._visit(node.key, node, ctx)
            self._visit(node.value, node, ctx)
        else:
            self._visit(node.elt, node, ctx)
        self._current = outer

    def _parameters(self, node: cst.Parameters, parent: cst.CSTNode, defaults: bool = True) -> None:
        """A function's parameters, bound in the current (the function's) scope;
        defaults and annotations are read in the scope around it."""
        self.parents[id(node)] = parent
        for param in children(node):
            self.parents[id(param)] = node
            self._number(param)
            if isinstance(param, cst.Param):
                self._bind(param.name.value, param)
                self.scopes[id(param.name)] = self._current
                self.contexts[id(param.name)] = STORE
                self.parents[id(param.name)] = param
                if defaults:
                    self._param_defaults(param)
            self._close(param)
        self._current.count += 1

    def _param_defaults(self, param: cst.Param) -> None:
        outer = self._in(self._current.parent)
        for part in (param.default, param.annotation):
            if part is not None:
                self._visit(part, param, LOAD)
        self._current = outer

    def _lambda(self, node: cst.Lambda, ctx: str) -> None:
        outer = self._in(Scope("function", self._current, node))
        self._parameters(node.params, node)
        self._visit(node.body, node, ctx)
        self._current = outer

    def _function(self, node: cst.FunctionDef, ctx: str) -> None:
        self._bind(node.name.value, node)
        self.scopes[id(node.name)] = self._current
        outer = self._current
        defer = self._current is self._defer_in and node.type_parameters is None
        defer = defer and self._level + 1 < LEVELS
        if node.type_parameters is not None:
            self._in(Scope("annotation", outer, node))
            self._visit(node.type_parameters, node, ctx)
        if defer:  # the body is its own unit: parameter defaults are read here
            self._deferred[id(node)] = (node, outer, self._level + 1)
            for param in children(node.params):
                if isinstance(param, cst.Param):
                    self.parents[id(param)] = node.params
                    self._param_defaults_in(param, outer)
        else:
            inner = Scope("function", self._current, node)
            self._current = inner
            self._parameters(node.params, node)
            self._visit(node.body, node, ctx)
            self.scopes[id(node.body)] = inner
        self._current = outer
        for decorator in node.decorators:
            self._visit(decorator, node, ctx)
        if node.returns is not None:
            self._visit(node.returns, node, ctx)
        outer.count += 1

    def _param_defaults_in(self, param: cst.Param, scope: Scope) -> None:
        outer = self._in(scope)
        for part in (param.default, param.annotation):
            if part is not None:
                self._visit(part, param, LOAD)
        self._current = outer

    def _class(self, node: cst.ClassDef, ctx: str) -> None:
        self._bind(node.name.value, node)
        self.scopes[id(node.name)] = self._current
        outer = self._current
        for decorator in node.decorators:
            self._visit(decorator, node, ctx)
        if node.type_parameters is not None:
            self._in(Scope("annotation", outer, node))
            self._visit(node.type_parameters, node, ctx)
        for arg in (*node.bases, *node.keywords):
            self._visit(arg, node, ctx)
        if (
            self._current is self._defer_in
            and node.type_parameters is None
            and self._level + 1 < LEVELS
        ):
            self._deferred[id(node)] = (node, outer, self._level + 1)
        else:
            self.parents[id(node.body)] = node
            self._current = Scope("class", self._current, node)
            for stmt in node.body.body:
                self._visit(stmt, node.body, LOAD)
        self._current = outer
        outer.count += 1

    def _declare(self, node: Union[cst.Global, cst.Nonlocal], ctx: str) -> None:
        scope = self._current
        for item in node.names:
            if scope.kind not in ("global", "builtin"):
                where = scope.parent if isinstance(node, cst.Nonlocal) else self.globals
                scope.overwrites[item.name.value] = where
        scope.count += 1

    def _import(self, node: Union[cst.Import, cst.ImportFrom], ctx: str) -> None:
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                bound = alias.asname.name if alias.asname is not None else alias.name
                for name in _dotted(bound):
                    self._bind(name, node, bound)
        self._current.count += 1

    def _type_alias(self, node: cst.TypeAlias, ctx: str) -> None:
        self._bind(node.name.value, node)
        outer = self._in(Scope("annotation", self._current, node))
        if node.type_parameters is not None:
            self._visit(node.type_parameters, node, ctx)
        self._visit(node.value, node, ctx)
        self._current = outer
        self._current.count += 1

    def _type_var(
        self, node: Union[cst.TypeVar, cst.TypeVarTuple, cst.ParamSpec], ctx: str
    ) -> None:
        self._bind(node.name.value, node)
        if isinstance(node, cst.TypeVar) and node.bound is not None:
            self._visit(node.bound, node, ctx)
        self._current.count += 1

    def _args(self, node: cst.Arg, ctx: str) -> None:
        self._visit(node.value, node, ctx)  # the keyword is neither read nor bound


def _dotted(node: cst.BaseExpression) -> list[str]:
    """``a.b.c`` -> ["a.b.c", "a.b", "a"] (what ``import a.b.c`` binds)."""
    full = get_full_name_for_node(node)
    if full is None:
        return []
    parts = full.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


_VISITS: dict[type, Callable[[ScopeWalk, Any, str], None]] = {
    cst.Name: ScopeWalk._name,
    cst.Attribute: ScopeWalk._attribute,
    cst.Subscript: ScopeWalk._subscript,
    cst.Assign: ScopeWalk._assign,
    cst.AnnAssign: ScopeWalk._ann_assign,
    cst.AugAssign: ScopeWalk._ann_assign,
    cst.NamedExpr: ScopeWalk._ann_assign,
    cst.AsName: ScopeWalk._as_name,
    cst.WithItem: ScopeWalk._counted,
    cst.Del: ScopeWalk._del,
    cst.For: ScopeWalk._for,
    cst.CompFor: ScopeWalk._comp_for,
    cst.ListComp: ScopeWalk._comprehension,
    cst.SetComp: ScopeWalk._comprehension,
    cst.GeneratorExp: ScopeWalk._comprehension,
    cst.DictComp: ScopeWalk._comprehension,
    cst.Lambda: ScopeWalk._lambda,
    cst.FunctionDef: ScopeWalk._function,
    cst.ClassDef: ScopeWalk._class,
    cst.Global: ScopeWalk._declare,
    cst.Nonlocal: ScopeWalk._declare,
    cst.Import: ScopeWalk._import,
    cst.ImportFrom: ScopeWalk._import,
    cst.TypeAlias: ScopeWalk._type_alias,
    cst.TypeVar: ScopeWalk._type_var,
    cst.TypeVarTuple: ScopeWalk._type_var,
    cst.ParamSpec: ScopeWalk._type_var,
    cst.Arg: ScopeWalk._args,
}
