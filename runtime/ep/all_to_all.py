"""The one collective of expert parallelism: all-to-all with uneven splits,
as an autograd function (its backward is the all-to-all the other way).

``exchange_counts(send, group)`` tells each rank how many rows every other
rank sends it; ``all_to_all(x, recv, send, group)`` sends ``send[i]`` rows of
``x`` (in rank order) to rank ``i`` and returns the ``recv[i]`` rows from each
rank ``i``, concatenated in rank order. ``all_to_all_single`` works on gloo
and NCCL alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """``recv[i]``: the rows rank ``i`` of ``group`` sends this rank, from every
    rank's ``send`` (an int64 tensor of one count per rank)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group`` (``send[i]`` to rank ``i``), the
    ``recv[i]`` rows of each rank back; differentiable in ``x``."""
    if x.requires_grad and torch.is_grad_enabled():
        return _AllToAll.apply(x, recv, send, group)
    return _exchange(x, recv, send, group)
