"""The planner's step 3: what each segment costs.

:func:`segment_costs` counts the parameter, gradient and optimizer-state
bytes from the segments' modules (a parameter several segments use becomes a
shared group, charged once per stage that holds it; ``tp`` divides the
figures of ``@shard``-ed layers) and takes time, FLOPs, activation and sent
bytes from the measurement. :func:`profile` measures them:
:func:`annot.plan.cost.profile_segments` over several rounds, each segment
keeping its median round, cached on disk.

What the partition balances is a :class:`UnitCost`: an object that gives each
unit's cost from its :class:`UnitFacts`. The built-in ones are named by the
strings :func:`annot.plan.planner.plan` has always taken ("time", "flops",
"params", :func:`resolve_cost`); a user's own is any object with the same
three members::

    class Heavy:  # the attention parts cost twice their FLOPs
        name, needs = "heavy attention", "flops"

        def unit_costs(self, units):
            return [u.flops * (2 if "attn" in u.name else 1) for u in units]

    annot.plan.planner.plan(model, 4, units=ModuleUnits(), sample=batch, cost=Heavy())

:func:`stage_memories` gives each stage's memory, for both unit sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol, Union, runtime_checkable

import torch.nn as nn

from annot.core.files import atomic_write
from annot.plan.memory_model import OPTIMIZER_STATES

__all__ = [
    "FLOPS",
    "MEDIAN_TIME",
    "NEEDS",
    "PARAM_BYTES",
    "STATES",
    "WEIGHTED_PARAMS",
    "UnitCost",
    "UnitFacts",
    "apply_cost",
    "facts_of",
    "median_round",
    "profile",
    "resolve_cost",
    "segment_costs",
    "sharded_ids",
    "stage_memories",
]

STATES = OPTIMIZER_STATES  # optimizer states per element

# what a cost needs measured, least first: nothing (no sample), one forward and
# backward on the sample (FLOPs, activations), the units timed on real weights
NEEDS = ("params", "flops", "time")


@dataclass(frozen=True)
class UnitFacts:
    """What the planner knows of one unit, at the tp degree planned for:
    ``name`` (the split point or module path it begins at), ``params`` (bytes
    of weights, gradients and optimizer state it holds), ``n_params``,
    ``flops`` (forward + backward of the sample microbatch; 0 unmeasured),
    ``time`` (seconds, the median of its measured runs; 0.0 unmeasured),
    ``work`` (the parameters its forward multiplies by,
    :attr:`annot.plan.units.Unit.work`; ``n_params`` for a source segment),
    ``share`` (this rank's part of it at tp, what ``time`` and ``work`` are
    scaled by; 1.0 for a source segment, whose time is not scaled) and
    ``modules`` (the modules it owns)."""

    name: str
    params: int
    n_params: int
    flops: int
    time: float
    work: int
    share: float = 1.0
    modules: tuple[nn.Module, ...] = ()


@runtime_checkable
class UnitCost(Protocol):
    """What :func:`annot.plan.planner.plan` balances: ``name`` (shown in the
    table), ``needs`` (what must be measured for it: "params", nothing, no
    sample needed; "flops", one forward and backward on the sample; "time",
    the units timed on real weights) and :meth:`unit_costs`, one number per
    unit, larger meaning a slower stage."""

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> str: ...

    def unit_costs(self, units: Sequence[UnitFacts]) -> list[float]: ...


@dataclass(frozen=True)
class _Builtin:
    name: str
    needs: str
    field: str
    scaled: bool = False  # times this rank's share at tp

    def unit_costs(self, units: Sequence[UnitFacts]) -> list[float]:
        out = [float(getattr(u, self.field)) for u in units]
        return [c * u.share for c, u in zip(out, units)] if self.scaled else out


MEDIAN_TIME: UnitCost = _Builtin("time", "time", "time", scaled=True)
"""Measured time: each unit's median (:func:`median_round`), the one robust statistic."""
FLOPS: UnitCost = _Builtin("flops", "flops", "flops")
PARAM_BYTES: UnitCost = _Builtin("params", "params", "params")
"""A source segment's "params": the bytes it holds."""
WEIGHTED_PARAMS: UnitCost = _Builtin("params", "params", "work", scaled=True)
"""A module unit's "params": the parameters its forward multiplies by."""


def resolve_cost(cost: Union[str, UnitCost], params: UnitCost, who: str) -> UnitCost:
    """``cost`` as a :class:`UnitCost`: "time", "flops" or "params" (this unit
    source's ``params``), or a user's object, checked."""
    builtins = {"time": MEDIAN_TIME, "flops": FLOPS, "params": params}
    if isinstance(cost, str):
        if cost not in builtins:
            raise _cost_error(who, f"cost={cost!r}; expected 'time', 'flops' or 'params'")
        return builtins[cost]
    if not isinstance(cost, UnitCost) or not callable(getattr(cost, "unit_costs", None)):
        raise _cost_error(
            who,
            f"cost={cost!r}; expected 'time', 'flops', 'params' or an object with name, needs "
            "and unit_costs(units) (annot.plan.costs.UnitCost)",
        )
    if cost.needs not in NEEDS:
        raise _cost_error(who, f"cost {cost.name!r}: needs={cost.needs!r}; expected one of {NEEDS}")
    return cost


def _cost_error(who: str, msg: str) -> Exception:
    from annot.core.errors import HintError, PartitionError

    return (HintError if who == "modules" else PartitionError)(msg)


def apply_cost(cost: UnitCost, costs: Sequence[Any], facts: Sequence[UnitFacts]) -> list[Any]:
    """``costs`` (:class:`annot.plan.cost_segments.SegmentCost`) with ``.cost``
    set to what ``cost`` says of each unit."""
    values = list(cost.unit_costs(list(facts)))
    if len(values) != len(facts):
        raise _cost_error(
            "",
            f"cost {cost.name!r} gave {len(values)} unit costs for {len(facts)} units",
        )
    return [replace(c, cost=float(v)) for c, v in zip(costs, values)]


def facts_of(
    c: Any, modules: Sequence[nn.Module] = (), work: Optional[int] = None, share: float = 1.0
) -> UnitFacts:
    """A :class:`annot.plan.cost_segments.SegmentCost`'s :class:`UnitFacts`."""
    return UnitFacts(
        name=c.name,
        params=c.params,
        n_params=c.n_params,
        flops=c.flops,
        time=c.time,
        work=c.n_params if work is None else work,
        share=share,
        modules=tuple(modules),
    )


def stage_memories(
    part: Any,
    owned: Sequence[Sequence[nn.Module]],
    setup: Any,
    *,
    per_microbatch: Optional[Sequence[int]],
    flight: Sequence[int],
    tp: int,
    sharded: Any,
    dp: int = 1,
    recompute: Optional[Sequence[int]] = None,
    transient: Optional[Sequence[int]] = None,
) -> tuple[Any, ...]:
    """Each stage's :class:`annot.plan.memory_model.StageMemory` over the
    partition ``part`` of the units (``owned``: each unit's modules), for
    both unit sources: its weights, gradients and optimizer state under
    ``setup``; with ``per_microbatch`` (each unit's activation bytes; None:
    unmeasured) the activations of the microbatches the schedule keeps in
    flight on it (``flight``, per stage); ``recompute`` / ``transient``: per
    unit, what backward holds once (a recomputed block, gradients on their
    way), a stage's largest."""
    from annot.plan.memory_model import Activations, stage_memory

    out = []
    for s, (a, b) in enumerate(part.bounds):
        acts = Activations(
            per_microbatch=sum(per_microbatch[a:b]) if per_microbatch else 0,
            in_flight=flight[s] if per_microbatch else 0,
            recompute=max(recompute[a:b]) if recompute else 0,
            transient=max(transient[a:b]) if transient else 0,
        )
        modules = [m for ms in owned[a:b] for m in ms]
        out.append(
            stage_memory(modules, acts, setup, tp=tp, sharded=sharded, dp=dp, pp=part.n_stages)
        )
    return tuple(out)


def sharded_ids(model: nn.Module, paths: Optional[dict] = None) -> set[int]:
    """ids of the parameters a ``@shard`` spec, or a hint in ``paths`` (module
    or parameter path -> spec, e.g. from a transformers tp plan), splits
    (approximately: a Row layer's bias and Replicate entries stay whole;
    ``Experts()`` splits over ep, not tp: its own ``P(...)`` entries say what tp splits)."""
    from annot.core.hints import get_shard_spec
    from annot.core.specs import Experts, Replicate, Row

    out: set[int] = set()

    def add(target: Any, s: Any) -> None:
        if isinstance(s, (Replicate, Experts)):
            return
        if isinstance(target, nn.Parameter):
            out.add(id(target))
        elif isinstance(target, nn.Module):
            for pname, p in target.named_parameters(recurse=False):
                if not (isinstance(s, Row) and pname == "bias"):
                    out.add(id(p))

    for m in model.modules():
        spec = get_shard_spec(type(m))
        for name, s in spec.specs.items() if spec is not None else ():
            add(getattr(m, name, None), s)
    if paths:
        named = {**dict(model.named_modules()), **dict(model.named_parameters())}
        for path, s in paths.items():
            add(named.get(path), s)
    return out


def segment_costs(
    model: nn.Module,
    names: Sequence[str],
    modules: Sequence[Sequence[nn.Module]],
    measured: Optional[Sequence[Any]],
    *,
    optimizer: str,
    tp: int,
    sharded: Optional[set[int]] = None,
    setup: Any = None,
    dp: int = 1,
    pp: int = 1,
):
    """One SegmentCost per segment (``.cost`` unset: :func:`apply_cost` sets
    it): parameter-side bytes counted here (shared
    parameters keyed by their name in the model), the rest from ``measured``.
    ``sharded``: the ids of the parameters tp splits (default: the ``@shard``
    hints', :func:`sharded_ids`). The bytes per parameter element are
    :func:`annot.plan.memory_model.param_bytes`'s for ``setup`` (an
    :class:`annot.plan.memory_model.Training`; default: ``optimizer`` in
    float32); ``optimizer`` counts the master copy with the optimizer state."""
    from annot.plan.cost_segments import SegmentCost
    from annot.plan.memory_model import Training, param_bytes

    if setup is None:
        setup = Training(optimizer=optimizer)

    qual = {id(p): n for n, p in model.named_parameters()}
    if tp == 1:
        sharded = set()
    elif sharded is None:
        sharded = sharded_ids(model)
    owned: list[dict[int, nn.Parameter]] = []
    for mods in modules:
        ps: dict[int, nn.Parameter] = {}
        for m in mods:
            for p in m.parameters():
                ps.setdefault(id(p), p)
        owned.append(ps)
    users: dict[int, int] = {}
    for ps in owned:
        for pid in ps:
            users[pid] = users.get(pid, 0) + 1
    out = []
    for j, ps in enumerate(owned):
        p_bytes = g_bytes = s_bytes = n_params = n_sharded = 0
        shared: dict[str, int] = {}
        shared_numel: dict[str, int] = {}
        for pid, p in ps.items():
            div = tp if pid in sharded else 1
            numel = math.ceil(p.numel() / div)
            held = param_bytes(numel, 1, p.requires_grad, setup, dp, pp)
            pb, gb, sb = held.weights, held.grads, held.master + held.optimizer
            p_bytes, g_bytes, s_bytes = p_bytes + pb, g_bytes + gb, s_bytes + sb
            n_params += numel
            n_sharded += p.numel() if div > 1 else 0
            if users[pid] > 1:
                key = qual.get(pid, f"{names[j]}:{pid}")
                shared[key] = pb + gb + sb
                shared_numel[key] = numel
        total = sum(p.numel() for p in ps.values())
        # the FLOPs of the sharded layers shrink by tp: approximated by their share of parameters
        scale = 1.0 - (n_sharded / total) * (1 - 1 / tp) if total and tp > 1 else 1.0
        buffers = {id(b): b.numel() * b.element_size() for m in modules[j] for b in m.buffers()}
        meas = measured[j] if measured is not None else None
        out.append(
            SegmentCost(
                name=names[j],
                params=p_bytes,
                n_params=n_params,
                grads=g_bytes,
                optimizer=s_bytes,
                buffers=sum(buffers.values()),
                activations=meas.activations if meas else 0,
                flops=int(meas.flops * scale) if meas else 0,
                forward_flops=int(meas.forward_flops * scale) if meas else 0,
                time=meas.time if meas else 0.0,
                output_bytes=meas.output_bytes if meas else 0,
                shared=shared,
                shared_numel=shared_numel,
            )
        )
    return out


def median_round(column: Sequence[Any]) -> Any:
    """A segment's measurement from the round of median time: the statistic
    both unit sources time by (:mod:`annot.plan.module_units` keeps the median of its
    steps too), robust to a load spike in a round either way."""
    return sorted(column, key=lambda c: c.time)[(len(column) - 1) // 2]


def profile(segs, inputs, optimizer, progress, cache_dir, repeats: int, rounds: int) -> list:
    """annot.plan.cost.profile_segments, ``rounds`` times over all the segments;
    each segment keeps its median round (:func:`median_round`; a round times
    the median of ``repeats`` runs). A burst of load elsewhere on the machine
    slows a few consecutive segments of one round; across rounds it lands on
    different ones. Cached as JSON
    in ``cache_dir`` under annot.plan.cost_cache.cache_key (plus the round
    count)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from annot.plan.cost import profile_segments
    from annot.plan.cost_cache import cache_key
    from annot.plan.cost_segments import SegmentCost

    path = None
    if cache_dir is not None:
        key = cache_key(segs, inputs, optimizer=optimizer, repeats=repeats)
        path = Path(cache_dir) / f"{key}-r{rounds}-median.json"
        try:
            data = json.loads(path.read_text())
            hit = [SegmentCost(**item) for item in data]
            if len(hit) == len(segs):
                return hit
        except (OSError, ValueError, TypeError):
            pass  # missing or unreadable: profile again
    runs = [
        profile_segments(segs, inputs, optimizer=optimizer, progress=progress, repeats=repeats)
        for _ in range(rounds)
    ]
    out = [median_round(column) for column in zip(*runs)]
    if path is not None:
        atomic_write(path, json.dumps([asdict(c) for c in out]))
    return out
