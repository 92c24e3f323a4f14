"""The mesh at run time: process groups for dp, pp and tp on this rank.

Built on torch's DeviceMesh from torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...). The backend follows the device: NCCL when CUDA is
available, gloo on CPU. With one process and no environment, everything runs
locally without torch.distributed (tp=pp=dp=1).

The context is installed with :func:`use` (or :func:`init`) and read by the
parallel layers through :func:`current`, so generated code needs no group
arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from annot.core.errors import MeshError
from annot.core.mesh import Mesh

__all__ = []  # internal: use annot.parallelize


@dataclass
class ParallelContext:
    """What one rank knows about the mesh."""

    mesh: Mesh
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_mesh: Optional[object] = None  # torch.distributed.device_mesh.DeviceMesh
    groups: dict = field(default_factory=dict)  # axis -> ProcessGroup (None if local)

    @property
    def dp_rank(self) -> int:
        return self.mesh.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.mesh.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.mesh.coords(self.rank)[2]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert group (:class:`annot.Mesh`: ``ep``)."""
        return self.mesh.ep_coords(self.dp_rank)[1]

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context group: which part of the sequence it holds."""
        return self.mesh.cp_coords(self.dp_rank)[1]

    @property
    def batch_rank(self) -> int:
        """Which of the step's :attr:`~annot.Mesh.batches` this rank reads (the
        dp rank, but one per context group)."""
        return self.mesh.cp_coords(self.dp_rank)[0]

    @property
    def tp_group(self):
        return self.groups.get("tp")

    @property
    def cp_group(self):
        """The ranks that split one batch's sequence (``cp`` of the dp ranks)."""
        return self.groups.get("cp")

    @property
    def ep_group(self):
        """The ranks that hold the experts between them (``ep`` of the dp ranks)."""
        return self.groups.get("ep")

    @property
    def edp_group(self):
        """The ranks that hold the same experts (one per expert group; ``dp / ep``)."""
        return self.groups.get("edp")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    def axis_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        dp, pp, tp = self.mesh.coords(self.rank)
        m = self.mesh
        if axis == "tp":
            return [m.rank_of(dp, pp, t) for t in range(m.tp)]
        if axis == "pp":
            return [m.rank_of(dp, p, tp) for p in range(m.pp)]
        if axis == "dp":
            return [m.rank_of(d, pp, tp) for d in range(m.dp)]
        if axis == "cp":
            batch, _ = m.cp_coords(dp)
            return [m.rank_of(batch * m.cp + i, pp, tp) for i in range(m.cp)]
        group, e = m.ep_coords(dp)
        if axis == "ep":
            return [m.rank_of(group * m.ep + i, pp, tp) for i in range(m.ep)]
        if axis == "edp":
            return [m.rank_of(g * m.ep + e, pp, tp) for g in range(m.dp // m.ep)]
        raise MeshError(
            f"unknown mesh axis {axis!r}; expected 'dp', 'pp', 'tp', 'ep', 'edp' or 'cp'"
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def ranks_differing(self, value: object) -> list[int]:
        """The ranks whose ``value`` (anything with a stable ``repr``) differs
        from rank 0's: one all-gather of a digest, on every rank. Empty
        without torch.distributed."""
        if not self.distributed:
            return []
        import hashlib

        import torch.distributed as dist

        digest = hashlib.sha256(repr(value).encode()).hexdigest()
        found: list = [None] * self.world_size
        dist.all_gather_object(found, digest)
        return [r for r, d in enumerate(found) if d != found[0]]


_CURRENT: list[ParallelContext] = []


def current() -> Optional[ParallelContext]:
    """The innermost active context, or None outside :func:`use`."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def use(ctx: ParallelContext) -> Iterator[ParallelContext]:
    _CURRENT.append(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.pop()


def default_backend() -> str:
    """The backend follows the device: NCCL where every local rank has a GPU,
    gloo on CPU. ``ANNOT_BACKEND`` (e.g. ``gloo``) overrides the choice."""
    forced = os.environ.get("ANNOT_BACKEND")
    if forced:
        return forced
    if not torch.cuda.is_available():
        return "gloo"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise MeshError(
            f"{local} ranks on this host but {gpus} GPU(s): NCCL needs one GPU per rank. "
            f"Start at most {gpus} process(es) per host (torchrun --nproc-per-node {gpus}), "
            "or set ANNOT_BACKEND=gloo to run every rank on the CPU."
        )
    return "nccl"


def _leave() -> None:
    """At interpreter exit, end the process group annot started, so its
    threads are joined before teardown (left to the interpreter, a gloo rank
    could abort with "terminate called without an active exception" after
    the program's last line). Bounded: a peer that hung cannot hold the exit."""
    from annot.runtime.faults.failures import abort_process_group

    if dist.is_available() and dist.is_initialized():
        abort_process_group(wait_s=10.0)


def init(mesh: Mesh, *, timeout_s: float = 600.0) -> ParallelContext:
    """Join (or start) the process group from torchrun's environment and build
    the dp x pp x tp DeviceMesh. Validates the mesh against the world size."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        if env_world == 1 and mesh.size == 1 and "MASTER_ADDR" not in os.environ:
            return ParallelContext(mesh=mesh)
        mesh.validate(env_world)
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        atexit.register(_leave)  # the group annot started, annot ends
    world = dist.get_world_size()
    mesh.validate(world)
    rank = dist.get_rank()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        dev_type = "cuda"
    else:
        device = torch.device("cpu")
        dev_type = "cpu"
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh(dev_type, (mesh.dp, mesh.pp, mesh.tp), mesh_dim_names=("dp", "pp", "tp"))
    groups = {axis: dm.get_group(axis) for axis in ("dp", "pp", "tp")}
    ctx = ParallelContext(
        mesh=mesh, rank=rank, world_size=world, device=device, device_mesh=dm, groups=groups
    )
    axes = (("ep", "edp") if mesh.ep > 1 else ()) + (("cp",) if mesh.cp > 1 else ())
    ctx.groups.update(_borrowed_groups(ctx, axes))
    return ctx


def _borrowed_groups(ctx: ParallelContext, axes: tuple[str, ...]) -> dict:
    """This rank's groups of the axes that borrow dp ranks (``ep``, ``edp``,
    ``cp``): every rank builds every group of each kind, in the same order
    (``new_group`` is collective)."""
    m, mine = ctx.mesh, {}
    for axis in axes:
        seen = set()
        for r in range(m.size):
            ranks = ParallelContext(mesh=m, rank=r, world_size=m.size).axis_ranks(axis)
            if tuple(ranks) in seen:
                continue
            seen.add(tuple(ranks))
            group = dist.new_group(ranks)
            if ctx.rank in ranks:
                mine[axis] = group
    return mine
