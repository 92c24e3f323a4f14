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
:func:`annot.runtime.partition.partition`. Results are cached as JSON in
``cache_dir`` under :func:`cache_key`, so a second run does not re-profile.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from annot.errors import PartitionError
from annot.files import atomic_write

__all__ = [
    "Segment",
    "SegmentCost",
    "profile_segments",
    "cache_key",
    "partition_args",
    "format_partition_table",
]

_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
_COSTS = ("time", "flops", "params")
_CACHE_VERSION = 1


@dataclass(frozen=True)
class Segment:
    """A segment: the callable, the modules whose parameters it owns, a name."""

    fn: Callable[..., Any]
    modules: tuple[nn.Module, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class SegmentCost:
    """What one segment costs; sizes in bytes, time in seconds, per microbatch."""

    name: str
    params: int
    n_params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    flops: int
    forward_flops: int
    time: float
    output_bytes: int
    shared: dict[str, int] = field(default_factory=dict)  # key -> param+grad+state bytes
    shared_numel: dict[str, int] = field(default_factory=dict)  # key -> elements
    cost: float = 0.0  # the scalar the partitioner balances

    @property
    def memory(self) -> int:
        """Bytes on a device: parameters, grads, optimizer state, buffers, activations."""
        return self.params + self.grads + self.optimizer + self.buffers + self.activations


# -- inputs ---------------------------------------------------------------------


def _segments(segments: Sequence[Any], modules: Optional[Sequence[Sequence[nn.Module]]]):
    if modules is not None and len(modules) != len(segments):
        raise PartitionError(
            f"modules has {len(modules)} entries for {len(segments)} segments; give one list "
            "of owned modules per segment, e.g. modules=[[model.wte], [model.h[0]], ...]"
        )
    out = []
    for i, seg in enumerate(segments):
        if isinstance(seg, Segment):
            s = seg
        elif isinstance(seg, nn.Module):
            s = Segment(seg, (seg,), f"{i}:{type(seg).__name__}")
        elif callable(seg) and hasattr(seg, "modules"):
            s = Segment(seg, tuple(seg.modules), getattr(seg, "name", "") or "")
        elif callable(seg):
            s = Segment(seg, (), getattr(seg, "__name__", "") or "")
        else:
            raise PartitionError(
                f"segment {i} is a {type(seg).__name__}; expected an nn.Module, a Segment(fn, "
                "modules, name) or a callable seg(*state) -> state"
            )
        if modules is not None:
            s = Segment(s.fn, tuple(modules[i]), s.name)
        bad = [m for m in s.modules if not isinstance(m, nn.Module)]
        if bad:
            raise PartitionError(
                f"segment {i}: owned modules must be nn.Module objects, got {type(bad[0]).__name__}"
            )
        out.append(Segment(s.fn, s.modules, s.name or f"segment{i}"))
    return out


def _leaves(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)


def _detach(x: Any, grad: Optional[bool]) -> Any:
    """A fresh leaf copy of the structure; floating tensors require grad when
    ``grad`` is True, keep their own flag when it is None."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        want = x.requires_grad if grad is None else grad
        return t.requires_grad_(bool(want) and (t.is_floating_point() or t.is_complex()))
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_detach(v, grad) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_detach(v, grad) for v in x)
    if isinstance(x, dict):
        return {k: _detach(v, grad) for k, v in x.items()}
    return x


def _call(fn: Callable[..., Any], state: Any) -> Any:
    return fn(*state) if isinstance(state, tuple) else fn(state)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owned(seg: Segment) -> dict[int, tuple[str, nn.Parameter]]:
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for m in seg.modules:
        for name, p in m.named_parameters():
            out.setdefault(id(p), (name, p))
    return out


# -- measuring one segment ----------------------------------------------------------


def _sync(tensors) -> None:
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def _fwd_bwd(fn, state):
    out = _call(fn, state)
    outs = [t for t in _leaves(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return out


def _measure(seg: Segment, state: Any, params: list[nn.Parameter], repeats: int, warmup: int):
    """(forward flops, total flops, activation bytes, output, median seconds)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with FlopCounterMode(display=False) as fwd_counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _call(seg.fn, state)
    outs = [t for t in _leaves(out) if t.requires_grad]
    with FlopCounterMode(display=False) as bwd_counter:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    fwd = int(fwd_counter.get_total_flops())
    total = fwd + int(bwd_counter.get_total_flops())

    probe = list(_leaves(state)) + params
    times = []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        _sync(probe)
        t0 = time.perf_counter()
        _fwd_bwd(seg.fn, state)
        _sync(probe)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return fwd, total, sum(saved.values()), out, statistics.median(times)


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


# -- cache --------------------------------------------------------------------------


def _source_hash(obj: Any) -> str:
    plain = inspect.isfunction(obj) or inspect.ismethod(obj)
    target = obj if plain else type(obj)
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        src = getattr(target, "__qualname__", type(target).__qualname__)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype), str(x.device), x.requires_grad]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [_describe(v) for v in x]]
    if isinstance(x, dict):
        return ["dict", {str(k): _describe(v) for k, v in x.items()}]
    return repr(x)


def cache_key(
    segments: Sequence[Any],
    sample_inputs: Any,
    *,
    modules: Optional[Sequence[Sequence[nn.Module]]] = None,
    optimizer: str = "adamw",
    repeats: int = 5,
    warmup: int = 1,
) -> str:
    """A hex digest of everything the measurements depend on: each segment's
    name, code (source of the function, or of each module's class), module
    structure, parameter and buffer shapes and dtypes; the sample inputs'
    shapes, dtypes and devices; the optimizer, repeats, warmup and the torch
    version. Parameter *values* are not part of it."""
    segs = _segments(segments, modules)
    desc = {
        "version": _CACHE_VERSION,
        "torch": torch.__version__,
        "optimizer": optimizer,
        "repeats": repeats,
        "warmup": warmup,
        "inputs": _describe(
            sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
        ),
        "segments": [
            {
                "name": s.name,
                "fn": _source_hash(s.fn),
                "modules": [
                    {
                        "repr": repr(m),
                        "code": _source_hash(m),
                        "training": m.training,
                        "params": [
                            [n, list(p.shape), str(p.dtype), p.requires_grad]
                            for n, p in m.named_parameters()
                        ],
                        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in m.named_buffers()],
                    }
                    for m in s.modules
                ],
            }
            for s in segs
        ],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _with_cost(costs: list[SegmentCost], cost: str) -> list[SegmentCost]:
    pick = {
        "time": lambda c: c.time,
        "flops": lambda c: float(c.flops),
        "params": lambda c: float(c.params),
    }[cost]
    return [SegmentCost(**{**_fields(c), "cost": pick(c)}) for c in costs]


def _fields(c: SegmentCost) -> dict[str, Any]:
    return {f.name: getattr(c, f.name) for f in fields(c)}


def _load(path: Path) -> Optional[list[SegmentCost]]:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != _CACHE_VERSION:
            return None
        return [SegmentCost(**item) for item in data["segments"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing or unreadable: profile again


def _store(path: Path, costs: list[SegmentCost]) -> None:
    atomic_write(
        path, json.dumps({"version": _CACHE_VERSION, "segments": [asdict(c) for c in costs]})
    )


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
    segs = _segments(segments, modules)
    bar = _Progress(progress, len(segs))
    path = None
    if cache_dir is not None:
        key = cache_key(segs, sample_inputs, optimizer=optimizer, repeats=repeats, warmup=warmup)
        path = Path(cache_dir) / f"{key}.json"
        hit = _load(path)
        if hit is not None and len(hit) == len(segs):
            bar.done(cached=True)
            return _with_cost(hit, cost)

    owned = [_owned(s) for s in segs]
    users: dict[int, list[int]] = {}
    for i, params in enumerate(owned):
        for pid in params:
            users.setdefault(pid, []).append(i)
    keys = {pid: f"{idx[0]}:{owned[idx[0]][pid][0]}" for pid, idx in users.items() if len(idx) > 1}
    states = _STATES[optimizer]

    state = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    results = []
    devices = sorted({t.device.index or 0 for t in _leaves(state) if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        for i, seg in enumerate(segs):
            bar.step(i, seg.name)
            params = [p for _, p in owned[i].values()]
            kept = [p.grad for p in params]
            state = _detach(state, None if i == 0 else True)
            try:
                fwd, total, act, out, seconds = _measure(seg, state, params, repeats, warmup)
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
                    output_bytes=sum(_nbytes(t) for t in _leaves(out)),
                    shared=shared,
                    shared_numel=shared_numel,
                )
            )
            state = out if isinstance(out, tuple) else (out,)
    bar.done()
    if path is not None:
        _store(path, results)
    return _with_cost(results, cost)


def partition_args(
    costs: Sequence[SegmentCost], *, bandwidth: Optional[float] = None
) -> dict[str, Any]:
    """The keyword arguments of :func:`annot.runtime.partition.partition` / ``fit``
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


# -- the table -------------------------------------------------------------------------


def _human(x: float, units: Sequence[str], base: float) -> str:
    for unit in units[:-1]:
        if abs(x) < base:
            return f"{x:.0f} {unit}" if unit == units[0] else f"{x:.1f} {unit}"
        x /= base
    return f"{x:.1f} {units[-1]}"


def format_bytes(x: float) -> str:
    """``1536 -> '1.5 KiB'``"""
    return _human(x, ("B", "KiB", "MiB", "GiB", "TiB"), 1024)


def format_count(x: float) -> str:
    """``1500000 -> '1.5 M'``"""
    return _human(x, ("", "K", "M", "G", "T"), 1000).strip()


def format_seconds(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def format_partition_table(
    partition: Any, names: Optional[Sequence[str]], costs: Sequence[SegmentCost]
) -> str:
    """The plan as a terminal table: per stage its first and last segment,
    parameters (shared ones counted once per stage), FLOPs, measured time,
    memory (as the partitioner charged it), the bytes it sends to the next
    stage; then the imbalance (max / mean of the balanced cost)."""
    names = list(names) if names is not None else [c.name for c in costs]
    header = ("stage", "first", "last", "params", "FLOPs", "time", "memory", "sends")
    rows = []
    for s, (a, b) in enumerate(partition.bounds):
        seg = costs[a:b]
        n_params = sum(c.n_params for c in seg)
        seen: dict[str, int] = {}
        for c in seg:
            for key, numel in c.shared_numel.items():
                n_params -= numel if key in seen else 0
                seen[key] = numel
        last = s == len(partition.bounds) - 1
        rows.append(
            (
                str(s),
                names[a],
                names[b - 1],
                format_count(n_params),
                format_count(sum(c.flops for c in seg)),
                format_seconds(sum(c.time for c in seg)),
                format_bytes(partition.stage_memory[s]),
                "-" if last else format_bytes(costs[b - 1].output_bytes),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 5, 6, 7}

    def line(r):
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
        ).rstrip()

    out = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
    out.append(f"imbalance (max/mean stage cost): {partition.imbalance:.2f}")
    return "\n".join(out)
