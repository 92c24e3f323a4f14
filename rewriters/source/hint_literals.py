"""The arguments of a hint decorator as literals: read into specs without
running the user's code, and written back as one line of source.

:class:`HintArguments` reads the keyword arguments of one ``@shard(...)`` or
``@stage(...)`` call (:mod:`annot.rewriters.analysis.hint_reader` finds the call).
Every argument must be a literal (numbers, strings, ``True``/``False``/
``None``, tuples and lists of those, or a spec call with literal
arguments); anything else (a variable, a call to something else) is refused
with a :class:`RewriteError` at its ``file:line:col``. Spec constructors are
matched by qualified name (:data:`SPEC_NAMES`: ``a.Col(chunks=3)`` is
``Col(chunks=3)``) and built with the real :mod:`annot.core.specs` classes, so a
hint is validated exactly as ``@shard`` validates it at import time.

:func:`format_hint` is the way back: the decorator that records a spec.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Literal, Union

import libcst as cst

from annot.core.errors import HintError, RewriteError
from annot.core.hints import ShardSpec, StageSpec, parse_bytes
from annot.core.specs import (
    LOCAL_NAMES,
    SPEC_TYPES,
    Col,
    Experts,
    Heads,
    P,
    Partial,
    Replicate,
    Row,
    Vocab,
    local_name_problem,
)
from annot.rewriters.source.diagnostics import Locator, node_source

__all__ = ["SPEC_NAMES", "Hint", "HintArguments", "Kind", "format_hint"]

SPEC_NAMES: dict[str, type] = {
    f"{mod}.{cls.__name__}": cls
    for cls in (Col, Row, Vocab, Replicate, P, Partial, Heads, Experts)
    for mod in ("annot", "annot.core.specs")
}

Kind = Literal["shard", "stage"]
Hint = Union[ShardSpec, StageSpec]


class HintArguments:
    """Reads the arguments of ``@shard(...)`` (``kind="shard"``) or
    ``@stage(...)`` calls into specs; ``qualified_names`` resolves a spec
    constructor's name where it is written, ``locate`` points errors at it."""

    def __init__(
        self,
        kind: Kind,
        locate: Locator,
        qualified_names: Callable[[cst.CSTNode], AbstractSet[str]],
    ) -> None:
        self.kind = kind
        self.locate = locate
        self._qnames = qualified_names

    def read(self, call: cst.Call, where: str) -> Hint:
        """The spec ``call`` records; ``where`` (``"@shard on MLP"``) begins each error."""
        kwargs = self._keywords(call, where)
        return self._shard(kwargs, where) if self.kind == "shard" else self._stage(kwargs, where)

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
                    isinstance(n, str) and local_name_problem(n) is None for n in value
                ):
                    raise self._bad_local(arg.value, where)
                local = tuple(value)
            else:
                specs[name] = self._spec(arg.value, where, name)
        return ShardSpec(specs, local)

    def _bad_local(self, value: cst.BaseExpression, where: str) -> RewriteError:
        """The refusal of ``local=<value>``, at its first element that names no per-rank size."""
        bad, why = value, None
        for el in value.elements if isinstance(value, (cst.Tuple, cst.List)) else ():
            if not isinstance(el.value, cst.SimpleString):
                bad = el.value
                break
            why = local_name_problem(el.value.evaluated_value)
            if why is not None:
                bad = el.value
                break
        if why is not None:
            return self.locate.error(
                bad, f"{where}: local={node_source(value)}: {why}; {LOCAL_NAMES}"
            )
        return self.locate.error(
            bad,
            f"{where}: local={node_source(value)}; expected a tuple of attribute or variable "
            'names, e.g. local=("n_head", "n_embd")',
        )

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
                "Col(), Row(), Vocab(), Replicate(), P(...), Partial(), Heads() or Experts() (imported from annot), "
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
        known = ("split", "auto", "cost", "memory", "recompute", "checkpoint")
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
        # checkpoint= is recompute='s old name
        name = "checkpoint" if "checkpoint" in values else "recompute"
        recompute = values.get(name, (False, None))[0]
        if not isinstance(recompute, bool):
            raise bad(name, "True or False")
        return StageSpec(tuple(split), auto, cost, memory, recompute)

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
    if spec.recompute:
        args.append("recompute=True")
    return f"@stage({', '.join(args)})"
