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
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import ImportAssignment

from annot.rewriters.diagnostics import children, is_a

__all__ = ["DEL", "LOAD", "STORE", "Access", "Assignment", "ModuleScopes", "Scope"]

LOAD, STORE, DEL = "load", "store", "del"

_Defn = Union[cst.FunctionDef, cst.ClassDef]
# A node's number: each unit numbers its nodes in a field of _BITS bits of an
# int, below the number of the def or class it is the body of (so numbers of
# nested units fall between that node's number and the next one's).
_BITS = 24
_LEVELS = 6  # units nested deeper than this are analysed with the unit around them
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
# nodes given source-order numbers (spans): those the rewriters compare
_NUMBERED = (cst.Name, cst.Param, cst.BaseSmallStatement, cst.BaseCompoundStatement)
_GLOBAL_OR_NONLOCAL = re.compile(r"\b(?:global|nonlocal)\b")


class Assignment:
    """One binding of ``name`` in ``scope``: ``node`` is the stored ``Name``, the
    ``Param``, ``FunctionDef``, ``ClassDef`` or ``Import``/``ImportFrom``; None for a
    builtin. ``references`` are the accesses that may read it (libcst's rules)."""

    __slots__ = ("_seen", "as_name", "builtin", "index", "name", "node", "references", "scope")

    def __init__(
        self,
        name: str,
        scope: Scope,
        node: Optional[cst.CSTNode],
        index: int,
        as_name: Optional[cst.CSTNode] = None,
    ) -> None:
        self.name = name
        self.scope = scope
        self.node = node
        self.index = index
        self.as_name = as_name  # for an import: the name node it binds
        self.builtin = node is None
        self.references: Sequence[Access] = ()  # a list once there is one
        self._seen: Optional[set[int]] = None

    def qualified_names(self, full_name: str) -> set[str]:
        """libcst's ``get_qualified_names_for``, for a global or builtin binding."""
        if self.builtin:
            return {f"builtins.{self.name}"}
        if isinstance(self.node, (cst.Import, cst.ImportFrom)):
            imp = ImportAssignment(self.name, None, self.node, self.index, self.as_name)  # type: ignore[arg-type]
            return {q.name for q in imp.get_qualified_names_for(full_name)}
        return {full_name}

    def _add(self, accesses: Iterable[Access]) -> None:
        """libcst's ``record_accesses``: accesses before this binding in its own
        scope go to what it shadows."""
        earlier = []
        for access in accesses:
            if access.scope is not self.scope or self.index < access.index:
                if self._seen is None:
                    self._seen, self.references = set(), []
                if id(access) not in self._seen:
                    self._seen.add(id(access))
                    self.references.append(access)  # type: ignore[attr-defined]
            else:
                earlier.append(access)
        if earlier and self.scope.parent is not self.scope:
            for shadowed in self.scope.parent.resolve(self.name, self.scope.parent):
                shadowed._add(earlier)


class Access:
    """A read (or ``del``) of a name; ``referents`` are the bindings it may see."""

    __slots__ = ("index", "node", "referents", "scope")

    def __init__(self, node: cst.Name, scope: Scope) -> None:
        self.node = node
        self.scope = scope
        self.index = scope.count
        self.referents: Sequence[Assignment] = ()


class Scope:
    """A namespace: ``kind`` is builtin, global, class, function (also a lambda),
    comprehension or annotation; ``node`` the node that opens it."""

    def __init__(self, kind: str, parent: Optional[Scope], node: Optional[cst.CSTNode]) -> None:
        self.kind = kind
        self.parent: Scope = parent if parent is not None else self
        self.node = node
        self.count = 0  # libcst's _assignment_count: orders bindings and accesses
        self.assignments: dict[str, list[Assignment]] = {}
        self.overwrites: dict[str, Scope] = {}  # global / nonlocal declarations
        self.accesses: dict[str, list[Access]] = {}  # name -> its reads in this scope
        self.by_node: dict[int, Access] = {}  # id(Name) -> its access (top level only)

    def own(self, name: str) -> list[Assignment]:
        """The bindings of ``name`` made in this scope."""
        return self.assignments.get(name, [])

    def accesses_of(self, node: Union[str, cst.CSTNode]) -> list[Access]:
        """Every read in this scope of the name ``node`` spells (libcst's
        ``scope.accesses[node]``: all of them, not only ``node``'s own)."""
        name = node if isinstance(node, str) else get_full_name_for_node(node)
        return self.accesses.get(name, []) if name is not None else []

    # ---- libcst's resolution rules -------------------------------------------------

    def _visible_parent(self, first: Optional[Scope] = None) -> Scope:
        parent = first if first is not None else self.parent
        while parent.kind == "class":  # a class body is invisible to what it encloses
            parent = parent.parent
        return parent

    def contains(self, name: str) -> bool:
        if self.kind == "builtin":
            return hasattr(builtins, name)
        if self.kind != "global" and name in self.overwrites:
            return self.overwrites[name].contains(name)
        if name in self.assignments:
            return True
        return self._visible_parent().contains(name)

    def resolve(self, name: str, from_scope: Scope) -> list[Assignment]:
        """The bindings a read of ``name`` in ``from_scope`` may see, order aside."""
        if self.kind == "builtin":
            if name not in self.assignments and hasattr(builtins, name):
                self.assignments[name] = [Assignment(name, self, None, -1)]
            return self.assignments.get(name, [])
        if self.kind == "global":
            if name in self.assignments:
                return self.assignments[name]
            parent = self._visible_parent()
            return parent.resolve(name, parent)
        if name in self.overwrites:
            return self._visible_parent(self.overwrites[name]).resolve(name, from_scope)
        if name in self.assignments:
            return self.assignments[name]
        return self._visible_parent().resolve(name, from_scope)

    def target(self, name: str) -> Scope:
        """Where a binding of ``name`` made here lands (``global x`` / ``nonlocal x``)."""
        if self.kind in ("builtin", "global") or name not in self.overwrites:
            return self
        return self._visible_parent(self.overwrites[name]).target(name)


class ModuleScopes:
    """Scopes, expression contexts, parents and source order of one module's
    nodes, analysed a unit at a time (see the module docstring)."""

    def __init__(self, module: cst.Module, text: Optional[str] = None) -> None:
        self.module = module
        self.globals = Scope("global", Scope("builtin", None, None), module)
        self.classes: list[cst.ClassDef] = []
        self._enclosing: dict[int, tuple[_Defn, ...]] = {}  # class -> its def/class ancestors
        self._chain: dict[int, tuple[cst.CSTNode, ...]] = {}  # class -> all its ancestors
        self._parent: dict[int, cst.CSTNode] = {}
        self._scope: dict[int, Scope] = {}
        self._context: dict[int, str] = {}
        self._first: dict[int, int] = {}  # id(node) -> its number
        self._end: dict[int, int] = {}  # id(node) -> the number after its subtree's
        self._qualified: dict[int, frozenset[str]] = {}  # id(node) -> qualified names
        self._dotted: dict[str, frozenset[str]] = {}  # full name -> qualified names
        # a def / class whose body waits for its own unit -> (it, its scope, its unit's level)
        self._deferred: dict[int, tuple[_Defn, Scope, int]] = {}
        self._done: set[int] = set()
        # Names, parameters and statements are numbered in visiting order (source
        # order, but for the parts libcst visits out of it: a function's
        # decorators after its body, a comprehension's element last).
        self._level = 0
        self._base = 0
        self._shift = _BITS * (_LEVELS - 1)
        self._count = 0
        self._pending: list[Access] = []
        self._current: Scope = self.globals
        self._defer_in: Optional[Scope] = None
        self._eager = text is None or _GLOBAL_OR_NONLOCAL.search(text) is not None
        self._find_classes(module.body, (), (module,))
        self._walk_unit(module, self.globals)
        while self._eager:  # every unit, then every access (global statements add names)
            todo = [d for k, d in self._deferred.items() if k not in self._done]
            for node, scope, level in todo:
                self._walk_unit(node, scope, level)
            self._eager = bool(todo)
        self._infer()

    # ---- queries ------------------------------------------------------------------

    def enclosing(self, cls: cst.ClassDef) -> tuple[_Defn, ...]:
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
        return self._scope.get(id(node))

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._parent.get(id(node))

    def context(self, node: cst.CSTNode) -> Optional[str]:
        """LOAD / STORE / DEL for a ``Name`` or ``Attribute``, as libcst's
        ``ExpressionContextProvider`` says; None for other nodes."""
        return self._context.get(id(node))

    def span(self, node: cst.CSTNode) -> Optional[tuple[int, int]]:
        """``[first, end)`` numbers of ``node``'s subtree in visiting order, for a
        ``Name``, ``Param`` or statement: within one function, ``a`` is wholly
        before ``b`` when ``span(a)[1] <= span(b)[0]``."""
        first = self._first.get(id(node))
        return None if first is None else (first, self._end[id(node)])

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
        outer: tuple[_Defn, ...],
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
            if id(node) in self._deferred and id(node) not in self._done:
                self._walk_unit(*self._deferred[id(node)])

    def _walk_unit(self, root: cst.CSTNode, outer: Scope, level: int = 0) -> None:
        """Analyse the module's top level, or the deferred body of ``root``, a
        class or function in ``outer``."""
        self._done.add(id(root))
        self._level = level
        self._base = self._first.get(id(root), 0)
        self._shift = _BITS * (_LEVELS - 1 - level)
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
            self._parent[id(root.body)] = root
            for stmt in root.body.body:
                self._visit(stmt, root.body, LOAD)
        else:
            assert isinstance(root, cst.FunctionDef)
            self._defer_in = None
            scope = Scope("function", outer, root)
            self._current = scope
            self._parameters(root.params, root, defaults=False)
            self._visit(root.body, root, LOAD)
            self._scope[id(root.body)] = scope
        self._current = self.globals
        self._defer_in = None

    def _infer(self) -> None:
        """libcst's ``infer_accesses`` for the accesses recorded since the last call."""
        if self._eager or not self._pending:
            return
        pending, self._pending = self._pending, []
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
                assignment._add(accesses)

    # ---- the walk (libcst's ScopeVisitor and ExpressionContextVisitor, in one) ----------

    def _number(self, node: cst.CSTNode) -> None:
        self._count += 1
        self._first[id(node)] = self._base + (self._count << self._shift)

    def _close(self, node: cst.CSTNode) -> None:
        self._end[id(node)] = self._base + ((self._count + 1) << self._shift)

    def _visit(self, node: cst.CSTNode, parent: cst.CSTNode, ctx: str) -> None:
        self._parent[id(node)] = parent
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
        self._context[id(node)] = ctx
        self._scope[id(node)] = self._current
        if ctx == STORE:
            self._bind(node.value, node)
        else:
            self._pending.append(Access(node, self._current))

    def _attribute(self, node: cst.Attribute, ctx: str) -> None:
        self._context[id(node)] = ctx
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
        self._parent[id(for_in)] = node
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
        self._parent[id(node)] = parent
        for param in children(node):
            self._parent[id(param)] = node
            self._number(param)
            if isinstance(param, cst.Param):
                self._bind(param.name.value, param)
                self._scope[id(param.name)] = self._current
                self._context[id(param.name)] = STORE
                self._parent[id(param.name)] = param
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
        self._scope[id(node.name)] = self._current
        outer = self._current
        defer = self._current is self._defer_in and node.type_parameters is None
        defer = defer and self._level + 1 < _LEVELS
        if node.type_parameters is not None:
            self._in(Scope("annotation", outer, node))
            self._visit(node.type_parameters, node, ctx)
        if defer:  # the body is its own unit: parameter defaults are read here
            self._deferred[id(node)] = (node, outer, self._level + 1)
            for param in children(node.params):
                if isinstance(param, cst.Param):
                    self._parent[id(param)] = node.params
                    self._param_defaults_in(param, outer)
        else:
            inner = Scope("function", self._current, node)
            self._current = inner
            self._parameters(node.params, node)
            self._visit(node.body, node, ctx)
            self._scope[id(node.body)] = inner
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
        self._scope[id(node.name)] = self._current
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
            and self._level + 1 < _LEVELS
        ):
            self._deferred[id(node)] = (node, outer, self._level + 1)
        else:
            self._parent[id(node.body)] = node
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


_VISITS = {
    cst.Name: ModuleScopes._name,
    cst.Attribute: ModuleScopes._attribute,
    cst.Subscript: ModuleScopes._subscript,
    cst.Assign: ModuleScopes._assign,
    cst.AnnAssign: ModuleScopes._ann_assign,
    cst.AugAssign: ModuleScopes._ann_assign,
    cst.NamedExpr: ModuleScopes._ann_assign,
    cst.AsName: ModuleScopes._as_name,
    cst.WithItem: ModuleScopes._counted,
    cst.Del: ModuleScopes._del,
    cst.For: ModuleScopes._for,
    cst.CompFor: ModuleScopes._comp_for,
    cst.ListComp: ModuleScopes._comprehension,
    cst.SetComp: ModuleScopes._comprehension,
    cst.GeneratorExp: ModuleScopes._comprehension,
    cst.DictComp: ModuleScopes._comprehension,
    cst.Lambda: ModuleScopes._lambda,
    cst.FunctionDef: ModuleScopes._function,
    cst.ClassDef: ModuleScopes._class,
    cst.Global: ModuleScopes._declare,
    cst.Nonlocal: ModuleScopes._declare,
    cst.Import: ModuleScopes._import,
    cst.ImportFrom: ModuleScopes._import,
    cst.TypeAlias: ModuleScopes._type_alias,
    cst.TypeVar: ModuleScopes._type_var,
    cst.TypeVarTuple: ModuleScopes._type_var,
    cst.ParamSpec: ModuleScopes._type_var,
    cst.Arg: ModuleScopes._args,
}
