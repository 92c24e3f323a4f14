"""annot's model as DCP sees it, for :mod:`annot.io.dcp`: what this rank holds,
by the single-device model's names (:func:`view_of`); a tp shard as DCP
chunks of the full tensor (:class:`Shard`) and the save and load planners
that speak DCP's chunk protocol for it; the collectives that save and load
coordinate the ranks with (skipped in a single process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from annot.core.errors import CheckpointError
from annot.runtime.fsdp import full

__all__ = [
    "Layout",
    "LoadPlanner",
    "SavePlanner",
    "Shard",
    "Target",
    "View",
    "all_gather",
    "dcp_error",
    "exchange",
    "from_rank0",
    "full_shape",
    "param_name",
    "view_of",
]

# (dim, chunks, tp) as in annot.runtime.tp.state_dict, then ep: the experts' split of
# dim 0 over the expert group (annot.runtime.ep.shards), the outer one
Layout = tuple[int, int, int, int]


# --------------------------------------------------------------------------- #
# A tp shard as DCP chunks of the full tensor.
# --------------------------------------------------------------------------- #


class Shard:
    """This rank's shard ``local`` of a tensor of full shape ``full``: the full
    tensor cut along ``dim`` into ``chunks`` equal blocks, of each of which
    this rank holds the ``rank``-th of ``tp`` slices (the layout of
    ``annot.runtime.tp.comm.split_local``), within the ``ep_rank``-th of
    ``ep`` blocks of dim 0 (its experts). Speaks DCP's chunk protocol."""

    def __init__(self, local: torch.Tensor, layout: Layout, rank: int, ep_rank: int = 0):
        dim, chunks, tp, ep = layout
        dim %= local.dim()
        full = list(local.shape)
        full[dim] *= tp
        full[0] *= ep
        self.full = torch.Size(full)
        n = local.shape[dim] // chunks  # this rank's length in each block
        block = self.full[dim] // chunks
        self.pieces: dict[torch.Size, torch.Tensor] = {}
        for c in range(chunks):
            offsets = [0] * local.dim()
            offsets[dim] = c * block + rank * n
            offsets[0] += ep_rank * local.shape[0]  # its experts (tp never splits dim 0 then)
            self.pieces[torch.Size(offsets)] = local.narrow(dim, c * n, n)
        self.properties = TensorProperties.create_from_tensor(local)

    def size(self) -> torch.Size:
        return self.full

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=p.size()) for o, p in self.pieces.items()]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=p.size()),
                    properties=self.properties,
                    size=self.full,
                ),
            )
            for o, p in self.pieces.items()
        ]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        piece = self.pieces.get(torch.Size(index.offset)) if index.offset is not None else None
        if piece is None:
            raise CheckpointError(f"{index.fqn}: no local chunk at offset {index.offset}")
        return piece


class SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.piece(index) if isinstance(obj, Shard) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner's _init_state_dict would replace values it does not
        # know (our Shard) with None; our buffers are allocated already.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.piece(index) if isinstance(obj, Shard) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        # DCP would torch.load(weights_only=False) these: code could run.
        raise CheckpointError(
            f"{read_item.dest_index.fqn}: stored as pickled bytes; annot checkpoints hold "
            "only tensors and never unpickle data"
        )


# --------------------------------------------------------------------------- #
# What this rank holds, by canonical (single-device) name.
# --------------------------------------------------------------------------- #


@dataclass
class Target:
    module: nn.Module
    plan: Any  # annot.runtime.pipeline.layout.PipelineLayout or None
    tp: int
    tp_rank: int
    distributed: bool
    rank: int
    mesh: Optional[tuple[int, int, int]]
    ep_rank: int = 0

    @staticmethod
    def of(model: nn.Module) -> Target:
        from annot.parallel_model import ParallelModel, unwrap

        model = unwrap(model)  # torch.compile(model)'s wrapper: its keys carry _orig_mod.
        if isinstance(model, ParallelModel):
            ctx = model.ctx
            m = ctx.mesh
            return Target(
                model.module, model.pipeline, m.tp, ctx.tp_rank, ctx.distributed,
                ctx.rank, (m.dp, m.pp, m.tp), ctx.ep_rank,
            )  # fmt: skip
        if isinstance(model, nn.Module):
            from annot.runtime.process_groups import current

            ctx = current()
            on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            return Target(
                model, None, ctx.mesh.tp if ctx else 1, ctx.tp_rank if ctx else 0, on,
                dist.get_rank() if on else 0, None,
            )  # fmt: skip
        raise CheckpointError(
            f"expected the model (an annot.ParallelModel or an nn.Module), got {type(model).__name__}"
        )

    def stored(self, t: torch.Tensor, layout: Optional[Layout]) -> Any:
        """What DCP writes for this rank's tensor ``t`` (or reads into it): its
        tp shard at its place in the whole; a tensor FSDP2 shards over dp is
        gathered over dp first (the replicas write the same bytes once)."""
        t = full(t)
        return t if layout is None else Shard(t, layout, self.tp_rank, self.ep_rank)


@dataclass
class View:
    tensors: dict[str, torch.Tensor]  # canonical name -> this rank's tensor
    layouts: dict[str, Layout]  # canonical name -> layout, for sharded ones
    aliases: dict[str, str]  # other name -> canonical name
    param_names: dict[int, str]  # id(parameter) -> canonical name


def view_of(target: Target) -> View:
    from annot.runtime.ep.shards import expert_degree
    from annot.runtime.tp.state_dict import shard_layouts

    by_id = shard_layouts(target.module)
    tie = {n: t.names[0] for t in getattr(target.plan, "ties", ()) for n in t.names}
    groups: dict[int, list[str]] = {}
    local: dict[int, torch.Tensor] = {}
    for key, t in target.module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
        local[id(t)] = t
    view = View({}, {}, {}, {})
    for tid, names in groups.items():
        canon = next((tie[n] for n in names if n in tie), names[0])
        t = local[tid]
        if t.is_meta:
            raise CheckpointError(f"{canon} is on the meta device; materialise the model first")
        view.tensors[canon] = t.detach()
        layout = by_id.get(tid)
        if layout is not None and layout[2] != target.tp:
            raise CheckpointError(
                f"{canon} is sharded for tp={layout[2]} but the mesh has tp={target.tp}"
            )
        ep = expert_degree(t)
        if layout is not None or ep > 1:
            view.layouts[canon] = (*(layout or (0, 1, 1)), ep)
        for n in [*names, *(k for k, v in tie.items() if v == canon)]:
            if n != canon:
                view.aliases[n] = canon
        if isinstance(t, nn.Parameter):
            view.param_names[tid] = canon
    return view


def full_shape(t: torch.Tensor, layout: Optional[Layout]) -> tuple[int, ...]:
    shape = list(t.shape)
    if layout is not None:
        shape[layout[0]] *= layout[2]
        shape[0] *= layout[3]
    return tuple(shape)


def param_name(view: View, p: torch.Tensor, gi: int) -> str:
    name = view.param_names.get(id(p))
    if name is None:
        raise CheckpointError(
            f"optimizer param group {gi} holds a {tuple(p.shape)} parameter that is not in the "
            "model; build the optimizer from model.parameters()"
        )
    return name


# --------------------------------------------------------------------------- #
# Collectives (skipped in a single process).
# --------------------------------------------------------------------------- #


def all_gather(target: Target, obj: Any) -> list[Any]:
    if not target.distributed:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def exchange(target: Target, err: Optional[BaseException], payload: Any, what: str) -> list:
    """Every rank's ``payload``; raises on every rank if any rank failed (so
    none is left waiting in a later collective)."""
    got = all_gather(target, (None if err is None else str(err), payload))
    if err is not None:
        raise err
    for r, (e, _) in enumerate(got):
        if e is not None:
            raise CheckpointError(f"{what}: rank {r} failed: {e}")
    return [p for _, p in got]


def from_rank0(target: Target, fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0; every rank gets its result or raises its error."""
    result = err = None
    if target.rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - the others must hear of any failure
            err = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    if target.distributed:
        box = [(result, err)]
        dist.broadcast_object_list(box, src=0)
        result, err = box[0]
    if err is not None:
        raise CheckpointError(f"{what}: {err}" if target.rank != 0 else err)
    return result


def dcp_error(e: CheckpointException, what: str) -> CheckpointError:
    parts = [f"rank {r}: {exc}" for r, (exc, _) in sorted(e.failures.items())]
    return CheckpointError(f"{what}: " + "; ".join(parts))
