"""The cost model: measure each segment of a model for the partitioner.

A *segment* is the piece of the model between two candidate split points. It
is a callable ``seg(*state) -> state``: the first takes the sample inputs, each
next one takes the previous one's output (a tuple is spread into arguments,
anything else is passed as one argument). The partitioner also needs the
``nn.Module`` objects a segment owns, to count their parameters. Give them in
whichever way is clearest:

* an ``nn.Module``: it is both the callable and the one module it owns;
* :class:`Segment` ``(fn, modules, name)``;
* any callable with a ``.modules`` attribute (a sequence of modules);
* a plain callable, with the modules listed apart:
  ``profile_segments(fns, x, modules=[[model.wte], [model.h[0]], ...])``.

For each segment :func:`profile_segments` reports (:class:`SegmentCost`):

* ``params``: bytes of the parameters it owns, each ``Parameter`` counted once
  per segment; ``grads`` (the ones with ``requires_grad``) and ``optimizer``
  state bytes (AdamW/Adam: 2 states per element, SGD with momentum: 1, "none":
  0; states take the parameter's dtype, as in ``torch.optim``); ``buffers``.
  A parameter used by several segments (an embedding tied to the LM head) is
  listed in ``shared`` (key -> bytes of parameter + grad + optimizer state) in
  every segment that uses it, so the partitioner charges it once per stage;
* ``activations``: bytes of the tensors the forward saves for backward,
  measured with ``torch.autograd.graph.saved_tensors_hooks``, unique storages,
  parameter storages excluded (the segment input is included when it is
  saved), for one microbatch the size of the sample inputs;
* ``flops`` (forward + backward) and ``forward_flops``, from
  ``torch.utils.flop_counter.FlopCounterMode``. The first segment's inputs
  keep their own ``requires_grad``; later segments' floating inputs require
  grad, as they do inside a pipeline (so their backward also computes the
  input gradient);
* ``time``: median seconds of forward + backward over ``repeats`` runs after
  ``warmup``, with ``time.perf_counter`` (CUDA synchronised);
* ``output_bytes``: bytes of the tensors the segment hands to the next one.

``cost`` picks the scalar the partitioner balances: "time", "flops" or
"params" (bytes). :func:`partition_args` turns the list into the arguments of
:func:`annot.plan.partition.partition`. Results are cached as JSON in
``cache_dir`` under :func:`annot.plan.cost_cache.cache_key`, so a second run
does not re-profile. The segments are :mod:`annot.plan.cost_segments`'s,
the measurements :mod:`annot.plan.cost_measure`'s; the plan as a table is
:func:`annot.plan.cost_table.format_partition_table`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.core.errors import PartitionError
from annot.plan.cost_cache import cache_key, load, store
from annot.plan.cost_measure import detach, measure
from annot.plan.cost_segments import Segment, SegmentCost, as_segments
from annot.plan.memory_model import OPTIMIZER_STATES
from annot.runtime.trees import tensors

__all__ = ["profile_segments", "partition_args"]

_STATES = OPTIMIZER_STATES
_COSTS = ("time", "flops", "params")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owned(seg: Segment) -> dict[int, tuple[str, nn.Parameter]]:
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for m in seg.modules:
        for name, p in m.named_parameters():
            out.setdefault(id(p), (name, p))
    return out


# -- progress -------------------------------------------------------------------


class _Progress:
    """``profiling segment 12/40 (h.11) ...`` on stderr, updated in place on a
    terminal; one line per segment when forced onto a non-terminal."""

    def __init__(self, mode: Union[bool, str], total: int):
        stream = sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        self.on = mode == "always" or (mode is True and tty)
        self.tty, self.total, self.width = tty, total, 0
        self.t0 = time.perf_counter()

    def _write(self, text: str) -> None:
        stream = sys.stderr
        if self.tty:
            stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def step(self, i: int, name: str) -> None:
        if self.on:
            self._write(f"profiling segment {i + 1}/{self.total} ({name}) ...")

    def done(self, cached: bool = False) -> None:
        if self.on:
            how = "loaded from cache" if cached else "profiled"
            self._write(f"{how} {self.total} segments in {time.perf_counter() - self.t0:.1f} s")
            if self.tty:
                sys.stderr.write("\n")


def _with_cost(costs: list[SegmentCost], cost: str) -> list[SegmentCost]:
    pick = {
        "time": lambda c: c.time,
        "flops": lambda c: float(c.flops),
        "params": lambda c: float(c.params),
    }[cost]
    return [SegmentCost(**{**_fields(c), "cost": pick(c)}) for c in costs]


def _fields(c: SegmentCost) -> dict[str, Any]:
    return {f.name: getattr(c, f.name) for f in fields(c)}


# -- the entry point ------------------------------------------------------------------


def profile_segments(
    segments: Sequence[Any],
    sample_inputs: Any,
    *,
    modules: Optional[Sequence[Sequence[nn.Module]]] = None,
    optimizer: str = "adamw",
    repeats: int = 5,
    warmup: int = 1,
    cost: str = "time",
    progress: Union[bool, str] = True,
    cache_dir: Optional[Union[str, Path]] = None,
) -> list[SegmentCost]:
    """Measure each segment in turn on the output of the one before it.

    ``sample_inputs`` is one microbatch (a tensor or a tuple of arguments).
    ``progress``: True shows ``profiling segment i/n ...`` when stderr is a
    terminal, "always" also when it is not, False never. With ``cache_dir``
    the results are read from / written to ``cache_dir/<cache_key>.json``.
    Gradients, RNG state and training mode are left as they were.
    """
    if cost not in _COSTS:
        raise PartitionError(f"cost={cost!r}; expected 'time', 'flops' or 'params'")
    if optimizer not in _STATES:
        raise PartitionError(
            f"optimizer={optimizer!r}; expected one of {sorted(_STATES)} ('sgd' means SGD "
            "with momentum; plain SGD keeps no state: 'none')"
        )
    if repeats < 1 or warmup < 0:
        raise PartitionError(
            f"repeats={repeats}, warmup={warmup}; expected repeats >= 1, warmup >= 0"
        )
    segs = as_segments(segments, modules)
    bar = _Progress(progress, len(segs))
    path = None
    if cache_dir is not None:
        key = cache_key(segs, sample_inputs, optimizer=optimizer, repeats=repeats, warmup=warmup)
        path = Path(cache_dir) / f"{key}.json"
        hit = load(path)
        if hit is not None and len(hit) == len(segs):
            bar.done(cached=True)
            return _with_cost(hit, cost)

    owned = [_owned(s) for s in segs]
    users: dict[int, list[int]] = {}
    for i, held in enumerate(owned):
        for pid in held:
            users.setdefault(pid, []).append(i)
    keys = {pid: f"{idx[0]}:{owned[idx[0]][pid][0]}" for pid, idx in users.items() if len(idx) > 1}
    states = _STATES[optimizer]

    state = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    results = []
    devices = sorted({t.device.index or 0 for t in tensors(state) if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        for i, seg in enumerate(segs):
            bar.step(i, seg.name)
            params = [p for _, p in owned[i].values()]
            kept = [p.grad for p in params]
            state = detach(state, None if i == 0 else True)
            try:
                fwd, total, act, out, seconds = measure(seg, state, params, repeats, warmup)
            finally:
                for p, g in zip(params, kept):
                    p.grad = g
            shared, shared_numel, p_bytes, g_bytes, s_bytes = {}, {}, 0, 0, 0
            for p in params:
                pb = _nbytes(p)
                gb = pb if p.requires_grad else 0
                sb = states * pb if p.requires_grad else 0
                p_bytes, g_bytes, s_bytes = p_bytes + pb, g_bytes + gb, s_bytes + sb
                if id(p) in keys:
                    shared[keys[id(p)]] = pb + gb + sb
                    shared_numel[keys[id(p)]] = p.numel()
            buffers = {id(b): _nbytes(b) for m in seg.modules for b in m.buffers()}
            results.append(
                SegmentCost(
                    name=seg.name,
                    params=p_bytes,
                    n_params=sum(p.numel() for p in params),
                    grads=g_bytes,
                    optimizer=s_bytes,
                    buffers=sum(buffers.values()),
                    activations=act,
                    flops=total,
                    forward_flops=fwd,
                    time=seconds,
                    output_bytes=sum(_nbytes(t) for t in tensors(out)),
                    shared=shared,
                    shared_numel=shared_numel,
                )
            )
            state = out if isinstance(out, tuple) else (out,)
    bar.done()
    if path is not None:
        store(path, results)
    return _with_cost(results, cost)


def partition_args(
    costs: Sequence[SegmentCost], *, bandwidth: Optional[float] = None
) -> dict[str, Any]:
    """The keyword arguments of :func:`annot.plan.partition.partition` / ``fit``
    for these measurements: ``partition(**partition_args(costs), n_stages=4,
    memory_budget=...)``. Shared parameters leave the per-segment memories and
    become ``shared`` groups; with ``bandwidth`` (bytes per second when the
    cost is time) the output bytes become ``cross_bytes``."""
    groups: dict[str, tuple[int, set[int]]] = {}
    for i, c in enumerate(costs):
        for key, nbytes in c.shared.items():
            groups.setdefault(key, (nbytes, set()))[1].add(i)
    args: dict[str, Any] = {
        "costs": [c.cost for c in costs],
        "memories": [c.memory - sum(c.shared.values()) for c in costs],
        "shared": [groups[k] for k in sorted(groups)],
    }
    if bandwidth is not None:
        args["cross_bytes"] = [c.output_bytes for c in costs]
        args["bandwidth"] = bandwidth
    return args
