"""Parameters, gradients and optimizer state sharded over dp: torch's FSDP2.

:class:`ShardedData` applies ``fully_shard`` over the dp axis of annot's
mesh to this rank's part of the model (its tp shard of its pipeline stages),
as torchtitan composes FSDP2 with tp and pp: each block is a unit, the root
holds the rest (embeddings, final norm, head, a weight tied between them).
Every parameter becomes a ``DTensor`` sharded on dim 0 over dp; an
optimizer built afterwards from ``model.parameters()`` keeps 1/dp of its
state. Gradients come out reduce-scattered: averaged over dp, each rank
holding its shard.

How a step drives it (:class:`~annot.parallel_model.ParallelModel` calls
``begin``, ``arm`` and ``finish`` where it would drive the dp all-reduce):

- without a pipeline FSDP2's own hooks run: each unit is all-gathered
  before its forward and backward and freed after, and its gradient
  reduce-scattered as its backward ends. ``begin`` turns the reduction off,
  ``arm`` turns it on for the backward that gives the step's last
  gradients (the last microbatch), so earlier microbatches only accumulate;
- in a pipeline a stage runs forward and backward several times per step,
  in the schedule's order, and not always through its root's ``__call__``
  (stage methods, replayed nested stages, split backward). There FSDP2's
  forward hooks are removed: ``begin`` all-gathers every unit once for the
  step (autograd accumulates into the gathered parameters) and ``finish``
  reduce-scatters the accumulated gradients and frees the gathered
  parameters, the way ``torch.distributed.pipelining``'s
  ``perform_reduce_grad`` drives FSDP2 (its private ``post_backward`` per
  parameter group, then the root's final callback): parameters are whole
  during the step and sharded at rest, as torchtitan's pp + FSDP2 keeps them
  (no resharding between microbatches).

Custom attributes of the original parameters (``annot_grad_sum``,
``annot_shard_dim``, ...) are copied onto the sharded ones, so the tp
bookkeeping keeps working; :func:`local` gives the tensor a collective over
another axis (tp partial sums, tied weights across stages) works on: the dp
shard, the same slice on every rank of that axis.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from annot.core.errors import MeshError

__all__ = ["ShardedData", "blocks_of", "local", "full", "shard_like", "copy_full_into"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered over its mesh), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(like: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``src``, a whole tensor, sharded as the DTensor ``like`` is: each rank
    keeps its own shard (no communication). ``src`` itself if ``like`` is
    not a DTensor."""
    if not isinstance(like, DTensor):
        return src
    return distribute_tensor(
        src.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )


def copy_full_into(t: torch.Tensor, src: torch.Tensor) -> None:
    """``t.copy_(src)`` where ``src`` is the whole tensor and ``t`` may be a DTensor."""
    t.copy_(shard_like(t, src.to(t.dtype)))


class ShardedData:
    """FSDP2 over ``dp_mesh`` (the dp axis of annot's DeviceMesh) on ``module``
    (in place), a unit per block of ``blocks`` and the root.

    ``pipelined``: the module runs as pipeline stages (see the module
    docstring); else FSDP2's hooks drive the collectives.

    A block that shares a parameter with the rest of the model (a weight
    tied between a block and the head) is left to the root's unit, which
    holds every use. Scalar parameters (FSDP2 shards along a dimension)
    stay whole: ``unreduced`` lists them, for annot's own dp average. Experts
    split over ep (``annot_ep``) stay as they are: each rank already holds
    ``1/ep`` of them, and their gradients are summed over the ranks that hold
    the same experts, not averaged over dp.

    Checked against torch 2.13's FSDP2; besides the private calls of
    ``torch.distributed.pipelining`` (``post_backward``, the root's final
    callback) it uses ``FSDPState._lazy_init``, the forward hook handles and
    each parameter's unsharded gradient (:meth:`begin`)."""

    def __init__(
        self,
        module: nn.Module,
        dp_mesh: DeviceMesh,
        blocks: list[nn.Module],
        *,
        pipelined: bool,
    ):
        self.pipelined = pipelined
        named = list(module.named_parameters(remove_duplicate=False))
        attrs = {n: {k: v for k, v in vars(p).items() if k.startswith("annot_")} for n, p in named}
        self.unreduced = list(
            {id(p): p for _, p in named if p.ndim == 0 and p.requires_grad}.values()
        )
        # experts split over ep stay this rank's (annot.runtime.grads.reduce sums them
        # over the ranks holding the same experts); FSDP2 shards the rest over dp
        experts = {p for _, p in named if p.__dict__.get("annot_ep", 1) > 1}
        ignored = set(self.unreduced) | experts
        uses = Counter(id(p) for _, p in named)

        def private(block: nn.Module) -> bool:
            mine = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
            return all(uses[i] == n for i, n in mine.items())

        # In a pipeline the units stay gathered for the whole step (begin .. finish);
        # else FSDP2's default: blocks freed after forward, the root kept for backward.
        reshard = False if pipelined else None
        self.units: list[FSDPModule] = [
            fully_shard(b, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
            for b in blocks
            if private(b)
        ]
        root = fully_shard(
            module, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored
        )
        self.units.append(root)
        self.root = root  # module itself, its class now an FSDPModule
        # A replica whose step left a parameter unused still joins its reduce-scatter.
        _reduce_scatter_unused(root)
        for name, p in module.named_parameters(remove_duplicate=False):
            for k, v in attrs.get(name, {}).items():
                setattr(p, k, v)
        # contract() gives fully_shard its .state; its overloads' stubs do not show it
        self.state = fully_shard.state(module)  # type: ignore[attr-defined]
        self.state._lazy_init()  # the root is known now, not at its first forward
        if pipelined:
            # begin .. finish drive every collective; FSDP2's forward hooks would
            # only re-wrap each unit's inputs (new tensor objects the replayed
            # stages' frame walk counts) and queue callbacks the step runs itself
            for st in self.state._state_ctx.all_states:
                st._pre_forward_hook_handle.remove()
                st._post_forward_hook_handle.remove()

    def _groups(self):
        for st in self.state._state_ctx.all_states:
            yield from st._fsdp_param_groups

    def begin(self) -> None:
        """A step begins: gradients accumulate unreduced until :meth:`arm`
        (no pipeline) or :meth:`finish` (pipeline, which also gathers every
        unit now, once for the step). What a step that raised left behind
        (gathered parameters, unreduced gradients) is dropped first."""
        self.reshard()
        for fp in (fp for group in self._groups() for fp in group.fsdp_params):
            fp.unsharded_accumulated_grad = None
            if hasattr(fp, "_unsharded_param"):
                fp._unsharded_param.grad = None
        self.root.set_requires_gradient_sync(False)
        if self.pipelined:
            self.root.set_is_last_backward(False)
            self.root.set_reshard_after_backward(False)
            for unit in self.units:
                unit.unshard()

    def gathered(self):
        """A step with no backward (an evaluation) in a pipeline: every unit
        gathered for it, as :meth:`begin` gathers them for a training step,
        and freed after it (FSDP2's own forward hooks are removed there)."""
        import contextlib

        stack = contextlib.ExitStack()
        if self.pipelined:
            for unit in self.units:
                unit.unshard()
            stack.callback(self.reshard)
        return stack

    def reshard(self) -> None:
        """Free every gathered unit: the module holds the sharded parameters
        (and their gradients) again."""
        for unit in self.units:
            unit.reshard()

    def arm(self) -> None:
        """The coming backward gives the step's last gradients (no pipeline):
        FSDP2 reduce-scatters each unit's as its backward ends."""
        if not self.pipelined:
            self.root.set_requires_gradient_sync(True)

    def finish(self) -> None:
        """After the step's last backward (pipeline): reduce-scatter every
        unit's accumulated gradient and free the gathered parameters. The
        scalar parameters (``unreduced``) are the caller's to average."""
        if not self.pipelined:
            return
        self.root.set_is_last_backward(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_requires_gradient_sync(True)
        for group in self._groups():
            group.post_backward()
        self.state._root_post_backward_final_callback()
        for unit in self.units:  # parameters no backward touched stay gathered otherwise
            unit.reshard()


def blocks_of(module: nn.Module, container: Optional[str]) -> list[nn.Module]:
    """The children of ``container`` (a path under ``module``) that hold
    parameters here (another stage's block is an empty placeholder), each
    an FSDP2 unit of its own."""
    if container is None:
        return []
    got = module.get_submodule(container)
    return [b for b in got.children() if next(b.parameters(), None) is not None]


def _reduce_scatter_unused(root: FSDPModule) -> None:
    """Have every replica join each reduce-scatter, also for a parameter its
    step left unused (else the replicas' collectives would not match)."""
    if not hasattr(root, "set_reduce_scatter_unused_params"):
        raise MeshError(
            f"parallelize(fsdp=True) on torch {torch.__version__}: its FSDP2 has no "
            "set_reduce_scatter_unused_params, which annot needs so that a replica whose step "
            "leaves a parameter unused still joins that parameter's reduce-scatter. Install "
            "a newer torch (2.13 has it), or leave fsdp off (dp then all-reduces full gradients)"
        )
    root.set_reduce_scatter_unused_params(True)
