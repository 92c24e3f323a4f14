"""Tensor-parallel layers in Megatron's layout: what the tp rewriter emits.

==============================  ================================================
rewriter input                  emitted (``tp=N`` is the degree rewritten for)
==============================  ================================================
``Col()`` on ``nn.Linear``      ``ColumnParallelLinear(..., chunks=, gather=, tp=N)``
``Row()`` on ``nn.Linear``      ``RowParallelLinear(..., tp=N)``
``Vocab()`` on ``nn.Embedding`` ``VocabParallelEmbedding(..., tp=N)``
``Col()`` on ``nn.Embedding``   ``ColumnParallelEmbedding(..., gather=, tp=N)``
``P("tp", None)`` on a param    ``shard_parameter(nn.Parameter(...), dim=0, tp=N)``
``Col()`` on HF ``Conv1D``      ``ColumnParallelConv1D(nf, nx, chunks=, gather=, tp=N)``
``Row()`` on HF ``Conv1D``      ``RowParallelConv1D(nf, nx, tp=N)``
==============================  ================================================

HF ``Conv1D`` is ``transformers.pytorch_utils.Conv1D(nf, nx)`` (GPT-2's
projections): a linear layer whose weight is stored transposed, ``(nx, nf)`` =
(in, out), computed as ``addmm(bias, x, weight)``. Its parallel forms split the
same features as the Linear ones (out for Col, in for Row), so the split dim
of the weight is 1 for Col and 0 for Row.

This module holds the linear and ``Conv1D`` layers. The embeddings live in
:mod:`annot.runtime.tp.embedding`, ``shard_parameter`` in
:mod:`annot.runtime.tp.parameters` and the checks they share in
:mod:`annot.runtime.tp.checks`; the first two are re-exported here, so the
rewritten code imports every name above from this one module.

Each layer takes the same arguments as the torch layer it replaces, holds only
this rank's shard, and reads the tp group from ``annot.runtime.process_groups.current()``. It
checks that ``tp`` equals the current mesh's tp degree (:class:`MeshError`
otherwise) and that the sizes divide (:class:`HintError` otherwise).

Parameters are initialised with the torch layer's distribution (the full
layer's fan-in), independently per rank; exact parity with a single-device
model comes from ``annot.runtime.tp.state_dict.load_full_state_dict``. Each layer says
how its parameters map to the full tensors with ``annot_shard_layout()``:
``{param_name: (dim, chunks)}`` for the sharded ones (replicated ones absent).

With ``tp=1`` every layer is its torch counterpart plus one attribute check:
no autograd function, no context lookup.

Sequence parallelism (:mod:`annot.runtime.tp.sequence_parallel`) sets a row
layer's ``sequence_dim``: it reduce-scatters its output to sequence shards in
place of the all-reduce. A column layer reads its input whole, gathered by
the module around it (``sequence_gathered``), or gathers it itself from the
shards (``sequence_dim``).
"""

from __future__ import annotations

import atexit
import math
from typing import Optional

import torch
from torch import nn

from annot.core.errors import HintError
from annot.runtime.tp.checks import check_degree, check_divisible, factory, mesh_for, tp_context
from annot.runtime.tp.column_matmul import column_matmul, matmul
from annot.runtime.tp.comm import (
    CopyToTP,
    GatherFromTP,
    GatherSequence,
    ReduceFromTP,
    ReduceScatterSequence,
    ScatterToTP,
    all_reduce_,
    check_sequence_split,
    compiling,
)
from annot.runtime.tp.embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from annot.runtime.tp.parameters import ShardedParameter, shard_parameter

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelConv1D",
    "RowParallelConv1D",
    "VocabParallelEmbedding",
    "ColumnParallelEmbedding",
    "ShardedParameter",
    "shard_parameter",
    "forget_shared_inputs",
]


def _linear_init(weight: torch.Tensor, bias: Optional[torch.Tensor], fan_in: int) -> None:
    """nn.Linear's init (kaiming_uniform(a=sqrt(5)) and its bias rule) computed
    with the *full* layer's fan-in, so a shard has the full layer's distribution."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        nn.init.uniform_(weight, -bound, bound)
        if bias is not None:
            nn.init.uniform_(bias, -bound, bound)


# --------------------------------------------------------------------------- #
# Linear layers
# --------------------------------------------------------------------------- #


def _check_column(name: str, arg: str, size: int, tp: int, chunks: int) -> None:
    """The checks every column-parallel layer makes on its arguments."""
    check_degree(name, tp)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise HintError(f"{name}: chunks={chunks!r} must be an int >= 1")
    check_divisible(name, arg, size, tp, chunks)
    mesh_for(name, tp)


def _column_forward(
    layer: ColumnParallelLinear | ColumnParallelConv1D, x: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """Megatron's column block: replicated input (gradient all-reduced in
    backward, overlapped with the weight gradient: ``column_matmul``; a layer
    whose ``overlap_backward`` is False leaves autograd's order), this rank's
    slice of the output, gathered when asked. ``transposed``: the weight is
    stored ``(in, out)`` (HF ``Conv1D``)."""
    if layer.tp == 1:
        return matmul(x, layer.weight, layer.bias, transposed)
    ctx = tp_context(type(layer).__name__, layer.tp)
    group = ctx.tp_group
    # Under torch.compile no overlap: it keeps Python state between autograd nodes.
    traced = compiling()
    if layer.sequence_gathered:
        pass  # whole already: the region's gather reduce-scatters the partial gradient
    elif layer.sequence_dim is not None:
        dim = layer.sequence_dim
        x = _shared_entry(
            x, ("gather", id(group), dim), layer, GatherSequence, group, layer.tp, dim, not traced
        )
    elif x.requires_grad:
        # In place in backward: the gradient comes fresh from the matmuls' backward.
        x = _shared_entry(x, ("copy", id(group)), layer, CopyToTP, group, True, not traced)
    if layer.overlap_backward and not traced:
        y = column_matmul(x, layer.weight, layer.bias, transposed)
    else:
        y = matmul(x, layer.weight, layer.bias, transposed)
    if layer.gather:
        y = GatherFromTP.apply(y, group, layer.tp, ctx.tp_rank, -1, layer.chunks)
    return y


def _shared_entry(
    x: torch.Tensor,
    key: tuple,
    layer: ColumnParallelLinear | ColumnParallelConv1D,
    fn,
    *args,
) -> torch.Tensor:
    """``fn.apply(x, *args)``, shared by the column layers that read the same
    ``x`` one after another (q, k and v; gate and up): their summed input
    gradient is reduced once in backward instead of once per layer (exact: the
    reduction is linear), and a sequence-parallel input is gathered once.
    Megatron fuses those layers into one for this; here they stay the model's.

    Shared only while autograd records (``x`` needs grad, grad mode on): an
    entry made without a graph would cut the later layers off from ``x``'s
    gradient. A hit needs the same ``x`` object unchanged in place since (its
    version): after an in-place change a layer makes its own entry, as one
    that read the old values would route its gradient past the change. Module
    hooks that hand each layer a new input object (full backward hooks,
    ``CommDebugMode``'s module tracker) turn the sharing off: more collectives,
    the same result.

    One entry per ``key`` (the kind of entry, the group's id, the gather's
    dim): the last ``x`` entered, kept until the next column layer of that key
    replaces it or :func:`forget_shared_inputs` (which ``ParallelModel``
    calls after each forward, and ``atexit`` at the end: an entry holds a
    graph, whose nodes hold the process group).

    Under ``torch.compile`` a traced tensor has no version to read: the
    entry is shared only when the layer's weight needs a gradient, so the
    matmul saves its input for backward and autograd itself refuses an
    in-place change between the readers (the entry's output is a view of
    ``x``), as it refuses any change to a saved tensor."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return fn.apply(x, *args)
    traced = compiling()
    if traced and not layer.weight.requires_grad:
        return fn.apply(x, *args)
    last = _ENTRIES.get(key)
    if last is not None and last[0] is x and (traced or last[2] == x._version):
        return last[1]
    y = fn.apply(x, *args)
    _ENTRIES[key] = (x, y, None if traced else x._version)
    return y


# key -> (x, its entry, x's version; None when traced)
_ENTRIES: dict[tuple, tuple[torch.Tensor, torch.Tensor, Optional[int]]] = {}


def forget_shared_inputs() -> None:
    """Drop the column layers' shared input entries (see ``_shared_entry``)."""
    _ENTRIES.clear()


atexit.register(forget_shared_inputs)


def _row_forward(
    layer: RowParallelLinear | RowParallelConv1D, x: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """Megatron's row block: sharded input (split here first with
    ``split_input``), partial products all-reduced, the bias added once after
    the reduction."""
    if layer.tp == 1:
        return matmul(x, layer.weight, layer.bias, transposed)
    ctx = tp_context(type(layer).__name__, layer.tp)
    group = ctx.tp_group
    if layer.split_input:
        x = ScatterToTP.apply(x, group, layer.tp, ctx.tp_rank, -1, 1)
    y = matmul(x, layer.weight, None, transposed)  # partial sum; a fresh tensor, reduced in place
    if layer.sequence_dim is not None:
        check_sequence_split(y, layer.sequence_dim, layer.tp, type(layer).__name__)
        y = ReduceScatterSequence.apply(y, group, layer.tp, layer.sequence_dim)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)
    if y.requires_grad:
        y = ReduceFromTP.apply(y, group, True)
        # In y's dtype, as nn.Linear under autocast adds its bias (bf16 out).
        return y if layer.bias is None else y + layer.bias.to(y.dtype)
    y = all_reduce_(y, group)
    return y if layer.bias is None else y.add_(layer.bias)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` split on out-features: weight ``(out/tp, in)``, bias ``(out/tp)``.

    The input is replicated (its gradient is all-reduced in backward); the
    output is this rank's slice of out-features, or the full output with
    ``gather=True``. With ``chunks`` > 1 the full weight is read as ``chunks``
    equal blocks along out-features (a fused q|k|v projection) and each rank
    holds its ``1/tp`` of every block, so its local output is its own q|k|v
    heads; a gathered output is in the full layer's order.

    ``in_features`` / ``out_features`` are the full sizes, as on ``nn.Linear``;
    ``out_features_local`` is this rank's.
    """

    sequence_dim: Optional[int] = None  # set by sequence parallelism
    sequence_gathered = False  # input gathered by the enclosing region
    overlap_backward = True  # False: the weight gradient before the input's reduction

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        chunks: int = 1,
        gather: bool = False,
        tp: int = 1,
    ) -> None:
        super().__init__()
        _check_column(type(self).__name__, "out_features", out_features, tp, chunks)
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_local = out_features // tp
        self.chunks = chunks
        self.gather = bool(gather)
        self.tp = tp
        kw = factory(device, dtype)
        self.weight = nn.Parameter(torch.empty((self.out_features_local, in_features), **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_local, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init(self.weight, self.bias, self.in_features)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        layout = {"weight": (0, self.chunks)}
        if self.bias is not None:
            layout["bias"] = (0, self.chunks)
        return layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _column_forward(self, x, transposed=False)

    def extra_repr(self) -> str:
        parts = [
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.bias is not None}",
        ]
        if self.chunks != 1:
            parts.append(f"chunks={self.chunks}")
        if self.gather:
            parts.append("gather=True")
        parts.append(f"tp={self.tp}")
        parts.append(f"local_weight={tuple(self.weight.shape)}")
        return ", ".join(parts)


class RowParallelLinear(nn.Module):
    """``nn.Linear`` split on in-features: weight ``(out, in/tp)``, bias ``(out)``
    replicated.

    The input is already sharded on its last dim (the output of a
    ``ColumnParallelLinear``); each rank's partial product is all-reduced and
    the bias is added once, after the reduction.
    """

    sequence_dim: Optional[int] = None  # set by sequence parallelism

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        split_input: bool = False,
        tp: int = 1,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_degree(name, tp)
        check_divisible(name, "in_features", in_features, tp)
        mesh_for(name, tp)
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_local = in_features // tp
        self.split_input = bool(split_input)
        self.tp = tp
        kw = factory(device, dtype)
        self.weight = nn.Parameter(torch.empty((out_features, self.in_features_local), **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init(self.weight, self.bias, self.in_features)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        return {"weight": (1, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _row_forward(self, x, transposed=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, "
            + ("split_input=True, " if self.split_input else "")
            + f"tp={self.tp}, local_weight={tuple(self.weight.shape)}"
        )


# --------------------------------------------------------------------------- #
# HF transformers' Conv1D (a Linear with a transposed weight)
# --------------------------------------------------------------------------- #


class ColumnParallelConv1D(nn.Module):
    """HF ``Conv1D(nf, nx)`` split on its output features ``nf``: weight
    ``(nx, nf/tp)``, bias ``(nf/tp)``.

    The counterpart of :class:`ColumnParallelLinear` for GPT-2's transposed
    weights: replicated input (gradient all-reduced in backward), output this
    rank's slice of ``nf``, or the full output with ``gather=True``. With
    ``chunks`` > 1 (GPT-2's fused ``c_attn``: q|k|v, ``chunks=3``) each rank
    holds its ``1/tp`` of every block. ``nf`` / ``nx`` are the full sizes, as
    on ``Conv1D``; ``nf_local`` is this rank's.
    """

    sequence_dim: Optional[int] = None  # set by sequence parallelism
    sequence_gathered = False  # input gathered by the enclosing region
    overlap_backward = True  # False: the weight gradient before the input's reduction

    def __init__(
        self, nf: int, nx: int, *, chunks: int = 1, gather: bool = False, tp: int = 1
    ) -> None:
        super().__init__()
        _check_column(type(self).__name__, "nf", nf, tp, chunks)
        self.nf = nf
        self.nx = nx
        self.nf_local = nf // tp
        self.chunks = chunks
        self.gather = bool(gather)
        self.tp = tp
        # Conv1D's own init: weight ~ N(0, 0.02), bias zeros.
        self.weight = nn.Parameter(torch.empty(nx, self.nf_local))
        self.bias = nn.Parameter(torch.zeros(self.nf_local))
        nn.init.normal_(self.weight, std=0.02)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        return {"weight": (1, self.chunks), "bias": (0, self.chunks)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _column_forward(self, x, transposed=True)

    def extra_repr(self) -> str:
        parts = [f"nf={self.nf}", f"nx={self.nx}"]
        if self.chunks != 1:
            parts.append(f"chunks={self.chunks}")
        if self.gather:
            parts.append("gather=True")
        parts += [f"tp={self.tp}", f"local_weight={tuple(self.weight.shape)}"]
        return ", ".join(parts)


class RowParallelConv1D(nn.Module):
    """HF ``Conv1D(nf, nx)`` split on its input features ``nx``: weight
    ``(nx/tp, nf)``, bias ``(nf)`` replicated.

    The counterpart of :class:`RowParallelLinear`: the input is sharded on its
    last dim (a column-parallel output), the partial products are all-reduced
    and the bias is added once, after the reduction.
    """

    sequence_dim: Optional[int] = None  # set by sequence parallelism

    def __init__(self, nf: int, nx: int, *, split_input: bool = False, tp: int = 1) -> None:
        super().__init__()
        name = type(self).__name__
        check_degree(name, tp)
        check_divisible(name, "nx", nx, tp)
        mesh_for(name, tp)
        self.nf = nf
        self.nx = nx
        self.nx_local = nx // tp
        self.split_input = bool(split_input)
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.nx_local, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        return {"weight": (0, 1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _row_forward(self, x, transposed=True)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, tp={self.tp}, local_weight={tuple(self.weight.shape)}"
