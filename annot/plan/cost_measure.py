"""Measuring one segment for the cost model (:mod:`annot.plan.cost`): its
forward and backward FLOPs (``FlopCounterMode``), the bytes its forward saves
for backward (:class:`annot.plan.saved_bytes.SavedBytes`: each storage once,
by identity, parameter storages left out) and the
median time of forward + backward.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from annot.plan.cost_segments import Segment
from annot.plan.saved_bytes import SavedBytes, real_paths_on_meta
from annot.runtime.trees import map_tensors, tensors

__all__ = ["call", "detach", "measure"]


def detach(x: Any, grad: Optional[bool]) -> Any:
    """A fresh leaf copy of the structure; floating tensors require grad when
    ``grad`` is True, keep their own flag when it is None."""

    def fresh(x: torch.Tensor) -> torch.Tensor:
        t = x.detach()
        want = x.requires_grad if grad is None else grad
        return t.requires_grad_(bool(want) and (t.is_floating_point() or t.is_complex()))

    return map_tensors(fresh, x)


def call(fn: Callable[..., Any], state: Any) -> Any:
    return fn(*state) if isinstance(state, tuple) else fn(state)


def sync(tensors) -> None:
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def fwd_bwd(fn, state):
    out = call(fn, state)
    outs = [t for t in tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return out


def measure(seg: Segment, state: Any, params: list[nn.Parameter], repeats: int, warmup: int):
    """(forward flops, total flops, activation bytes, output, median seconds)."""
    saved = SavedBytes(params)
    with FlopCounterMode(display=False) as fwd_counter, real_paths_on_meta(), saved.counting():
        out = call(seg.fn, state)
    outs = [t for t in tensors(out) if t.requires_grad]
    with FlopCounterMode(display=False) as bwd_counter:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    fwd = int(fwd_counter.get_total_flops())
    total = fwd + int(bwd_counter.get_total_flops())

    probe = list(tensors(state)) + params
    times = []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        sync(probe)
        t0 = time.perf_counter()
        fwd_bwd(seg.fn, state)
        sync(probe)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return fwd, total, saved.total(), out, statistics.median(times)
