"""Which part of each full (single-device) tensor this rank holds, as boxes
of the full tensor: what a reader of a checkpoint stored in the
single-device layout reads for this rank.

The tp part, and the experts a rank holds under expert parallelism, are the
ones :func:`annot.runtime.init.deferred.shard_slicers`
cuts (the same slicer deferred initialization and ``materialize_from``
use): applied to a probe holding each index of the sharded dim, it says
which indices of that dim this rank keeps, in its order (``chunks > 1``:
one run per block). A parameter FSDP2 shards over dp (a ``DTensor``) is
then narrowed to this rank's dp chunk, as DTensor reports it to DCP
(``__create_chunk_list__``). Every other dim is whole::

    with annot.runtime.process_groups.use(ctx):
        for name, held in held_slices(model).items():
            for piece in held.pieces:      # full[piece.full] -> held.local[piece.local]
                ...
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from annot.runtime.ep.shards import expert_degree
from annot.runtime.fsdp import local as local_part
from annot.runtime.init.deferred import named_tensors, shard_slicers
from annot.runtime.tp.state_dict import shard_layouts

__all__ = ["Held", "Piece", "held_slices"]


@dataclass(frozen=True)
class Piece:
    """A box of the full tensor (``offsets``, ``sizes``) and where it lies in
    the tensor this rank fills (``local_offsets``, same ``sizes``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The view of ``t`` (this rank's tensor) this piece fills."""
        for d, (o, n) in enumerate(zip(self.local_offsets, self.sizes)):
            t = t.narrow(d, o, n)
        return t


@dataclass(frozen=True)
class Held:
    """What this rank holds of one tensor: ``local`` (the tensor to fill: a
    DTensor's local shard, else the tensor), the ``full`` shape and the
    ``pieces`` that make up ``local``."""

    tensor: torch.Tensor
    local: torch.Tensor
    full: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start, length, local start)`` of each run of consecutive values."""
    values = index.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][0] + runs[-1][1] == v:
            start, n, at = runs[-1]
            runs[-1] = (start, n + 1, at)
        else:
            runs.append((v, 1, i))
    return runs


def held_slices(model: nn.Module) -> dict[str, Held]:
    """Every parameter, buffer and tensor attribute of ``model`` (this rank's
    part, tied ones under each name) with the boxes of the full tensor this
    rank holds. Call inside ``annot.runtime.process_groups.use(ctx)``."""
    layouts = shard_layouts(model)
    slicer = shard_slicers(model)
    out: dict[str, Held] = {}
    for name, t in named_tensors(model).items():
        full = list(t.shape)
        layout = layouts.get(id(t))
        split = {}  # dim -> degree: tp's, and the experts' (dim 0) over ep
        if layout is not None:
            split[layout[0] % t.dim()] = layout[2]
        ep = expert_degree(t)
        if ep > 1:
            split[0] = split.get(0, 1) * ep
        for dim, n in split.items():
            full[dim] *= n
        index = [torch.arange(n) for n in full]
        if split:
            slice_ = slicer(name)
            assert slice_ is not None  # a sharded tensor has its rank's slicer
            box = [full[d] if d in split else 1 for d in range(t.dim())]
            for dim in split:  # each split dim probed alone: its indices this rank keeps
                probe = torch.arange(full[dim]).reshape(
                    [-1 if d == dim else 1 for d in range(t.dim())]
                )
                kept = slice_(probe.expand(box))
                index[dim] = (
                    kept.reshape(-1)
                    if t.dim() == 1
                    else kept.movedim(dim, 0).reshape(kept.shape[dim], -1)[:, 0]
                )
        part = local_part(t)
        if isinstance(t, DTensor):  # FSDP2: this dp rank's chunk of the tp shard
            chunks = t.__create_chunk_list__()  # none where this rank's chunk is empty
            if not chunks:
                out[name] = Held(t, part, tuple(full), ())
                continue
            offsets, sizes = chunks[0].offsets, chunks[0].sizes
            index = [i[o : o + n] for i, o, n in zip(index, offsets, sizes)]
        runs = [_runs(i) for i in index]
        pieces = tuple(
            Piece(
                tuple(r[0] for r in combo),
                tuple(r[1] for r in combo),
                tuple(r[2] for r in combo),
            )
            for combo in itertools.product(*runs)
        )
        out[name] = Held(t, part, tuple(full), pieces)
    return out
