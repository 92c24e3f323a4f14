"""Cross-entropy over logits whose classes are sharded over the tp group.

``vocab_parallel_cross_entropy`` has ``F.cross_entropy``'s signature and
semantics. The tp rewriter emits it where ``F.cross_entropy`` is fed by a
non-gathered ``ColumnParallelLinear`` (an LM head), so the full ``(N, V)``
logits never exist on one rank: rank ``r`` holds classes
``[r * C_local, (r + 1) * C_local)``.

Numerically stable and exact, as in Megatron: two all-reduces per call, the
row max (MAX) and then one stacked SUM of ``sum(exp)``, the target logit
(and ``sum(logits)`` for label smoothing). The gradient is computed in closed
form from the saved local softmax; it needs no communication.

Supported: class-index targets of shape ``(N,)`` (also ``()`` with ``(C,)``
input and ``(N, d1, ...)`` with ``(N, C, d1, ...)`` input), ``ignore_index``,
``reduction`` in mean / sum / none (and the legacy ``size_average`` /
``reduce``), ``label_smoothing``. Refused with tp > 1: ``weight`` and
probability (floating-point) targets. Out-of-range class ids raise on CPU;
on GPU they are not checked (that would cost a host sync per call).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from annot.core.errors import HintError
from annot.runtime.tp.comm import all_reduce_, tp_env

__all__ = ["vocab_parallel_cross_entropy"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _VocabParallelCE(torch.autograd.Function):
    """Per-row losses ``(N,)`` (zero where ignored) from local logits ``(N, C_local)``."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, group, size, rank):
        n_local = logits.shape[-1]
        x = logits.float() if logits.dtype in _LOW_PRECISION else logits
        row_max = x.amax(dim=-1)
        row_max = all_reduce_(row_max, group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)  # the one (N, C_local) buffer, reused below

        start = rank * n_local
        valid = target != ignore_index
        inside = (target >= start) & (target < start + n_local)
        local_t = (target - start).masked_fill_(~inside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0)
        parts = [picked]
        if smoothing > 0:
            parts.append(shifted.sum(dim=-1))
        exp = shifted.exp_()
        parts.append(exp.sum(dim=-1))
        stats = all_reduce_(torch.stack(parts), group)  # (2 or 3, N): one collective

        sum_exp = stats[-1]
        log_z = sum_exp.log()
        loss = log_z - stats[0]
        if smoothing > 0:
            n_classes = n_local * size
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - stats[1] / n_classes)
        loss.masked_fill_(~valid, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, inside & valid, valid)
        ctx.smoothing = smoothing
        ctx.n_classes = n_local * size
        ctx.in_dtype = logits.dtype
        return loss  # float32 for half inputs: reduced before the cast back

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, local_t, hit, valid = ctx.saved_tensors
        g = grad_loss.to(softmax.dtype).masked_fill(~valid, 0.0)  # (N,)
        grad = softmax * g.unsqueeze(-1)  # fresh: the saved softmax stays intact
        at_target = (g * (1.0 - ctx.smoothing)).masked_fill_(~hit, 0.0)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -at_target.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad.sub_((ctx.smoothing / ctx.n_classes) * g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` for class-sharded logits (``input`` is this rank's
    ``(N, C / tp)`` slice, classes split contiguously by rank); the loss is
    the same on every rank. With no context or tp == 1 this *is*
    ``F.cross_entropy``."""
    group, size, rank = tp_env()
    if size == 1:
        return F.cross_entropy(
            input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
        )
    name = "vocab_parallel_cross_entropy"
    if weight is not None:
        raise HintError(
            f"{name}: weight= (per-class weights) is not supported with tp > 1; drop it, "
            f"or gather the logits (Col(gather=True)) and call F.cross_entropy"
        )
    if target.is_floating_point():
        raise HintError(
            f"{name}: probability targets (a floating-point target) are not supported with "
            f"tp > 1; pass class indices (an integer tensor)"
        )
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")

    if input.dim() == 1:  # (C,) with a () target
        logits, flat_t = input.unsqueeze(0), target.reshape(1)
    elif input.dim() == 2:
        logits, flat_t = input, target
    else:  # (N, C, d1, ...) with (N, d1, ...)
        logits = input.movedim(1, -1).reshape(-1, input.shape[1])
        flat_t = target.reshape(-1)
    if logits.shape[0] != flat_t.shape[0]:
        raise ValueError(
            f"{name}: expected target of {logits.shape[0]} class ids for input of shape "
            f"{tuple(input.shape)}, got target of shape {tuple(target.shape)}"
        )
    if not logits.is_cuda:
        n_classes = logits.shape[-1] * size
        bad = (flat_t != ignore_index) & ((flat_t < 0) | (flat_t >= n_classes))
        if bool(bad.any()):
            raise IndexError(
                f"{name}: target {int(flat_t[bad][0])} is out of bounds for {n_classes} classes"
            )

    losses = _VocabParallelCE.apply(
        logits, flat_t, ignore_index, float(label_smoothing), group, size, rank
    )
    if reduction == "none":
        out = losses.reshape(target.shape)
    elif reduction == "sum":
        out = losses.sum()
    else:
        out = losses.sum() / (flat_t != ignore_index).sum()
    return out.to(input.dtype)
