"""The scope model of :mod:`annot.rewriters.analysis.scopes`: scopes, the bindings made
in them and the reads of names, with libcst's resolution rules.

A :class:`Scope` (builtin, global, class, function, comprehension or
annotation) holds its :class:`Assignment` list per name and its
:class:`Access` list per name; :meth:`Scope.resolve` gives the bindings a read
may see (class scopes hidden from their methods, ``global`` and ``nonlocal``
declarations followed). ``LOAD``, ``STORE`` and ``DEL`` are the expression
contexts.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import ImportAssignment

__all__ = ["DEL", "LOAD", "STORE", "Access", "Assignment", "Scope"]

LOAD, STORE, DEL = "load", "store", "del"


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

    @property
    def target(self) -> cst.CSTNode:
        """``node`` of a binding the code makes (every binding but a builtin's)."""
        assert self.node is not None, f"{self.name} is a builtin: no node binds it"
        return self.node

    def qualified_names(self, full_name: str) -> set[str]:
        """libcst's ``get_qualified_names_for``, for a global or builtin binding."""
        if self.builtin:
            return {f"builtins.{self.name}"}
        if isinstance(self.node, (cst.Import, cst.ImportFrom)):
            imp = ImportAssignment(self.name, None, self.node, self.index, self.as_name)  # type: ignore[arg-type]
            return {q.name for q in imp.get_qualified_names_for(full_name)}
        return {full_name}

    def record_accesses(self, accesses: Iterable[Access]) -> None:
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
                shadowed.record_accesses(earlier)


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
