"""Sharding specs: what a ``@shard`` hint says about one submodule or parameter.

Specs are plain, frozen, hashable data. They are validated on construction
(types with typeguard, values by hand) and carry no behaviour: the rewriter
reads them to choose a parallel layer, the runtime layers implement them.
Which layer a spec makes of which kind of layer is one table,
:data:`PARALLEL_LAYERS`.

=============  =====================================  =========================
spec           applies to                             meaning (Megatron layout)
=============  =====================================  =========================
``Col()``      ``nn.Linear``                          split out-features; input
                                                      replicated, output sharded
``Row()``      ``nn.Linear``                          split in-features; input
                                                      sharded (or split here:
                                                      ``split_input=True``),
                                                      output all-reduced
``Vocab()``    ``nn.Embedding``                       split rows (the vocabulary)
``Replicate``  any module / parameter                 every rank holds all of it
                                                      (``sum_grad``: partial
                                                      gradients summed over tp)
``P(...)``     an ``nn.Parameter`` attribute           one entry per tensor dim:
                                                      ``"tp"`` (split) or ``None``
``Partial()``  any module (MoE experts)               output a partial sum:
                                                      all-reduced; inputs'
                                                      gradients all-reduced
``Heads()``    a tensor argument of a module's        per-head, built for all
               forward (Bloom's ALiBi)                heads: each rank keeps
                                                      its own heads of it
``Experts()``  a module holding E experts' weights    expert parallel: each ep
               (leading dim E)                        rank holds E/ep experts;
                                                      tokens go by all-to-all
=============  =====================================  =========================
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Optional, Union

from typeguard import TypeCheckError, check_type

from annot.core.errors import HintError

__all__ = [
    "Col",
    "Row",
    "Vocab",
    "Replicate",
    "P",
    "Partial",
    "Heads",
    "Experts",
    "Local",
    "LOCAL_NAMES",
    "PARALLEL_LAYERS",
    "Spec",
    "TP_AXIS",
    "local_name_problem",
    "parallel_layer",
    "partial_sum",
]

TP_AXIS = "tp"


def _check(cls_name: str, arg: str, value: object, expected: object, what: str) -> None:
    try:
        check_type(value, expected)
    except TypeCheckError:
        raise HintError(
            f"{cls_name}({arg}={value!r}): {arg} must be {what}, got {type(value).__name__}"
        ) from None


@dataclass(frozen=True)
class Col:
    """Column-parallel ``nn.Linear``: each tp rank holds ``out_features / tp`` rows
    of the weight.

    ``chunks`` > 1 marks a fused weight (``chunks=3`` for a QKV projection): the
    out-features are split per chunk, so each rank gets its slice of q, k and v.
    ``gather=True`` all-gathers the output (full width on every rank); the
    default keeps it sharded for a following ``Row()`` or a vocab-parallel loss.
    """

    chunks: int = 1
    gather: bool = False

    def __post_init__(self) -> None:
        _check("Col", "chunks", self.chunks, int, "an int >= 1")
        _check("Col", "gather", self.gather, bool, "a bool")
        if isinstance(self.chunks, bool) or self.chunks < 1:
            raise HintError(f"Col(chunks={self.chunks!r}): chunks must be an int >= 1")

    def __repr__(self) -> str:
        args = []
        if self.chunks != 1:
            args.append(f"chunks={self.chunks}")
        if self.gather:
            args.append("gather=True")
        return f"Col({', '.join(args)})"


@dataclass(frozen=True)
class Row:
    """Row-parallel ``nn.Linear``: each tp rank holds ``in_features / tp`` columns
    of the weight; the input is the sharded output of a ``Col()`` and the output
    is all-reduced (the bias is added once, after the reduction).

    ``split_input=True``: the input is full on every rank (after a
    ``Col(gather=True)``, HF's ``rowwise_split_input``); each rank takes its
    slice of the last dim first (its gradient all-gathered in backward)."""

    split_input: bool = False

    def __post_init__(self) -> None:
        _check("Row", "split_input", self.split_input, bool, "a bool")

    def __repr__(self) -> str:
        return "Row(split_input=True)" if self.split_input else "Row()"


@dataclass(frozen=True)
class Vocab:
    """Vocabulary-parallel ``nn.Embedding``: each tp rank holds a contiguous block
    of ``num_embeddings / tp`` rows; lookups outside the block give zeros and the
    result is all-reduced."""

    def __repr__(self) -> str:
        return "Vocab()"


@dataclass(frozen=True)
class Replicate:
    """Every tp rank holds the full module or parameter (the default).

    ``sum_grad=True``: its forward reads tp-sharded activations (per-head q/k
    norms, a norm or bias inside a column-parallel region), so each rank's
    gradient is a partial sum; annot sums it over tp after backward. This is
    HF's ``replicated_with_grad_allreduce``. ``parallelize(verify=True)``
    finds the parameters that need it.
    """

    sum_grad: bool = False

    def __post_init__(self) -> None:
        _check("Replicate", "sum_grad", self.sum_grad, bool, "a bool")

    def __repr__(self) -> str:
        return "Replicate(sum_grad=True)" if self.sum_grad else "Replicate()"


@dataclass(frozen=True, init=False)
class P:
    """A JAX-style partition spec for a raw parameter: one entry per tensor dim,
    ``"tp"`` to split that dim over the tp axis or ``None`` to keep it whole.

    ``P("tp", None)`` splits dim 0 of a 2-D parameter. At most one dim may be
    split. ``chunks`` > 1 reads the split dim as that many equal blocks (a
    packed gate|up expert weight: ``P(None, "tp", None, chunks=2)``) and each
    rank holds its ``1/tp`` of every block.
    """

    dims: tuple[Optional[str], ...]
    chunks: int = 1

    def __init__(self, *dims: Optional[str], chunks: int = 1) -> None:
        for i, d in enumerate(dims):
            if d is not None and d != TP_AXIS:
                raise HintError(f"P(...): dim {i} is {d!r}; each entry must be {TP_AXIS!r} or None")
        if sum(d == TP_AXIS for d in dims) > 1:
            raise HintError(f"P{dims!r}: at most one dim may be split over {TP_AXIS!r}")
        _check("P", "chunks", chunks, int, "an int >= 1")
        if isinstance(chunks, bool) or chunks < 1:
            raise HintError(f"P(chunks={chunks!r}): chunks must be an int >= 1")
        object.__setattr__(self, "dims", tuple(dims))
        object.__setattr__(self, "chunks", chunks)

    @property
    def split_dim(self) -> Optional[int]:
        for i, d in enumerate(self.dims):
            if d == TP_AXIS:
                return i
        return None

    def __repr__(self) -> str:
        args = [repr(d) for d in self.dims]
        if self.chunks != 1:
            args.append(f"chunks={self.chunks}")
        return f"P({', '.join(args)})"


@dataclass(frozen=True)
class Partial:
    """A module whose output is a partial sum on each tp rank: its parameters
    are split Megatron-style *inside* it (``P(...)`` on them), as HF's MoE
    experts hold every expert's weights in one module (``moe_tp_experts``).
    Its floating-point tensor inputs enter a tp region (gradients all-reduced
    in backward) and its output is all-reduced."""

    def __repr__(self) -> str:
        return "Partial()"


@dataclass(frozen=True)
class Heads:
    """A per-head tensor argument of a module whose heads are split over tp,
    built for all heads outside it (Bloom's ALiBi bias, made once in the parent
    for every head): where it enters the module, each rank keeps its own heads.
    The hint names the argument like an attribute of the module::

        {"transformer.h.*.self_attention.alibi": Heads(dim=0, heads=cfg.n_head)}

    ``dim`` is the head dim. ``heads=n`` reads it as blocks of ``n`` heads (a
    flattened ``(batch * heads, ...)`` tensor: Bloom's ALiBi is ``(batch *
    n_head, 1, k)``); without it the dim holds exactly the heads. A dim of size
    1 broadcasts over the heads and is kept. Its gradient, if any, is
    all-gathered in backward."""

    dim: int = 1
    heads: Optional[int] = None

    def __post_init__(self) -> None:
        _check("Heads", "dim", self.dim, int, "an int")
        _check("Heads", "heads", self.heads, Optional[int], "an int >= 1 or None")
        if self.heads is not None and (isinstance(self.heads, bool) or self.heads < 1):
            raise HintError(f"Heads(heads={self.heads!r}): heads must be an int >= 1")

    def __repr__(self) -> str:
        args = [f"dim={self.dim}"]
        if self.heads is not None:
            args.append(f"heads={self.heads}")
        return f"Heads({', '.join(args)})"


@dataclass(frozen=True)
class Experts:
    """The experts of a mixture-of-experts layer, split over the ``ep`` axis of
    :class:`annot.Mesh`: each ep rank holds ``E / ep`` whole experts (dim 0 of
    every parameter of the module is the expert, as transformers and torchtitan
    store them: ``gate_up_proj`` ``(E, 2I, H)``), and tokens travel to their
    experts' ranks and back by all-to-all (:mod:`annot.runtime.ep.dispatch`).

    The module's forward is one of two kinds, told apart by its arguments:

    - routed, transformers' experts: ``forward(tokens (N, H), index (N, k),
      weights (N, k))`` returns ``sum_k weights * expert[index](tokens)``; each
      (token, choice) pair goes to the rank of its expert and its result back;
    - dense, every expert on every token: ``forward(tokens)`` returns the sum
      over the experts; every rank's tokens go to every rank, each sums its own
      experts' outputs, and the parts are summed back.

    Routing stays where it is (the router is replicated, every token routed
    on its own rank as on one device); dropless, no capacity. At ``ep = 1`` the
    hint alone changes nothing.

    ``partial=True``: under tp each expert is split inside, Megatron-style
    (``P(...)`` on its weights, as transformers' ``moe_tp_experts`` plan does),
    so the module's output is a partial sum over tp: ``Partial()`` and
    ``Experts()`` on one module. A transformers model's two plans give this."""

    partial: bool = False

    def __post_init__(self) -> None:
        _check("Experts", "partial", self.partial, bool, "a bool")

    def __repr__(self) -> str:
        return "Experts(partial=True)" if self.partial else "Experts()"


#: What a per-rank size name may be, for messages.
LOCAL_NAMES = (
    "a per-rank size is an attribute of the module or a local variable of its forward "
    "('n_head'), or a dotted path of attributes from the module ('config.n_head': the "
    "module's self.config.n_head)"
)


def local_name_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot name a per-rank size (:data:`LOCAL_NAMES`); None if it can."""
    if not isinstance(name, str):
        return f"{name!r} is a {type(name).__name__}, not a string"
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "self":
        return f"{name!r} starts with self; paths are relative to the module: {name[5:]!r}"
    if "" in parts:
        return f"{name!r} has an empty part"
    bad = next((p for p in parts if not p.isidentifier() or keyword.iskeyword(p)), None)
    if bad is not None:
        return f"{name!r}: {bad!r} is not a Python name"
    return None


@dataclass(frozen=True, init=False)
class Local:
    """External-hint form of ``@shard(local=...)``: names of attributes (or
    forward locals) that hold per-rank sizes (head counts, widths) and are
    divided by tp where they are read. A dotted name is a path from the
    module: ``Local("config.n_head")`` divides the module's reads of
    ``self.config.n_head``, leaving the (shared) config as it is."""

    names: tuple[str, ...]

    def __init__(self, *names: str) -> None:
        for n in names:
            why = local_name_problem(n)
            if why is not None:
                raise HintError(f"Local({n!r}): {why}; {LOCAL_NAMES}")
        object.__setattr__(self, "names", tuple(names))

    def __repr__(self) -> str:
        return f"Local({', '.join(repr(n) for n in self.names)})"


def partial_sum(spec: object) -> bool:
    """Whether ``spec`` makes a module's output a partial sum over tp."""
    return isinstance(spec, Partial) or (isinstance(spec, Experts) and spec.partial)


Spec = Union[Col, Row, Vocab, Replicate, P, Partial, Heads, Experts]
SPEC_TYPES = (Col, Row, Vocab, Replicate, P, Partial, Heads, Experts)

#: The tensor-parallel layer a spec makes of each kind of layer (``nn.Linear``,
#: HF transformers' ``Conv1D``, ``nn.Embedding``), by its name on
#: ``annot.runtime.tp.layers``: the rewriter writes the name into the source it
#: emits, ``annot.runtime.tp.convert`` builds the class of that name from a
#: built layer. A pair not here is no layer (the two check that first).
PARALLEL_LAYERS: dict[tuple[str, type], str] = {
    ("linear", Col): "ColumnParallelLinear",
    ("linear", Row): "RowParallelLinear",
    ("conv1d", Col): "ColumnParallelConv1D",
    ("conv1d", Row): "RowParallelConv1D",
    ("embedding", Col): "ColumnParallelEmbedding",  # its columns (no chunks)
    ("embedding", Vocab): "VocabParallelEmbedding",  # its rows, the vocabulary
}


def parallel_layer(kind: str, spec: object) -> str:
    """The name of the layer ``spec`` makes of a ``kind`` layer (``"linear"``,
    ``"conv1d"``, ``"embedding"``): :data:`PARALLEL_LAYERS`."""
    return PARALLEL_LAYERS[kind, type(spec)]
