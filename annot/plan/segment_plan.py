"""The plan over the segments of a class's ``forward`` (the source split's
units, :class:`SourceSegments`): the planner's steps 1 to 3 on them
(:mod:`annot.plan.points`, :mod:`annot.plan.segments`, :mod:`annot.plan.costs`),
then the partition; and :func:`measure_split`, the stages of a given split
timed whole."""

from __future__ import annotations

import copy
import inspect
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.core.errors import PartitionError, RewriteError
from annot.plan.costs import (
    PARAM_BYTES,
    STATES,
    UnitCost,
    apply_cost,
    facts_of,
    profile,
    resolve_cost,
    segment_costs,
    stage_memories,
)
from annot.plan.partition import partition_units
from annot.plan.points import module_at, no_markers, points_and_split, split_forward
from annot.plan.result import StagePlan
from annot.plan.segments import exec_class, stage_fn, stage_modules
from annot.plan.unit_source import TooFewSplitPoints, default_cost

__all__ = ["SourceSegments", "measure_split", "plan_segments"]


@dataclass(frozen=True)
class SourceSegments:
    """A unit source of :func:`annot.plan.planner.plan`: the segments between the
    split points of ``cls.forward`` (:func:`annot.plan.points.split_points`),
    for the source runner, which cuts the root's forward. ``source_path``: the
    file to read (default: ``cls``'s); ``cache_dir``: where profiles are kept;
    ``bandwidth``: bytes per unit of cost, charging what crosses each cut;
    ``repeats`` / ``rounds``: timing, each segment's median of ``rounds``
    rounds (:func:`annot.plan.costs.median_round`)."""

    cls: type
    source_path: Optional[str] = None
    cache_dir: Any = None
    progress: bool = False
    bandwidth: Optional[float] = None
    repeats: int = 1
    rounds: int = 5

    def plan(
        self,
        model: nn.Module,
        n_stages: int,
        *,
        cost: Any,
        memory: Optional[int],
        fit: bool,
        sample: Any,
        tp: int,
        dp: int,
        setup: Any,
        optimizer: str,
    ) -> StagePlan:
        del dp  # the segments' figures are for one data-parallel replica
        return plan_segments(
            model, self, n_stages, sample=sample, cost=cost, memory=memory, fit=fit,
            optimizer=optimizer, tp=tp, setup=setup,
        )  # fmt: skip


@dataclass(frozen=True)
class _Measured:
    class_name: str
    segments: tuple[str, ...]
    costs: list[Any]
    cost: str
    measured: bool
    modules: list[Any]  # per segment, the modules it owns
    setup: Any  # annot.plan.memory_model.Training
    sharded: Any  # ids of the parameters tp splits
    timed: bool  # the segments' times mean something (not a meta model)


def _read(cls: type, source_path: Optional[str]) -> tuple[str, str]:
    path = source_path or inspect.getfile(cls)
    with tokenize.open(path) as f:  # honours a coding cookie / BOM
        return f.read(), str(path)


def _measure(
    model: nn.Module,
    cls: type,
    *,
    sample: Union[tuple, dict, torch.Tensor, None],
    cost: Union[str, UnitCost, None],
    optimizer: str,
    source_path: Optional[str],
    progress: bool,
    cache_dir: Any,
    tp: int,
    repeats: int = 1,
    rounds: int = 5,
    points: Optional[Sequence[str]] = None,
    setup: Any = None,
) -> _Measured:
    from annot.plan.cost_segments import Segment
    from annot.plan.costs import sharded_ids
    from annot.plan.memory_model import Training

    if not isinstance(model, cls):
        raise PartitionError(
            f"model is a {type(model).__name__}, not a {cls.__name__}; pass the built model and "
            "its class: plan(model, n, units=SourceSegments(type(model)))"
        )
    if cost is None:
        cost = default_cost(sample, over_modules=False)
    label = repr(cost) if isinstance(cost, str) else repr(getattr(cost, "name", cost))
    cost = resolve_cost(cost, PARAM_BYTES, "segments")
    if sample is None and cost.needs != "params":
        raise PartitionError(
            f"cost={label} is measured on a sample input: pass sample=(x, ...) (forward's "
            "positional arguments) or sample={'idx': x, ...}, or use cost='params'"
        )
    if optimizer not in STATES:
        raise PartitionError(f"optimizer={optimizer!r}; expected one of {sorted(STATES)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PartitionError(f"tp={tp!r}; expected an int >= 1")
    for what, n in (("repeats", repeats), ("rounds", rounds)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PartitionError(f"{what}={n!r}; expected an int >= 1")

    source, path = _read(cls, source_path)
    qualname = cls.__qualname__
    if points is None:
        points, split = points_and_split(source, qualname, model, path)
    else:
        points = list(points)
        try:
            split = split_forward(source, qualname, points, path)
        except RewriteError as exc:
            raise PartitionError(f"cannot split {qualname}.forward at {points}: {exc}") from None
        no_markers(qualname, split)
    new_cls = exec_class(split.source, qualname, cls, qualname)
    bound = copy.copy(model)  # same parameters and submodules, the rewritten methods
    if type(model) is cls:
        bound.__class__ = new_cls
        methods = [getattr(bound, st.method) for st in split.stages]
    else:  # a subclass: keep its class, borrow the stage functions
        import types

        methods = [types.MethodType(new_cls.__dict__[st.method], model) for st in split.stages]
    modules = [stage_modules(model, st.modules) for st in split.stages]
    first = next(
        (
            p.split("[")[0]
            for p in split.stages[0].modules
            if isinstance(module_at(model, p.split("[")[0]), nn.Module)
        ),
        "(start of forward)",
    )
    names = (first, *points)

    measured = None
    if sample is not None:
        kwargs = isinstance(sample, dict)
        inputs = (sample,) if kwargs else (sample if isinstance(sample, tuple) else (sample,))
        segs = [
            Segment(stage_fn(m, i == 0, kwargs), tuple(mods), names[i])
            for i, (m, mods) in enumerate(zip(methods, modules))
        ]
        measured = profile(segs, inputs, optimizer, progress, cache_dir, repeats, rounds)
    if setup is None:
        setup = Training(optimizer=optimizer)
    sharded = sharded_ids(model) if tp > 1 else set()
    costs = segment_costs(
        model,
        names,
        modules,
        measured,
        optimizer=optimizer,
        tp=tp,
        sharded=sharded,
        setup=setup,
    )
    costs = apply_cost(cost, costs, [facts_of(c, mods) for c, mods in zip(costs, modules)])
    on_meta = any(p.is_meta for p in model.parameters())
    return _Measured(
        cls.__name__,
        names,
        costs,
        cost.name,
        sample is not None,
        modules,
        setup,
        sharded,
        not on_meta,
    )


def _partition_args(m: _Measured, n_stages: int, bandwidth: Optional[float]) -> dict:
    """The partitioner's arguments: every segment's activations charged for
    the most microbatches any stage keeps in flight (never less than a
    stage holds; each stage's own figure is :func:`_stage_detail`'s)."""
    from dataclasses import replace

    from annot.plan.cost import partition_args
    from annot.plan.memory_model import in_flight

    most = max(in_flight(m.setup.schedule, n_stages, m.setup.microbatches))
    costs = [replace(c, activations=c.activations * most) for c in m.costs]
    return partition_args(costs, bandwidth=bandwidth)


def _stage_detail(m: _Measured, part: Any, tp: int) -> tuple:
    """Each stage's :class:`annot.plan.memory_model.StageMemory`
    (:func:`annot.plan.costs.stage_memories`, as for module units): its
    weights, gradients and optimizer state, its activations for the
    microbatches the schedule keeps in flight on it."""
    from annot.plan.memory_model import in_flight

    return stage_memories(
        part,
        m.modules,
        m.setup,
        per_microbatch=[c.activations for c in m.costs] if m.measured else None,
        flight=in_flight(m.setup.schedule, part.n_stages, m.setup.microbatches),
        tp=tp,
        sharded=m.sharded,
    )


def _result(m: _Measured, part: Any, memory: Optional[int], tp: int) -> StagePlan:
    starts = [a for a, _ in part.bounds[1:]]
    total = sum(c.cost for c in m.costs)
    mean = total / part.n_stages
    warnings = []
    for c in m.costs:
        if part.n_stages > 1 and mean > 0 and c.cost > mean:
            warnings.append(
                f"segment {c.name!r} alone costs {c.cost / mean:.2f}x the mean stage cost "
                f"(total / {part.n_stages}); no split balances better than that. annot does not "
                f"cut inside {c.name}: split its forward by hand, or use fewer stages"
            )
    return StagePlan(
        stage_detail=_stage_detail(m, part, tp),
        timed=m.timed,
        class_name=m.class_name,
        boundaries=tuple(m.segments[a] for a in starts),
        partition=part,
        segments=m.segments,
        costs=tuple(m.costs),
        cost=m.cost,
        measured=m.measured,
        tp=tp,
        memory_budget=memory,
        warnings=tuple(warnings),
    )


def _check_count(m: _Measured, n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PartitionError(f"{what}={n!r}; expected an int >= 1")
    if n > len(m.segments):
        raise TooFewSplitPoints(
            f"{m.class_name}.forward has {len(m.segments)} segments between its split points "
            f"({', '.join(m.segments[1:]) or 'none'}), fewer than the {n} stages asked for; "
            "use fewer stages, or give forward more top-level statements / a longer module list"
        )


def plan_segments(
    model: nn.Module,
    units: Any,
    n_stages: int,
    *,
    sample: Union[tuple, dict, torch.Tensor, None],
    cost: Any,
    memory: Optional[int],
    fit: bool,
    optimizer: str,
    tp: int,
    setup: Any,
) -> StagePlan:
    """:func:`plan` over a :class:`annot.plan.segment_plan.SourceSegments`:
    steps 1 to 3 (:func:`_measure`), then the partition into ``n_stages``
    stages, or with ``fit`` the fewest stages, at most ``n_stages``, whose
    every stage fits ``memory`` (RaNNC's memory-fit mode)."""
    if fit and memory is None:
        raise PartitionError("plan: fit=True needs memory= (the budget)")
    m = _measure(
        model,
        units.cls,
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=units.source_path,
        progress=units.progress,
        cache_dir=units.cache_dir,
        tp=tp,
        repeats=units.repeats,
        rounds=units.rounds,
        setup=setup,
    )
    _check_count(m, n_stages, "max_stages" if fit else "n_stages")
    args = _partition_args(m, n_stages, units.bandwidth)
    part = partition_units(args, n_stages, memory=memory, fit=fit)
    return _result(m, part, memory, tp)


def measure_split(
    model: nn.Module,
    cls: type,
    boundaries: Sequence[str],
    *,
    sample: Union[tuple, dict, torch.Tensor],
    optimizer: str = "adamw",
    repeats: int = 1,
    rounds: int = 5,
    source_path: Optional[str] = None,
    tp: int = 1,
) -> list[Any]:
    """Profile the stages of a given split (``boundaries`` as for
    ``split_stages``, e.g. a hand-written ``@stage(split=...)`` or another
    tool's choice): one :class:`annot.plan.cost_segments.SegmentCost` per stage, each
    stage run whole on the sample, the output of the stage before it."""
    if sample is None:
        raise PartitionError("measure_split runs the stages: pass sample=(x, ...)")
    m = _measure(
        model,
        cls,
        sample=sample,
        cost="time",
        optimizer=optimizer,
        source_path=source_path,
        progress=False,
        cache_dir=None,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
        points=boundaries,
    )
    return list(m.costs)
