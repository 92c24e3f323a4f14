"""Which tokens of a sequence each cp rank holds, and the loss made whole.

Load-balanced for causal attention (torchtitan's and Megatron's zig-zag): the
sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r``, so every rank's queries see as many earlier keys in
total: rank 0 the first and the last chunk, rank ``cp - 1`` the two middle ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from annot.core.errors import HintError

__all__ = ["check_length", "mean_over", "positions"]


def check_length(length: int, cp: int, where: str) -> None:
    """Refuse a sequence the zig-zag cannot cut into ``2 * cp`` equal chunks."""
    if length % (2 * cp):
        raise HintError(
            f"{where}: a sequence of {length} tokens cannot be split over cp={cp} ranks: "
            f"context parallelism cuts it into 2 * cp = {2 * cp} equal chunks (load-balanced "
            f"for the causal mask); pad it to a multiple of {2 * cp} (labels -100 on the "
            "padding), or use another cp"
        )


def positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (indices into the whole sequence) rank ``rank`` holds, in order."""
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_start = (2 * cp - 1 - rank) * chunk
    second = torch.arange(last_start, last_start + chunk, device=device)
    return torch.cat([first, second])


class _MeanOver(torch.autograd.Function):
    """Forward: the mean over ``group``; backward: the gradient as it is (each
    rank's backward computes its own part of the whole, summed later by the dp
    average of the gradients)."""

    @staticmethod
    def forward(ctx, x, group, size):
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out / size

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def mean_over(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``x`` averaged over the ranks of ``group`` (a cp group's loss: each rank
    holds its tokens' part); backward passes the gradient to this rank's part."""
    if size == 1:
        return x
    return _MeanOver.apply(x, group, size)
