"""Make gradients whole after the backward passes of a step.

- data parallel: average every gradient over the dp group (one flat buffer
  per dtype, so one all-reduce instead of one per parameter);
- tied weights across pipeline stages (embedding and LM head): sum the
  gradient over exactly the stages that hold the weight, so every copy takes
  the same optimizer step and the copies stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = []


def _flat_all_reduce(tensors: list[torch.Tensor], group, scale: float | None) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        offset = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def reduce_gradients(module: nn.Module, ctx, pipeline=None) -> None:
    if ctx is None or not ctx.distributed:
        return
    if pipeline is not None:
        for tie in pipeline.ties:
            if tie.group is None:
                continue
            p = tie.local_param(module)
            if p is None:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=tie.group)
    if ctx.mesh.dp > 1:
        grads = []
        seen = set()
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        if grads:
            _flat_all_reduce(grads, ctx.dp_group, 1.0 / ctx.mesh.dp)
