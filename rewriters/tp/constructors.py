"""Step 2 of the tensor-parallel rewrite: swap the constructors in ``__init__``.

For each spec'd attribute of a hinted class, :meth:`ConstructorEdits.plan_init`
finds where ``__init__`` assigns it (also as a key of an ``nn.ModuleDict``),
checks that the spec fits what is built (``Vocab()`` on an ``nn.Embedding``,
``P(...)`` on an ``nn.Parameter``, ...) and plans the swap, keeping the user's
arguments as written::

    self.c_attn = nn.Linear(d, 3 * d)   ->  ColumnParallelLinear(d, 3 * d, chunks=3, tp=2)
    self.w = nn.Parameter(t)            ->  shard_parameter(nn.Parameter(t), dim=0, tp=2)
    self.fc1 = linear_layer(d, h)       ->  column_parallel(linear_layer(d, h), tp=2)

A call annot cannot name is kept and what it builds is converted by its
runtime type (:mod:`annot.runtime.tp.convert`). An attribute assigned by
different calls (one per branch of an ``if``, as x-transformers' ``to_out``)
has each site planned by its own call, so the hint follows the branch taken::

    if out_bias:
        self.to_out = nn.Linear(inner, dim)    ->  RowParallelLinear(inner, dim, tp=2)
    else:
        self.to_out = LinearNoBias(inner, dim) ->  row_parallel(LinearNoBias(inner, dim), tp=2)

It returns the paths of the non-gathered ``Col()`` submodules, where sharded
values start.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from annot.core.hints import ShardSpec
from annot.core.specs import (
    PARALLEL_LAYERS,
    Col,
    Experts,
    Heads,
    P,
    Replicate,
    Row,
    Vocab,
    parallel_layer,
    partial_sum,
)
from annot.rewriters.source.diagnostics import node_source
from annot.rewriters.tp.edits import TpEdits
from annot.rewriters.tp.syntax import assignments, first_param, self_path, unpack, with_args

__all__ = ["ConstructorEdits"]

TP_LAYERS = "annot.runtime.tp.layers"
TP_CONVERT = "annot.runtime.tp.convert"

LINEAR = frozenset({"torch.nn.Linear", "torch.nn.modules.linear.Linear"})
EMBEDDING = frozenset({"torch.nn.Embedding", "torch.nn.modules.sparse.Embedding"})
# HF transformers' GPT-2 projection: a Linear with weight (in, out), built as Conv1D(nf=out, nx=in).
CONV1D = frozenset({"transformers.pytorch_utils.Conv1D", "transformers.Conv1D"})
PARAMETER = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
MODULE_DICT = frozenset({"torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"})

_KIND_NAMES = {
    "linear": "nn.Linear",
    "conv1d": "transformers Conv1D",
    "embedding": "nn.Embedding",
    "parameter": "nn.Parameter",
}
# (HF transformers' Conv1D is accepted wherever nn.Linear is; the message keeps to torch's layers)
_SUPPORTED = (
    "annot shards nn.Linear (Col(), Row()), nn.Embedding (Vocab(), Col()) and nn.Parameter "
    "(P(...)); Replicate() keeps any attribute whole"
)


def _kwarg(name: str, value: str) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name(name),
        value=cst.parse_expression(value),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
        ),
    )


class ConstructorEdits(TpEdits):
    """Plans the constructor swaps of a hinted class's ``__init__``."""

    def plan_init(
        self,
        cls: cst.ClassDef,
        init: cst.FunctionDef,
        spec: ShardSpec,
        decorator: Optional[cst.Decorator],
    ) -> set[tuple[str, ...]]:
        """Plan the constructor swaps; return the paths of non-gathered Col()
        submodules (``("lm_head",)``, ``("transformer", "lm_head")``)."""
        first = first_param(init)
        assert first is not None
        sites, assigned = self._init_sites(init, first.name.value, spec)
        col_paths: set[tuple[str, ...]] = set()
        for name, s in spec.specs.items():
            if isinstance(s, Heads) or (isinstance(s, Experts) and not partial_sum(s)):
                continue  # applied to the built module, by path
            found = sites.get(name, [])
            if not found and self.extra_by_path and self._hint_arg(decorator, name) is None:
                continue  # a hint from outside, on what a base's __init__ assigns: by path
            if not found:
                where = self._hint_arg(decorator, name) or cls.name
                listing = ", ".join(f"self.{a}" for a in assigned) or "no attributes"
                raise self.locate.error(
                    where,
                    f"{name}={s!r}: {cls.name.value}.__init__ never assigns self.{name} (it "
                    f"assigns {listing}); a hint names an attribute that __init__ sets, "
                    f"e.g. self.{name} = nn.Linear(...)",
                )
            if isinstance(s, Replicate):
                continue
            if partial_sum(s):  # any module: its calls are wrapped, not swapped
                for _, value in found:
                    self._plan_conversion(s, value)
                continue
            ctors = [(path, value, *self._constructor(value)) for path, value in found]
            varied = len({kind or label for _, _, kind, label in ctors}) > 1
            if varied:
                self._check_branches(name, s, ctors)
            for path, value, kind, label in ctors:
                if self._fits(s, kind):
                    assert isinstance(value, cst.Call)
                    self._plan_constructor(s, value, kind)
                else:
                    if not varied:  # what it builds is known: refused now if it does not fit
                        self._check_fits(name, s, value, kind, label)
                    self._plan_conversion(s, value)
                if isinstance(s, Col) and not s.gather:
                    col_paths.add(path)
        return col_paths

    def _check_branches(
        self,
        name: str,
        s: object,
        ctors: list[tuple[tuple[str, ...], cst.BaseExpression, Optional[str], str]],
    ) -> None:
        """``self.<name>`` is assigned by different calls (x-transformers: one per
        branch of an ``if`` on a constructor flag). Each site is planned by its
        own call: a layer the hint fits is swapped, and any other call is kept
        and what it builds converted by its runtime type, so the hint follows
        the branch taken (and is refused there if that branch builds what it
        cannot shard). Refused here: ``P(...)``, and calls none of which builds
        a layer the hint fits."""
        _, first_value, first_kind, first_label = ctors[0]
        if isinstance(s, P):
            _, value, _, label = next(
                c for c in ctors if (c[2] or c[3]) != (first_kind or first_label)
            )
            raise self.locate.error(
                value,
                f"{name}={s!r}: self.{name} is assigned twice in __init__ with different "
                f"calls ({first_label}(...) on line {self.locate.line(first_value)}, "
                f"{label}(...) here); annot splits a raw parameter where nn.Parameter(...) "
                "builds it and cannot tell which call does, so assign it once",
            )
        if all(kind is not None and not self._fits(s, kind) for _, _, kind, _ in ctors):
            for _, value, kind, label in ctors:
                self._check_fits(name, s, value, kind, label)

    def _init_sites(
        self, init: cst.FunctionDef, self_name: str, spec: ShardSpec
    ) -> tuple[dict[str, list[tuple[tuple[str, ...], cst.BaseExpression]]], list[str]]:
        """Where ``__init__`` assigns each spec'd name: ``{name: [(path, value)]}``,
        and every attribute it assigns (for messages)."""
        sites: dict[str, list[tuple[tuple[str, ...], cst.BaseExpression]]] = {}
        assigned: list[str] = []
        for stmt in assignments(init.body):
            if isinstance(stmt, cst.Assign):
                targets = [t.target for t in stmt.targets]
            else:
                targets = [stmt.target]
            value = stmt.value
            for target in targets:
                for el in unpack(target):
                    path = self_path(el, self_name)
                    if path is None or len(path) != 1:
                        continue
                    name = path[0]
                    if name not in assigned:
                        assigned.append(name)
                    if name not in spec.specs:
                        continue
                    if el is not target or len(targets) > 1 or value is None:
                        raise self.locate.error(
                            el,
                            f"{name}={spec.specs[name]!r}: self.{name} is assigned in a "
                            "chained or unpacking assignment; annot rewrites "
                            f"self.{name} = nn.Linear(...) on its own line, so write it that way",
                        )
                    sites.setdefault(name, []).append((path, value))
                    continue
                path = self_path(target, self_name)
                if path is None or len(path) != 1 or value is None:
                    continue
                for key, entry in self.module_dict_entries(value):
                    shown = f"{path[0]}.{key}"
                    if shown not in assigned:
                        assigned.append(shown)
                    if key in spec.specs:
                        sites.setdefault(key, []).append(((path[0], key), entry))
        return sites, assigned

    def module_dict_entries(
        self, value: cst.BaseExpression
    ) -> list[tuple[str, cst.BaseExpression]]:
        """``nn.ModuleDict(dict(wte=X))`` / ``nn.ModuleDict({"wte": X})`` -> [("wte", X)]."""
        if not isinstance(value, cst.Call) or not self.qualified(value.func, MODULE_DICT):
            return []
        if len(value.args) != 1 or value.args[0].keyword is not None or value.args[0].star:
            return []
        arg = value.args[0].value
        out = []
        if isinstance(arg, cst.Call) and self.qualified(arg.func, frozenset({"builtins.dict"})):
            for a in arg.args:
                if a.keyword is not None:
                    out.append((a.keyword.value, a.value))
        elif isinstance(arg, cst.Dict):
            for el in arg.elements:
                if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                    key = el.key.evaluated_value
                    if isinstance(key, str):
                        out.append((key, el.value))
        return out

    def _hint_arg(self, decorator: Optional[cst.Decorator], name: str) -> Optional[cst.Arg]:
        if decorator is None or not isinstance(decorator.decorator, cst.Call):
            return None
        for arg in decorator.decorator.args:
            if arg.keyword is not None and arg.keyword.value == name:
                return arg
        return None

    def _constructor(self, value: cst.BaseExpression) -> tuple[Optional[str], str]:
        """(kind, label): kind is "linear" / "conv1d" / "embedding" / "parameter"
        or None for a call annot does not know; label is the callee as written."""
        if not isinstance(value, cst.Call):
            return None, node_source(value)
        label = node_source(value.func)
        for kind, names in (
            ("linear", LINEAR),
            ("conv1d", CONV1D),
            ("embedding", EMBEDDING),
            ("parameter", PARAMETER),
        ):
            if self.qualified(value.func, names):
                return kind, label
        return None, label

    @staticmethod
    def _fits(s: object, kind: Optional[str]) -> bool:
        """Whether ``s`` shards what a call of ``kind`` builds by swapping the call."""
        want = {Col: "linear", Row: "linear", Vocab: "embedding", P: "parameter"}[type(s)]
        if kind == want or (want == "linear" and kind == "conv1d"):
            return True
        return isinstance(s, Col) and kind == "embedding" and s.chunks == 1  # its columns

    def _check_fits(
        self, name: str, s: object, value: cst.BaseExpression, kind: Optional[str], label: str
    ) -> None:
        if self._fits(s, kind):
            return
        if kind is None and not isinstance(s, P):
            return  # built as written, converted by its runtime type (annot.runtime.tp.convert)
        head = f"{name}={s!r}: "
        if kind is None:
            what = f"{label}(...)" if isinstance(value, cst.Call) else label
            reason = (
                f"self.{name} is {what}, which annot does not know how to shard; "
                f"{_SUPPORTED}. Build it with a supported layer, or hint it Replicate()"
            )
        elif isinstance(s, Vocab):
            reason = (
                f"Vocab() splits the rows of an nn.Embedding, but self.{name} is an "
                f"{_KIND_NAMES[kind]}; "
                + (
                    "use Col() (its output feeds vocab_parallel_cross_entropy) or Row()"
                    if (kind, Row) in PARALLEL_LAYERS
                    else 'give the parameter a partition spec such as P("tp", None)'
                )
            )
        elif isinstance(s, P):
            use = "Col() or Row()" if (kind, Row) in PARALLEL_LAYERS else "Vocab()"
            reason = (
                f"P(...) splits a raw nn.Parameter, but self.{name} is an "
                f"{_KIND_NAMES[kind]}; use {use}"
            )
        elif kind == "embedding":
            reason = (
                f"{s!r} splits an nn.Linear, but self.{name} is an nn.Embedding; "
                "use Vocab() to split its rows, or Col() (no chunks) its columns"
            )
        else:
            reason = (
                f"self.{name} is an nn.Parameter; give it a partition spec such as "
                'P("tp", None) (split dim 0) or P(None, "tp") (split dim 1)'
            )
        raise self.locate.error(value, head + reason)

    def _plan_conversion(self, s: object, value: cst.BaseExpression) -> None:
        """A layer built by a call annot cannot name (a subclass, a factory,
        ``partial(nn.Linear, ...)``): keep the call and convert what it builds,
        ``column_parallel(linear_layer(d, h), tp=2)``, by its runtime type."""
        args = []
        if isinstance(s, Col):
            fn = "column_parallel"
            if s.chunks != 1:
                args.append(_kwarg("chunks", str(s.chunks)))
            if s.gather:
                args.append(_kwarg("gather", "True"))
        elif partial_sum(s):
            fn = "partial_module"
        else:
            fn = "row_parallel" if isinstance(s, Row) else "vocab_parallel"
            if isinstance(s, Row) and s.split_input:
                args.append(_kwarg("split_input", "True"))
        args.append(_kwarg("tp", str(self.tp)))
        self.needed_imports.add((TP_CONVERT, fn))
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        self.edit(
            value,
            lambda n: cst.Call(
                func=cst.Name(fn),
                args=[
                    cst.Arg(_expression(n), comma=space),
                    *(a.with_changes(comma=space) for a in args[:-1]),
                    args[-1],
                ],
            ),
        )

    def _plan_constructor(self, s: object, call: cst.Call, kind: Optional[str] = None) -> None:
        tp = _kwarg("tp", str(self.tp))
        if isinstance(s, P):
            dim = s.split_dim
            if dim is None:
                return  # P(None, None): replicated
            self.needed_imports.add((TP_LAYERS, "shard_parameter"))
            self.edit(
                call,
                lambda n: cst.Call(
                    func=cst.Name("shard_parameter"),
                    args=[
                        cst.Arg(
                            _expression(n),
                            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                        ),
                        *(
                            a.with_changes(
                                comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                            )
                            for a in [_kwarg("dim", str(dim))]
                            + ([_kwarg("chunks", str(s.chunks))] if s.chunks != 1 else [])
                        ),
                        tp,
                    ],
                ),
            )
            return
        extra = []
        assert kind is not None
        layer = parallel_layer(kind, s)
        if isinstance(s, Col):
            if s.chunks != 1:
                extra.append(_kwarg("chunks", str(s.chunks)))
            if s.gather:
                extra.append(_kwarg("gather", "True"))
        elif isinstance(s, Row) and s.split_input:
            extra.append(_kwarg("split_input", "True"))
        extra.append(tp)
        self.needed_imports.add((TP_LAYERS, layer))
        self.edit(call, lambda n: with_args(cst.ensure_type(n, cst.Call), cst.Name(layer), extra))


def _expression(node: cst.CSTNode) -> cst.BaseExpression:
    """An edit's node, which replaces an expression, as one."""
    assert isinstance(node, cst.BaseExpression), type(node).__name__
    return node
