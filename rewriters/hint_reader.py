"""Read ``@shard`` / ``@stage`` hints from source, as literals, never evaluated.

The rewriters need the hints of a model file without importing it (importing
runs the user's code, and the file may not even import on this machine). So
the decorators are read from the syntax tree:

* decorators and spec constructors are matched by *qualified name* with
  libcst's ``QualifiedNameProvider``: ``from annot import shard``,
  ``import annot as a; @a.shard(...)``, ``@annot.shard`` and
  ``@annot.hints.shard`` are all the same decorator, and ``a.Col(chunks=3)``
  is ``Col(chunks=3)``;
* every argument must be a literal (numbers, strings, ``True``/``False``/
  ``None``, tuples and lists of those, or a spec call with literal
  arguments). Anything else (a variable, a call to something else) is
  refused with a :class:`RewriteError` at its ``file:line:col``;
* the specs are then built with the real :mod:`annot.specs` classes, so a
  hint is validated exactly as ``@shard`` validates it at import time.

Entry points::

    read_shard_hints(source, path)   -> {class name: ShardSpec}
    read_stage_hints(source, path)   -> {class name: StageSpec}
    find_hints(wrapper, "shard", path) -> [ClassHint(name, node, decorator, spec)]
    find_hints(module, "shard", path, scopes=ModuleScopes(module))

``find_hints`` is the form a transformer uses: it returns the ``ClassDef`` and
``Decorator`` nodes of the tree it was given, so they can be edited or pointed
at in errors. Given a ``MetadataWrapper`` it asks libcst's
``QualifiedNameProvider``; given a ``Module`` it resolves names with
:class:`annot.rewriters.scopes.ModuleScopes` (the module's own bindings), which
costs a fraction of that on a large file.
:data:`BOUNDARY_NAMES` and :func:`has_qualified_name` let the stage splitter
recognise ``annot.boundary()`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal, Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper, QualifiedName, QualifiedNameProvider

from annot.errors import HintError, RewriteError
from annot.hints import ShardSpec, StageSpec, parse_bytes
from annot.rewriters.diagnostics import Locator, node_source, parse_source
from annot.rewriters.scopes import ModuleScopes
from annot.specs import SPEC_TYPES, Col, Heads, P, Partial, Replicate, Row, Vocab

__all__ = [
    "BOUNDARY_NAMES",
    "SHARD_NAMES",
    "SPEC_NAMES",
    "STAGE_NAMES",
    "ClassHint",
    "find_hints",
    "format_hint",
    "has_qualified_name",
    "read_shard_hints",
    "read_stage_hints",
]

SHARD_NAMES = frozenset({"annot.shard", "annot.hints.shard"})
STAGE_NAMES = frozenset({"annot.stage", "annot.hints.stage"})
BOUNDARY_NAMES = frozenset({"annot.boundary", "annot.hints.boundary"})
SPEC_NAMES: dict[str, type] = {
    f"{mod}.{cls.__name__}": cls
    for cls in (Col, Row, Vocab, Replicate, P, Partial, Heads)
    for mod in ("annot", "annot.specs")
}

Kind = Literal["shard", "stage"]
Hint = Union[ShardSpec, StageSpec]
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

    def _qnames(self, node: cst.CSTNode) -> AbstractSet[str]:
        if self._names is not None:
            return self._names(node)
        qnames: set[QualifiedName] = self.get_metadata(QualifiedNameProvider, node, set())
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
        kwargs = self._keywords(hit.decorator, where)
        spec = self._shard(kwargs, where) if self.kind == "shard" else self._stage(kwargs, where)
        self.found.append(ClassHint(node.name.value, node, hit, spec))

    # ---- arguments -------------------------------------------------------

    def _keywords(self, call: cst.Call, where: str) -> dict[str, cst.Arg]:
        out: dict[str, cst.Arg] = {}
        for arg in call.args:
            if arg.star:
                raise self.locate.error(
                    arg,
                    f"{where}: {arg.star}-unpacking is not read; annot reads hints without "
                    "running your code, so write each hint out as name=Spec(...)",
                )
            if arg.keyword is None:
                raise self.locate.error(
                    arg,
                    f"{where}: positional argument {node_source(arg.value)!r}; "
                    f"@{self.kind} takes keyword arguments only, e.g. "
                    + ("@shard(c_fc=Col())" if self.kind == "shard" else "@stage(auto=True)"),
                )
            name = arg.keyword.value
            if name in out:
                raise self.locate.error(arg, f"{where}: argument {name}= given twice")
            out[name] = arg
        return out

    def _shard(self, kwargs: dict[str, cst.Arg], where: str) -> ShardSpec:
        specs = {}
        local: tuple[str, ...] = ()
        for name, arg in kwargs.items():
            if name == "local":
                value = self._literal(arg.value, where, name)
                if isinstance(value, str):
                    value = (value,)
                if not isinstance(value, (tuple, list)) or not all(
                    isinstance(n, str) and n.isidentifier() for n in value
                ):
                    bad = arg.value
                    if isinstance(bad, (cst.Tuple, cst.List)):
                        bad = next(
                            (
                                el.value
                                for el in bad.elements
                                if not isinstance(el.value, cst.SimpleString)
                                or not str(el.value.evaluated_value).isidentifier()
                            ),
                            bad,
                        )
                    raise self.locate.error(
                        bad,
                        f"{where}: local={node_source(arg.value)}; expected a tuple of "
                        'attribute or variable names, e.g. local=("n_head", "n_embd")',
                    )
                local = tuple(value)
            else:
                specs[name] = self._spec(arg.value, where, name)
        return ShardSpec(specs, local)

    def _spec(self, expr: cst.BaseExpression, where: str, name: str):
        func = expr.func if isinstance(expr, cst.Call) else expr
        cls = None
        for q in self._qnames(func):
            cls = SPEC_NAMES.get(q, cls)
        if cls is None or not isinstance(expr, cst.Call):
            what = "a spec class, not a spec" if cls is not None else "not a spec"
            raise self.locate.error(
                expr,
                f"{where}: {name}={node_source(expr)} is {what}; write one of "
                "Col(), Row(), Vocab(), Replicate(), P(...), Partial() or Heads() (imported from annot), "
                f"e.g. {name}=Col()",
            )
        args = []
        kwargs = {}
        for arg in expr.args:
            if arg.star:
                raise self.locate.error(
                    arg, f"{where}: {name}=: unpacking in a spec is not read; write the values out"
                )
            value = self._literal(arg.value, where, name)
            if arg.keyword is None:
                args.append(value)
            else:
                kwargs[arg.keyword.value] = value
        try:
            spec = cls(*args, **kwargs)
        except HintError as exc:
            raise self.locate.error(expr, f"{where}: {name}=: {exc}") from None
        except TypeError as exc:
            raise self.locate.error(expr, f"{where}: {name}={node_source(expr)}: {exc}") from None
        assert isinstance(spec, SPEC_TYPES)
        return spec

    def _stage(self, kwargs: dict[str, cst.Arg], where: str) -> StageSpec:
        known = ("split", "auto", "cost", "memory", "checkpoint")
        values = {}
        for name, arg in kwargs.items():
            if name not in known:
                raise self.locate.error(
                    arg,
                    f"{where}: unknown argument {name}=; @stage takes "
                    + ", ".join(f"{k}=" for k in known),
                )
            values[name] = (self._literal(arg.value, where, name), arg.value)

        def bad(name: str, expected: str) -> RewriteError:
            node = values[name][1]
            return self.locate.error(
                node, f"{where}: argument {name}={node_source(node)}; expected {expected}"
            )

        split, auto = values.get("split", ((), None))[0], values.get("auto", (False, None))[0]
        if isinstance(split, str):
            split = (split,)
        if not isinstance(split, (tuple, list)) or not all(isinstance(s, str) and s for s in split):
            raise bad("split", 'a list of module paths, e.g. split=["h.4", "h.8"]')
        if not isinstance(auto, bool):
            raise bad("auto", "True or False")
        if auto and split:
            raise bad("auto", "either split=[...] or auto=True, not both")
        cost = values.get("cost", (None, None))[0]
        if cost not in (None, "time", "flops", "params"):
            raise bad("cost", "'time', 'flops' or 'params'")
        memory = values.get("memory", (None, None))[0]
        if memory is not None:
            try:
                memory = parse_bytes(memory, where)
            except HintError:
                raise bad("memory", "bytes as an int or a string like '16GiB'") from None
        checkpoint = values.get("checkpoint", (False, None))[0]
        if not isinstance(checkpoint, bool):
            raise bad("checkpoint", "True or False")
        return StageSpec(tuple(split), auto, cost, memory, checkpoint)

    def _literal(self, expr: cst.BaseExpression, where: str, name: str):
        """The value of a literal expression; anything else is refused."""
        if isinstance(expr, (cst.Integer, cst.Float)):
            return expr.evaluated_value
        if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
            value = expr.evaluated_value
            if isinstance(value, str):
                return value
        if isinstance(expr, cst.Name) and expr.value in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[expr.value]
        if (
            isinstance(expr, cst.UnaryOperation)
            and isinstance(expr.operator, cst.Minus)
            and isinstance(expr.expression, (cst.Integer, cst.Float))
        ):
            return -expr.expression.evaluated_value
        if isinstance(expr, (cst.Tuple, cst.List)):
            items = []
            for el in expr.elements:
                if isinstance(el, cst.StarredElement):
                    break
                items.append(self._literal(el.value, where, name))
            else:
                return tuple(items) if isinstance(expr, cst.Tuple) else items
        raise self.locate.error(
            expr,
            f"{where}: argument {name}: {node_source(expr)} is not a literal; annot reads "
            "hints without running your code, so write the value itself "
            "(a number, a string, True/False/None, or a tuple of those)",
        )


def _quote(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_quote(v) for v in value)
        if isinstance(value, tuple):
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        return f"[{inner}]"
    return repr(value)


def format_hint(spec: Hint) -> str:
    """The decorator that records ``spec``, as one line of source:
    ``@shard(c_attn=Col(chunks=3), local=("n_head",))``, ``@stage(auto=True)``."""
    if isinstance(spec, ShardSpec):
        args = []
        for name, s in spec.specs.items():
            if isinstance(s, P):
                dims = [_quote(d) for d in s.dims]
                if s.chunks != 1:
                    dims.append(f"chunks={s.chunks}")
                args.append(f"{name}=P({', '.join(dims)})")
            else:
                args.append(f"{name}={s!r}")
        if spec.local:
            args.append(f"local={_quote(spec.local)}")
        return f"@shard({', '.join(args)})"
    args = []
    if spec.split:
        args.append(f"split={_quote(list(spec.split))}")
    if spec.auto:
        args.append("auto=True")
    if spec.cost is not None:
        args.append(f"cost={_quote(spec.cost)}")
    if spec.memory is not None:
        args.append(f"memory={spec.memory}")
    if spec.checkpoint:
        args.append("checkpoint=True")
    return f"@stage({', '.join(args)})"
