"""Measured time of each unit of a model built on the meta device, one unit
materialized at a time (``annot plan --cost time`` from shapes).

:func:`time_units_alone` first runs the model once on meta, recording the
arguments each module a unit owns is called with (their shapes, dtypes and
whether they carry a gradient). Then, unit by unit, it gives that unit's
modules real (random) weights on the CPU, calls each of them on random
tensors of the recorded shapes, forward and backward, ``repeats`` times after
a warm-up, keeps the median, and puts the modules back on meta. At most one
unit's weights, gradients and activations are real at once, so a model far
larger than the machine is timed within the memory of its largest unit.

A unit's time is the sum of its modules' calls: the glue between modules
(masks, position tables, residual adds) is left out, and a module called
twice (a tied or shared one) is timed once per call recorded.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

__all__ = ["time_units_alone", "time_units_in_steps"]


def _record(model: nn.Module, paths: list[str], sample: Any) -> dict[str, list]:
    """path -> the (args, kwargs) of each call of that module on one meta run."""
    from annot.plan.saved_bytes import real_paths_on_meta
    from annot.runtime.runners.shape_run import call_with, meta_values

    modules = dict(model.named_modules(remove_duplicate=False))
    calls: dict[str, list] = {p: [] for p in paths}

    def pre(path: str, module, args, kwargs) -> None:
        calls[path].append(_shapes((args, kwargs)))

    handles = [
        modules[p].register_forward_pre_hook(functools.partial(pre, p), with_kwargs=True)
        for p in paths
    ]
    try:
        with meta_values(), real_paths_on_meta():
            call_with(model, sample)
    finally:
        for h in handles:
            h.remove()
    return calls


@dataclass(frozen=True)
class _Spec:
    """A recorded tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


def _shapes(tree: Any) -> Any:
    """Tensors as :class:`_Spec`; everything else as it is."""
    return torch.utils._pytree.tree_map(
        lambda t: (
            _Spec(tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else t
        ),
        tree,
    )


def _real(tree: Any, gen: torch.Generator) -> Any:
    """Random tensors of the recorded shapes: floats normal, ints zero, bools true."""

    def make(x: Any) -> Any:
        if not isinstance(x, _Spec):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=gen).to(x.dtype).requires_grad_(x.grad)
        if x.dtype == torch.bool:
            return torch.ones(x.shape, dtype=x.dtype)
        return torch.zeros(x.shape, dtype=x.dtype)

    return torch.utils._pytree.tree_map(make, tree)


def _materialize(module: nn.Module, gen: torch.Generator) -> None:
    """Real weights on the CPU: float parameters normal(0, 0.02), buffers zero."""
    module.to_empty(device="cpu", recurse=True)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()
        for b in module.buffers():
            b.zero_()


def _one_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    from annot.runtime.trees import tensors

    out = module(*args, **kwargs)
    outs = [t for t in tensors(out) if t.requires_grad and t.is_floating_point()]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def time_units_alone(
    model: nn.Module, found: list, sample: Any, repeats: int = 7, progress: Any = None
) -> list[float]:
    """Median seconds of forward + backward of each unit of ``found``
    (:class:`annot.plan.units.Unit`) of ``model`` on the meta device, one
    unit materialized at a time (see the module docstring). ``model`` is
    left on meta, its ``.grad``s unset."""
    owned = sorted({p for u in found for p in u.owns})
    calls = _record(model, owned, sample)
    modules = dict(model.named_modules(remove_duplicate=False))
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, u in enumerate(found):
        if progress is not None:
            progress.note(f"timing unit {i + 1}/{len(found)} ({u.path}), materialized alone")
        mods = [modules[p] for p in u.owns]
        for m in mods:
            _materialize(m, gen)
        try:
            inputs = [(m, _real(c, gen)) for p, m in zip(u.owns, mods) for c in calls[p]]
            runs = []
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                for m, (args, kwargs) in inputs:
                    _one_call(m, args, kwargs)
                if r:  # the first run warms up
                    runs.append(time.perf_counter() - t0)
                for m in mods:
                    m.zero_grad(set_to_none=True)
            out.append(statistics.median(runs) if runs else 0.0)
        finally:
            for m in mods:
                m.to_empty(device="meta", recurse=True)
    return out


def time_units_in_steps(model: nn.Module, found: list, sample: Any, repeats: int) -> list[float]:
    """Median forward + backward time of each unit over ``repeats`` steps (a
    unit runs from its call until the next unit's call).

    Forward: a clock that a pre-hook on each unit's module moves on. Backward
    runs the same spans in reverse: a gradient hook on the first input of each
    unit that requires grad fires when backward has passed that unit's start,
    so the time since the previous such hook is that unit's backward. Glue with
    no backward (masks, position tables) thus costs its forward only; a model
    that gives no input a gradient path (frozen) counts backward as twice
    forward. The model's ``.grad``s are cleared afterwards."""
    from annot.plan.unit_figures import first_grad_input, output_scalar
    from annot.runtime.runners.shape_run import call_with

    starts = {u.path: i for i, u in enumerate(found)}
    modules = {p: m for p, m in model.named_modules(remove_duplicate=False)}
    samples: list[list[float]] = [[] for _ in found]
    clock: dict = {}

    def mark(i: Optional[int]) -> None:
        now = time.perf_counter()
        if clock["unit"] is not None:
            clock["acc"][clock["unit"]] += now - clock["t"]
        clock["unit"], clock["t"] = i, now

    def back_mark(i: int) -> None:
        # backward has reached unit i's start: the time since the last mark is
        # the backward of units i .. (the last marked unit - 1), shared among
        # them as their forwards are
        now = time.perf_counter()
        span = range(i, clock["bw_last"]) if i < clock["bw_last"] else range(i, i + 1)
        fw = [clock["fw"][j] for j in span]
        total = sum(fw)
        for j, f in zip(span, fw):
            clock["acc"][j] += (now - clock["bw_t"]) * (f / total if total else 1 / len(fw))
        clock["bw_t"], clock["bw_last"] = now, min(i, clock["bw_last"])

    def pre_hook(i: int, module, args, kwargs) -> None:
        mark(i)
        if torch.is_grad_enabled():
            t = first_grad_input(args, kwargs)
            if t is not None and i not in clock["hooked"]:
                clock["hooked"].add(i)
                t.register_hook(lambda g, i=i: back_mark(i))

    handles = [
        modules[path].register_forward_pre_hook(functools.partial(pre_hook, i), with_kwargs=True)
        for path, i in starts.items()
    ]
    try:
        for r in range(repeats + 1):
            clock.update(unit=None, t=0.0, acc=[0.0] * len(found), hooked=set())
            out = call_with(model, sample)
            mark(None)
            clock["fw"] = list(clock["acc"])
            loss = output_scalar(out)
            if loss is None:  # no backward to time: twice forward
                clock["acc"] = [3 * t for t in clock["fw"]]
            else:
                clock.update(bw_t=time.perf_counter(), bw_last=len(found))
                loss.backward()
                back_mark(0)  # the rest of backward: the units before the first mark
            model.zero_grad(set_to_none=True)
            if r:  # the first step warms up
                for j, t in enumerate(clock["acc"]):
                    samples[j].append(t)
    finally:
        for h in handles:
            h.remove()
    return [statistics.median(s) for s in samples]
