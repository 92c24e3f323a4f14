"""Read ``@shard`` / ``@stage`` hints from source, as literals, never evaluated.

The rewriters need the hints of a model file without importing it (importing
runs the user's code, and the file may not even import on this machine). So
the decorators are read from the syntax tree, matched by *qualified name*
with libcst's ``QualifiedNameProvider``: ``from annot import shard``,
``import annot as a; @a.shard(...)``, ``@annot.shard`` and
``@annot.core.hints.shard`` are all the same decorator. Their arguments are read
as literals into the real specs by :mod:`annot.rewriters.source.hint_literals`.

Entry points::

    read_shard_hints(source, path)   -> {class name: ShardSpec}
    read_stage_hints(source, path)   -> {class name: StageSpec}
    find_hints(wrapper, "shard", path) -> [ClassHint(name, node, decorator, spec)]
    find_hints(module, "shard", path, scopes=ModuleScopes(module))

``find_hints`` is the form a transformer uses: it returns the ``ClassDef`` and
``Decorator`` nodes of the tree it was given, so they can be edited or pointed
at in errors. Given a ``MetadataWrapper`` it asks libcst's
``QualifiedNameProvider``; given a ``Module`` it resolves names with
:class:`annot.rewriters.analysis.scopes.ModuleScopes` (the module's own bindings), which
costs a fraction of that on a large file.
:data:`BOUNDARY_NAMES` and :func:`has_qualified_name` let the stage splitter
recognise ``annot.boundary()`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper, QualifiedName, QualifiedNameProvider

from annot.core.hints import ShardSpec, StageSpec
from annot.rewriters.analysis.scopes import ModuleScopes
from annot.rewriters.source.diagnostics import Locator, parse_source
from annot.rewriters.source.hint_literals import Hint, HintArguments, Kind

__all__ = [
    "BOUNDARY_NAMES",
    "SHARD_NAMES",
    "STAGE_NAMES",
    "ClassHint",
    "find_hints",
    "has_qualified_name",
    "read_shard_hints",
    "read_stage_hints",
]

SHARD_NAMES = frozenset({"annot.shard", "annot.core.hints.shard"})
STAGE_NAMES = frozenset({"annot.stage", "annot.core.hints.stage"})
BOUNDARY_NAMES = frozenset({"annot.boundary", "annot.core.hints.boundary"})

SourceLike = Union[str, bytes, cst.Module, MetadataWrapper]


@dataclass(frozen=True, eq=False)
class ClassHint:
    """One hinted class: its name, its ``ClassDef`` and hint ``Decorator`` nodes
    (from the wrapper's tree) and the spec read from the decorator."""

    name: str
    node: cst.ClassDef
    decorator: cst.Decorator
    spec: Hint


def has_qualified_name(qnames: Iterable[QualifiedName], names: Collection[str]) -> bool:
    """True if one of ``qnames`` (``QualifiedNameProvider`` metadata) is in ``names``."""
    return any(q.name in names for q in qnames)


def _wrap(source: SourceLike, path: str) -> MetadataWrapper:
    if isinstance(source, MetadataWrapper):
        return source
    if isinstance(source, cst.Module):
        return MetadataWrapper(source)
    return MetadataWrapper(parse_source(source, path))


def read_shard_hints(source: SourceLike, path: str = "<string>") -> dict[str, ShardSpec]:
    """``{class name: ShardSpec}`` for every ``@shard``-decorated class in ``source``
    (text, bytes, a libcst ``Module`` or a ``MetadataWrapper``)."""
    wrapper = _wrap(source, path)
    return _by_name(find_hints(wrapper, "shard", path), Locator(wrapper, path), "@shard")


def read_stage_hints(source: SourceLike, path: str = "<string>") -> dict[str, StageSpec]:
    """``{class name: StageSpec}`` for every ``@stage``-decorated class in ``source``."""
    wrapper = _wrap(source, path)
    return _by_name(find_hints(wrapper, "stage", path), Locator(wrapper, path), "@stage")


def _by_name(hints: list[ClassHint], locate: Locator, what: str) -> dict:
    out: dict = {}
    for h in hints:
        if h.name in out:
            raise locate.error(
                h.node.name,
                f"two classes named {h.name} carry {what}; hints are looked up by class "
                "name, so rename one of them",
            )
        out[h.name] = h.spec
    return out


def find_hints(
    tree: Union[MetadataWrapper, cst.Module],
    kind: Kind,
    path: str = "<string>",
    *,
    scopes: Optional[ModuleScopes] = None,
) -> list[ClassHint]:
    """Every class of ``tree`` (nested ones too) decorated with ``@shard``
    (``kind="shard"``) or ``@stage`` (``kind="stage"``), in source order.

    ``tree`` is a ``MetadataWrapper`` (names resolved by libcst's
    ``QualifiedNameProvider``) or a ``Module`` (names resolved by ``scopes``,
    built here when not given)."""
    if isinstance(tree, MetadataWrapper):
        reader = _HintReader(kind, Locator(tree, path))
        tree.visit(reader)
        return reader.found
    if scopes is None:
        scopes = ModuleScopes(tree)
    reader = _HintReader(kind, Locator(tree, path), scopes.qualified_names)
    for cls in scopes.classes:
        reader.visit_ClassDef(cls)
    return reader.found


class _HintReader(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(
        self,
        kind: Kind,
        locate: Locator,
        qualified_names: Optional[Callable[[cst.CSTNode], AbstractSet[str]]] = None,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.names = SHARD_NAMES if kind == "shard" else STAGE_NAMES
        self.locate = locate
        self.found: list[ClassHint] = []
        self._names = qualified_names  # None: QualifiedNameProvider metadata
        self.arguments = HintArguments(kind, locate, self._qnames)

    def _qnames(self, node: cst.CSTNode) -> AbstractSet[str]:
        if self._names is not None:
            return self._names(node)
        # libcst's stubs type the provider's value as a Collection, not the set it is
        qnames: set[QualifiedName] = self.get_metadata(QualifiedNameProvider, node, set())  # type: ignore[arg-type]
        return {q.name for q in qnames}

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        hit: cst.Decorator | None = None
        for dec in node.decorators:
            expr = dec.decorator
            func = expr.func if isinstance(expr, cst.Call) else expr
            if self._qnames(func).isdisjoint(self.names):
                continue
            if hit is not None:
                raise self.locate.error(
                    dec,
                    f"class {node.name.value} has two @{self.kind} decorators; merge them into one",
                )
            if not isinstance(expr, cst.Call):
                raise self.locate.error(
                    dec,
                    f"@{self.kind} must be called with its hints, e.g. "
                    + (
                        "@shard(c_fc=Col(), c_proj=Row())"
                        if self.kind == "shard"
                        else '@stage(split=["h.4"]) or @stage(auto=True)'
                    ),
                )
            hit = dec
        if hit is None:
            return
        assert isinstance(hit.decorator, cst.Call)
        where = f"@{self.kind} on {node.name.value}"
        spec = self.arguments.read(hit.decorator, where)
        self.found.append(ClassHint(node.name.value, node, hit, spec))
