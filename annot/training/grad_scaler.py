"""Loss scaling (float16 training) for a parallel model: one decision for every
rank.

torch's ``GradScaler`` skips ``opt.step()`` where this rank's gradients hold an
inf or NaN. Each rank of a parallel model holds only its stages' and shards'
gradients, so an overflow in one stage would skip the step there and let the
other stages step: the model's parts drift apart with no error (annot catches
it only through a weight tied across the stages). :func:`grad_scaler` is
torch's ``ShardedGradScaler``, which sums the "found inf" over a process
group before deciding, over every rank of the model::

    scaler = annot.grad_scaler(model)

    @annot.jit(model, microbatches=4)
    def train_step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            _, loss = model(x, y)
        model.backward(scaler.scale(loss))
        return loss

    train_step(x, y)
    scaler.step(opt)   # every rank steps, or every rank skips
    scaler.update()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from annot.parallel_model import ParallelModel, unwrap

__all__ = ["grad_scaler"]


def grad_scaler(model: ParallelModel, **options: Any):
    """A ``ShardedGradScaler`` over every rank of ``model`` (``options``: its
    ``init_scale``, ``growth_interval``, ...), on the model's device type.
    Every rank must call ``scaler.step(opt)`` with an optimizer, also a rank
    whose stages have nothing to train."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = unwrap(model)
    ctx = model.ctx
    group = dist.group.WORLD if ctx is not None and ctx.distributed else None
    device = ctx.device if ctx is not None else torch.device("cpu")
    scaler = ShardedGradScaler(device=device.type, process_group=group, **options)
    # The scale is made by the first scale(loss), which in a pipeline only the
    # last stage's rank calls; the others unscale gradients scaled by it too.
    scaler.scale(torch.zeros((), device=device))
    return scaler
