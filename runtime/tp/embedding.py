"""Tensor-parallel embeddings: ``nn.Embedding`` split on the vocabulary
(:class:`VocabParallelEmbedding`, what ``Vocab()`` emits) or on the embedding
dim (:class:`ColumnParallelEmbedding`, what ``Col()`` on an embedding emits).

Both take ``nn.Embedding``'s arguments plus ``tp``; a given ``_weight`` is the
full table and each rank copies its block. The rewritten code imports them
from :mod:`annot.runtime.tp.layers`, which re-exports them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from annot.core.errors import HintError
from annot.runtime.tp.checks import check_degree, check_divisible, factory, mesh_for, tp_context
from annot.runtime.tp.comm import GatherFromTP, ReduceFromTP, all_reduce_

__all__ = ["VocabParallelEmbedding", "ColumnParallelEmbedding"]


def _table(
    layer: VocabParallelEmbedding | ColumnParallelEmbedding,
    full: tuple[int, int],
    dim: int,
    start: int,
    _weight: Optional[torch.Tensor],
    freeze: bool,
    device,
    dtype,
) -> None:
    """An embedding layer's ``weight``: this rank's ``full[dim] // tp`` rows
    (``dim`` 0) or columns (``dim`` 1) from ``start``. A given ``_weight`` is the
    full table and this rank copies its block (with tp=1 it is used as is);
    otherwise the block is initialised by the layer's ``reset_parameters``."""
    name = type(layer).__name__
    shape = list(full)
    shape[dim] //= layer.tp
    if _weight is None:
        layer.weight = nn.Parameter(torch.empty(shape, **factory(device, dtype)))
        layer.reset_parameters()
    else:
        if tuple(_weight.shape) != tuple(full):
            raise HintError(
                f"{name}: _weight has shape {tuple(_weight.shape)}, expected the full "
                f"table {tuple(full)}"
            )
        block = _weight if layer.tp == 1 else _weight.narrow(dim, start, shape[dim])
        layer.weight = nn.Parameter(block if layer.tp == 1 else block.detach().clone())
    layer.weight.requires_grad_(not freeze)


def _lookup(
    layer: VocabParallelEmbedding | ColumnParallelEmbedding, ids: torch.Tensor
) -> torch.Tensor:
    """``F.embedding`` of ``layer``'s whole weight with its ``nn.Embedding`` options."""
    return F.embedding(
        ids,
        layer.weight,
        layer.padding_idx,
        layer.max_norm,
        layer.norm_type,
        layer.scale_grad_by_freq,
        layer.sparse,
    )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` split on the vocabulary: rank ``r`` holds the contiguous
    rows ``[r * V/tp, (r + 1) * V/tp)``. Ids outside the block look up zeros and
    the ranks' results are all-reduced, so every rank gets the full lookup.

    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused with tp > 1
    (each needs the whole table); with tp=1 this is ``nn.Embedding`` exactly.
    A given ``_weight`` is the full table: this rank copies its block.
    """

    weight: nn.Parameter  # set by _table

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[torch.Tensor] = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        *,
        tp: int = 1,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_degree(name, tp)
        if tp > 1:
            for arg, value, default in (
                ("max_norm", max_norm, None),
                ("scale_grad_by_freq", scale_grad_by_freq, False),
                ("sparse", sparse, False),
            ):
                if value != default:
                    raise HintError(
                        f"{name}: {arg}={value!r} is not supported with tp > 1 (it needs "
                        f"the whole table on one rank); drop {arg}, or leave this "
                        f"embedding unsharded (Replicate()) instead of Vocab()"
                    )
        check_divisible(name, "num_embeddings", num_embeddings, tp)
        ctx = mesh_for(name, tp)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise HintError(
                    f"{name}: padding_idx={padding_idx} must be within "
                    f"[-{num_embeddings}, {num_embeddings})"
                )
            padding_idx %= num_embeddings
        rank = ctx.tp_rank if ctx is not None else 0
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_local = num_embeddings // tp
        self.vocab_start = rank * self.num_embeddings_local
        self.padding_idx = padding_idx
        self.local_padding_idx = (
            padding_idx - self.vocab_start
            if padding_idx is not None
            and 0 <= padding_idx - self.vocab_start < self.num_embeddings_local
            else None
        )
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self.tp = tp
        full = (num_embeddings, embedding_dim)
        _table(self, full, 0, self.vocab_start, _weight, _freeze, device, dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight)
            if self.local_padding_idx is not None:
                self.weight[self.local_padding_idx].fill_(0)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        return {"weight": (0, 1)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return _lookup(self, ids)
        group = tp_context(type(self).__name__, self.tp).tp_group
        start = self.vocab_start
        outside = (ids < start) | (ids >= start + self.num_embeddings_local)
        local_ids = (ids - start).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        if out.requires_grad:
            return ReduceFromTP.apply(out, group, True)
        return all_reduce_(out, group)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return (
            f"{s}, tp={self.tp}, local_weight={tuple(self.weight.shape)}, "
            f"rows=[{self.vocab_start}, {self.vocab_start + self.num_embeddings_local})"
        )


class ColumnParallelEmbedding(nn.Module):
    """``nn.Embedding`` split on the embedding dim: rank ``r`` holds columns
    ``[r * D/tp, (r + 1) * D/tp)`` of every row, and its lookup is that slice of
    the full lookup (DTensor's ``ColwiseParallel`` on an embedding). Made for a
    per-head table whose columns are heads (T5's relative-position bias), read
    by the rank's own heads. ``gather=True`` all-gathers the output. Ids carry
    no gradient, so nothing is communicated unless gathered.

    ``max_norm`` is refused with tp > 1 (it renormalizes whole rows).
    """

    weight: nn.Parameter  # set by _table

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[torch.Tensor] = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        *,
        gather: bool = False,
        tp: int = 1,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_degree(name, tp)
        if tp > 1 and max_norm is not None:
            raise HintError(
                f"{name}: max_norm={max_norm!r} renormalizes whole rows, which no rank holds "
                "with tp > 1; drop max_norm, or leave this embedding unsharded (Replicate())"
            )
        check_divisible(name, "embedding_dim", embedding_dim, tp)
        ctx = mesh_for(name, tp)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self.gather = gather
        self.tp = tp
        rank = ctx.tp_rank if ctx is not None else 0
        full = (num_embeddings, embedding_dim)
        _table(self, full, 1, rank * (embedding_dim // tp), _weight, _freeze, device, dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight)
            if self.padding_idx is not None:
                self.weight[self.padding_idx].fill_(0)

    def annot_shard_layout(self) -> dict[str, tuple[int, int]]:
        return {"weight": (1, 1)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = _lookup(self, ids)
        if self.gather and self.tp > 1:
            ctx = tp_context(type(self).__name__, self.tp)
            out = GatherFromTP.apply(out, ctx.tp_group, self.tp, ctx.tp_rank, -1, 1)
        return out

    def extra_repr(self) -> str:
        gather = ", gather=True" if self.gather else ""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{gather}, tp={self.tp}, "
            f"local_weight={tuple(self.weight.shape)}"
        )
