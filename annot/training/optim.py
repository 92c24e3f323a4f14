"""Optimizer state sharded over data parallelism (ZeRO stage 1), on torch's
own :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`::

    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(dp=2, tp=2), seed=0)
    opt = annot.zero_optimizer(model, torch.optim.AdamW, lr=3e-4)
    ...
    model.backward(loss)   # gradients averaged over dp, tp partials and ties summed
    opt.step()             # each dp rank steps 1/dp of its parameters, then broadcasts them

Each rank holds the parameters of its tp shard and pipeline stages; the
replicas of those parameters along dp (the ranks with the same pp and tp
coordinates) split the optimizer state between them, so a rank keeps about
1/dp of the state it would otherwise hold (Adam's two moments per
parameter). Gradients are whole on every dp rank when ``opt.step()`` runs
(annot reduces them in ``model.backward``), so the update equals the plain
optimizer's, and the broadcast keeps the replicas identical.

This is ZeRO-1: parameters and gradients stay whole on each rank. For
ZeRO-3 build with ``annot.parallelize(..., fsdp=True)`` (torch's FSDP2,
:mod:`annot.runtime.fsdp`): parameters, gradients and so the state of any
optimizer built afterwards are sharded over dp, and ``zero_optimizer``
returns the plain optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from annot.parallel_model import ParallelModel, unwrap

__all__ = ["zero_optimizer", "state_bytes"]


def zero_optimizer(
    model: ParallelModel, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
) -> torch.optim.Optimizer:
    """``optimizer_class(model.parameters(), **defaults)`` with its state
    sharded over the dp axis of ``model``'s mesh. At dp = 1 (or on one
    process) it is the plain optimizer."""
    model = unwrap(model)  # what torch.compile(model) returned
    params = [p for p in model.parameters() if p.requires_grad]
    ctx = model.ctx
    if model.fsdp is not None:  # FSDP2 shards the parameters, so their state too
        return optimizer_class(params, **defaults)
    if ctx is None or not ctx.distributed or ctx.mesh.dp == 1:
        return optimizer_class(params, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params, optimizer_class=optimizer_class, process_group=ctx.dp_group, **defaults
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in this rank's optimizer state (after a step)."""
    from annot.runtime.fsdp import local

    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local shard
    return sum(
        local(v).numel() * v.element_size()  # FSDP2: this rank's dp shard
        for state in inner.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
