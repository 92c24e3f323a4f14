"""The forward of a module hinted ``Experts()`` under expert parallelism:
tokens to the ranks that hold their experts, the module's own forward on what
arrives, the results back (:mod:`annot.runtime.ep.all_to_all`).

Routed experts (transformers': ``forward(tokens, index, weights)``): each
(token, choice) pair is sent, with its weight, to the rank of its expert,
sorted by expert; there the module's own forward runs on the pairs it
received as tokens with one choice each (the expert's local index, the
weight), so whatever the module does with a weight it does here; the rows go
back and each token sums its choices, in the order of its experts, as the
single-device loop over experts does. Dropless: every pair is computed;
an expert no token chose computes nothing, and its gradient is zero.

Dense experts (every expert on every token, ``forward(tokens)``): every
rank's tokens go to every rank of the group, each sums its own experts'
outputs, and the parts come back and are summed: an all-gather and a
reduce-scatter, both as all-to-all.

The backward of each all-to-all is the all-to-all back, so the expert
weights' gradients on a rank sum what every token of the group sent them.
Runs eagerly under ``torch.compile`` (the splits are data).
"""

from __future__ import annotations

import functools
import inspect

import torch

from annot.core.errors import HintError
from annot.runtime.ep.all_to_all import all_to_all, exchange_counts
from annot.runtime.ep.shards import expert_env

__all__ = ["expert_forward"]


@functools.cache
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def _arguments(module, args, kwargs) -> list:
    """The forward's arguments in its signature's order (read once per class)."""
    bound = _signature(type(module).forward).bind(module, *args, **kwargs)
    return list(bound.arguments.values())[1:]


def _refuse(module, values) -> HintError:
    kinds = [type(v).__name__ if not isinstance(v, torch.Tensor) else str(v.dtype) for v in values]
    return HintError(
        f"{type(module).__name__} is hinted Experts(), but its forward was called with "
        f"({', '.join(kinds)}); expert parallelism runs experts called as "
        "forward(tokens, index, weights) (routed: transformers' experts modules) or "
        "forward(tokens) (every expert on every token). Hint the module that takes one of "
        "these, or leave ep=1"
    )


@torch.compiler.disable
def expert_forward(self, *args, **kwargs):
    """``Experts()``'s forward (bound to the module by :func:`expert_parallel`)."""
    values = _arguments(self, args, kwargs)
    tensors = all(isinstance(v, torch.Tensor) for v in values)
    if tensors and len(values) == 3 and not values[1].is_floating_point():
        return _routed(self, *values)
    if tensors and len(values) == 1 and values[0].is_floating_point():
        return _dense(self, values[0])
    raise _refuse(self, values)


def _routed(module, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    group, ep, rank = expert_env()
    count = module.annot_experts
    per_rank = count // ep
    k = index.shape[-1]
    x = tokens.reshape(-1, tokens.shape[-1])  # (batch, seq, d) or (tokens, d): rows
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    keep = expert < count  # an index past the experts (transformers' padding) is no choice
    order, expert = order[keep], expert[keep]
    dest = expert // per_rank
    send = torch.bincount(dest, minlength=ep)
    recv = exchange_counts(send, group)
    send_l, recv_l = send.tolist(), recv.tolist()
    _count(module, x, send_l, recv_l, rank)
    token = order // k
    rows = all_to_all(x[token], recv_l, send_l, group)
    w = all_to_all(weights.reshape(-1)[order].unsqueeze(1), recv_l, send_l, group)
    local = all_to_all((expert - dest * per_rank).unsqueeze(1), recv_l, send_l, group)
    y = type(module).forward(module, rows, local, w)
    if rows.shape[0] == 0:  # no row came: keep this rank in the backward's all-to-alls
        y = _Joined.apply(y, rows, w)
    back = all_to_all(y, send_l, recv_l, group)
    out = torch.zeros((x.shape[0], *back.shape[1:]), dtype=back.dtype, device=back.device)
    return out.index_add(0, token, back).reshape(*tokens.shape[:-1], *back.shape[1:])


class _Joined(torch.autograd.Function):
    """``y`` made to depend on ``inputs`` (with a zero gradient for them): on a
    rank to which no row came, the experts' output depends on nothing, and
    without this the all-to-alls that brought the (no) rows would skip their
    backward on this rank while the other ranks wait in theirs."""

    @staticmethod
    def forward(ctx, y, *inputs):
        ctx.like = [(i.shape, i.dtype) for i in inputs]
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        zeros = (torch.zeros(s, dtype=d, device=grad.device) for s, d in ctx.like)
        return (grad, *zeros)


def _count(module, x: torch.Tensor, send: list[int], recv: list[int], rank: int) -> None:
    """Bytes this call's forward sends to other ranks (rows out, results back),
    for ``explain``; the backward sends as many again."""
    row = x.shape[-1] * x.element_size()
    module.__dict__["annot_sent_bytes"] = row * (sum(send) - send[rank] + sum(recv) - recv[rank])


def _dense(module, x: torch.Tensor):
    group, ep, rank = expert_env()
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    n = flat.shape[0]
    send = torch.full((ep,), n, dtype=torch.int64, device=x.device)
    recv = exchange_counts(send, group)
    send_l, recv_l = send.tolist(), recv.tolist()
    _count(module, flat, send_l, recv_l, rank)
    rows = all_to_all(flat.repeat(ep, 1), recv_l, send_l, group)
    y = type(module).forward(module, rows)
    parts = all_to_all(y, send_l, recv_l, group)
    return parts.view(ep, n, *parts.shape[1:]).sum(0).reshape(*shape[:-1], parts.shape[-1])
