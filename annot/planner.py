"""Automatic pipeline partitioning of a model's ``forward``: where to cut.

:func:`plan_stages` answers "at which module paths should ``GPT.forward`` be
split into ``n`` stages so that the slowest stage is as fast as possible and
every stage fits in memory?" in four steps:

1. **Split points.** :func:`split_points` lists every place
   :func:`annot.rewriters.stage_split.split_stages` can begin a stage: before each
   top-level statement of forward that calls a ``self.<submodule>`` (named by
   that submodule, e.g. ``"ln_f"``), and before each iteration of a top-level
   loop over an ``nn.ModuleList`` / ``nn.Sequential`` (``"h.0"`` .. ``"h.7"``).
   They are read from the class's source by the same rules ``split_stages``
   resolves a boundary with (a path names its *first* use in forward; uses
   nested in a branch, ``with`` or loop body cannot begin a stage), then
   checked by splitting at all of them at once.
2. **Segments.** Splitting at every split point gives one stage method per
   segment. The rewritten class is compiled from that source in a copy of the
   model module's namespace and bound to a shallow copy of the built model, so
   each segment runs the model's *real* code on its real weights.
3. **Costs.** With a sample input, :func:`annot.runtime.cost.profile_segments` runs
   the segments in turn (forward + backward): time, FLOPs, activation bytes,
   bytes crossing to the next segment. Parameter, gradient and optimizer-state
   bytes are counted from the segments' modules; a parameter several segments
   use (an embedding tied to the LM head) becomes a shared group, charged once
   per stage that holds it. Without a sample only parameters are counted.
   A segment's time is its median of ``rounds`` passes over all segments
   (a busy machine preempts some runs; the median is the statistic
   :mod:`annot.module_units` keeps too, :func:`annot.planner_costs.median_round`).
   Segments timed on their own run with their weights in cache, so on a CPU
   a stage holding a large layer (an LM head) can run somewhat slower whole
   than its segments add up to: :func:`measure_split` times the stages of a
   given split whole, to check a plan or compare it with a hand split.
4. **Partition.** :func:`annot.runtime.partition.partition` (exact min-bottleneck,
   per-device ``memory`` budget), or :func:`annot.runtime.partition.fit` for the
   fewest stages that fit (:func:`fit_stages`, RaNNC's memory-fit mode).

A single segment costlier than a whole mean stage (total / ``n_stages``)
bounds the balance from below; the plan then carries a warning naming it.
The planner does not recurse into that module's own forward: cut it by hand
(split its forward into more top-level statements, or turn its internals into
a module list) or use fewer stages.

``tp`` (tensor-parallel degree) divides the parameter figures of layers a
``@shard`` spec splits (all but ``Replicate``; a ``Row`` layer's bias stays
whole) by ``tp``, and each segment's FLOPs by the same share: an
approximation, as the activations and measured times are not scaled.

:func:`plan` is the one entry point: the units come from where a stage may
begin, the segments of a source split (:class:`annot.planner_segments.SourceSegments`,
steps 1 to 3 above) or the module calls at any depth the replay runner cuts
at (:class:`annot.module_units.ModuleUnits`), and the answer is one
:class:`StagePlan` with one table. ``parallelize`` (:mod:`annot.stage_choice`),
``annot plan`` (:mod:`annot.cli_plan`) and :mod:`annot.what_if` call it.

This module holds the entry points; steps 1 to 3 live in
:mod:`annot.planner_points`, :mod:`annot.planner_segments` and
:mod:`annot.planner_costs`, the result in :mod:`annot.planner_result`.
"""

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
from annot.planner_costs import STATES, profile, segment_costs
from annot.planner_points import (
    module_at,
    no_markers,
    points_and_split,
    split_forward,
    split_points,
)
from annot.planner_result import StagePlan
from annot.planner_segments import exec_class, stage_fn, stage_modules

__all__ = [
    "StagePlan",
    "partition_units",
    "plan",
    "TooFewSplitPoints",
    "fit_stages",
    "measure_split",
    "plan_stages",
    "split_points",
]


class TooFewSplitPoints(PartitionError):
    """forward has fewer places to cut than the stages asked for (``annot
    plan`` then plans the model's nested blocks instead)."""


_COSTS = ("time", "flops", "params")


@dataclass(frozen=True)
class _Measured:
    class_name: str
    segments: tuple[str, ...]
    costs: list[Any]
    cost: str
    measured: bool
    modules: list[Any]  # per segment, the modules it owns
    setup: Any  # annot.runtime.memory_model.Training
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
    cost: Optional[str],
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
    from annot.planner_costs import sharded_ids
    from annot.runtime.cost_segments import Segment
    from annot.runtime.memory_model import Training

    if not isinstance(model, cls):
        raise PartitionError(
            f"model is a {type(model).__name__}, not a {cls.__name__}; pass the built model and "
            "its class: plan_stages(model, type(model), n)"
        )
    if cost is None:
        cost = "time" if sample is not None else "params"
    if cost not in _COSTS:
        raise PartitionError(f"cost={cost!r}; expected 'time', 'flops' or 'params'")
    if sample is None and cost != "params":
        raise PartitionError(
            f"cost={cost!r} is measured on a sample input: pass sample=(x, ...) (forward's "
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
        cost=cost,
        tp=tp,
        sharded=sharded,
        setup=setup,
    )
    on_meta = any(p.is_meta for p in model.parameters())
    return _Measured(
        cls.__name__, names, costs, cost, sample is not None, modules, setup, sharded, not on_meta
    )


def _partition_args(m: _Measured, n_stages: int, bandwidth: Optional[float]) -> dict:
    """The partitioner's arguments: every segment's activations charged for
    the most microbatches any stage keeps in flight (never less than a
    stage holds; each stage's own figure is :func:`_stage_detail`'s)."""
    from dataclasses import replace

    from annot.runtime.cost import partition_args
    from annot.runtime.memory_model import in_flight

    most = max(in_flight(m.setup.schedule, n_stages, m.setup.microbatches))
    costs = [replace(c, activations=c.activations * most) for c in m.costs]
    return partition_args(costs, bandwidth=bandwidth)


def _stage_detail(m: _Measured, part: Any, tp: int) -> tuple:
    """Each stage's :class:`annot.runtime.memory_model.StageMemory`: its
    weights, gradients and optimizer state, its activations for the
    microbatches the schedule keeps in flight on it."""
    from annot.runtime.memory_model import Activations, in_flight, stage_memory

    flight = in_flight(m.setup.schedule, part.n_stages, m.setup.microbatches)
    out = []
    for s, (a, b) in enumerate(part.bounds):
        acts = Activations(
            per_microbatch=sum(c.activations for c in m.costs[a:b]),
            in_flight=flight[s] if m.measured else 0,
        )
        modules = [mod for mods in m.modules[a:b] for mod in mods]
        out.append(stage_memory(modules, acts, m.setup, tp=tp, sharded=m.sharded, pp=part.n_stages))
    return tuple(out)


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


def partition_units(
    args: dict[str, Any],
    n_stages: int,
    *,
    memory: Optional[int] = None,
    fit: bool = False,
    least_when_none_fits: bool = False,
) -> Any:
    """The planner's one partition step, for either unit source: the exact
    min-bottleneck contiguous split of the units (``args``:
    :func:`annot.runtime.cost.partition_args` of their costs) into
    ``n_stages`` stages under ``memory`` bytes each
    (:func:`annot.runtime.partition.partition`), or with ``fit`` the fewest
    stages, at most ``n_stages``, that fit it (:func:`annot.runtime.partition.fit`).
    ``least_when_none_fits``: where no split fits the budget as charged, the
    split whose largest stage is least (the caller checks each stage at its
    own figures)."""
    from annot.runtime.partition import fit as fit_fewest
    from annot.runtime.partition import least_memory, partition

    if fit:
        if memory is None:
            raise PartitionError("fit=True needs memory= (the budget each stage must fit)")
        return fit_fewest(memory_budget=memory, max_stages=n_stages, **args)
    try:
        return partition(n_stages=n_stages, memory_budget=memory, **args)
    except PartitionError:
        if not least_when_none_fits:
            raise
        least = least_memory(args["memories"], n_stages, shared=args["shared"])
        return partition(n_stages=n_stages, memory_budget=least, **args)


def _check_count(m: _Measured, n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PartitionError(f"{what}={n!r}; expected an int >= 1")
    if n > len(m.segments):
        raise TooFewSplitPoints(
            f"{m.class_name}.forward has {len(m.segments)} segments between its split points "
            f"({', '.join(m.segments[1:]) or 'none'}), fewer than the {n} stages asked for; "
            "use fewer stages, or give forward more top-level statements / a longer module list"
        )


def plan_stages(
    model: nn.Module,
    cls: type,
    n_stages: int,
    *,
    sample: Union[tuple, dict, torch.Tensor, None] = None,
    cost: Optional[str] = None,
    memory: Optional[int] = None,
    optimizer: str = "adamw",
    source_path: Optional[str] = None,
    progress: bool = False,
    cache_dir: Any = None,
    tp: int = 1,
    bandwidth: Optional[float] = None,
    repeats: int = 1,
    rounds: int = 5,
    setup: Any = None,
) -> StagePlan:
    """The best split of ``cls.forward`` (``model`` is a built ``cls``) into
    ``n_stages`` pipeline stages::

        plan = plan_stages(model, GPT, 4, sample=(idx, targets), memory=16 * 2**30)
        print(plan.table())
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=4), split=list(plan.boundaries))

    ``sample``: one microbatch, forward's positional arguments as a tuple or
    its keyword arguments as a dict. ``cost``: "time" (default with a
    sample), "flops" or "params" (default without). ``memory``: bytes per
    device; :class:`PartitionError` (with the numbers) when no split fits.
    ``bandwidth`` (bytes per unit of cost) charges the bytes crossing each cut.
    ``tp``: see the module docstring. Each segment's time is its median of
    ``rounds`` rounds over all the segments, a round timing the median of
    ``repeats`` runs of each (on a busy machine a run is often preempted; the
    median is robust to that, and :mod:`annot.module_units` keeps it too). Profiles are cached in ``cache_dir``.
    ``setup``: how the model trains (:class:`annot.runtime.memory_model.Training`:
    precision, optimizer, the schedule's microbatches in flight; default
    ``optimizer`` in float32 under 1F1B over 8 microbatches), for memory.
    """
    m = _measure(
        model,
        cls,
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=source_path,
        progress=progress,
        cache_dir=cache_dir,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
        setup=setup,
    )
    _check_count(m, n_stages, "n_stages")
    args = _partition_args(m, n_stages, bandwidth)
    part = partition_units(args, n_stages, memory=memory)
    return _result(m, part, memory, tp)


def fit_stages(
    model: nn.Module,
    cls: type,
    *,
    memory: int,
    max_stages: Optional[int] = None,
    sample: Union[tuple, dict, torch.Tensor, None] = None,
    cost: Optional[str] = None,
    optimizer: str = "adamw",
    source_path: Optional[str] = None,
    progress: bool = False,
    cache_dir: Any = None,
    tp: int = 1,
    bandwidth: Optional[float] = None,
    repeats: int = 1,
    rounds: int = 5,
    setup: Any = None,
) -> StagePlan:
    """Memory-fit mode (RaNNC): the fewest stages (at most ``max_stages``,
    default one per segment) whose every stage fits ``memory`` bytes, split
    as :func:`plan_stages` would; ``.n_stages`` is the count."""
    m = _measure(
        model,
        cls,
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=source_path,
        progress=progress,
        cache_dir=cache_dir,
        tp=tp,
        repeats=repeats,
        rounds=rounds,
        setup=setup,
    )
    cap = len(m.segments) if max_stages is None else max_stages
    _check_count(m, cap, "max_stages")
    args = _partition_args(m, cap, bandwidth)
    part = partition_units(args, cap, memory=memory, fit=True)
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
    tool's choice): one :class:`annot.runtime.cost_segments.SegmentCost` per stage, each
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


def plan(
    model: nn.Module,
    n_stages: int,
    *,
    units: Any,
    cost: Optional[str] = None,
    memory: Optional[int] = None,
    fit: bool = False,
    sample: Any = None,
    tp: int = 1,
    dp: int = 1,
    setup: Any = None,
    optimizer: str = "adamw",
) -> StagePlan:
    """The balanced split of ``model`` into ``n_stages`` pipeline stages over
    the ``units`` where a stage may begin: an
    :class:`annot.planner_segments.SourceSegments` (the segments of its class's
    forward, for the source runner) or an :class:`annot.module_units.ModuleUnits`
    (module calls at any depth, for the replay runner; from
    :class:`annot.stage_points.StagePoints` by ``ModuleUnits.of(points)``)::

        plan = annot.planner.plan(model, 4, units=ModuleUnits(), sample=batch, cost="flops")
        print(plan.table())

    ``cost``: "params", "flops" or "time" (default: the unit source's,
    :func:`plan_stages` / :func:`annot.module_units.plan_module_boundaries`);
    ``memory``: bytes each stage must fit, ``fit``: the fewest stages, at
    most ``n_stages``, that fit it; ``sample``: one microbatch of forward's
    arguments; ``tp``, ``dp``: the degrees the figures are for (``dp``:
    module units only, for fsdp's shares); ``setup``: how the model trains
    (:class:`annot.runtime.memory_model.Training`)."""
    from annot.module_units import ModuleUnits, plan_module_boundaries, plan_units
    from annot.planner_segments import SourceSegments

    if isinstance(units, ModuleUnits):
        if units.measures is not None:
            return plan_units(
                units.measures, n_stages, tp=tp, dp=dp, memory=memory, fit=fit,
                sharded=units.sharded,
            )  # fmt: skip
        return plan_module_boundaries(
            model,
            n_stages,
            sample=sample,
            cost=cost or "params",
            repeats=units.repeats,
            order=units.order,
            memory=memory,
            fit=fit,
            optimizer=optimizer,
            tp=tp,
            stranded=units.stranded,
            setup=setup,
            dp=dp,
        )
    if not isinstance(units, SourceSegments):
        raise PartitionError(
            f"plan: units={units!r}; expected annot.planner_segments.SourceSegments(cls) or "
            "annot.module_units.ModuleUnits(...)"
        )
    common = dict(
        sample=sample,
        cost=cost,
        optimizer=optimizer,
        source_path=units.source_path,
        progress=units.progress,
        cache_dir=units.cache_dir,
        tp=tp,
        bandwidth=units.bandwidth,
        repeats=units.repeats,
        rounds=units.rounds,
        setup=setup,
    )
    if fit:
        if memory is None:
            raise PartitionError("plan: fit=True needs memory= (the budget)")
        return fit_stages(model, units.cls, memory=memory, max_stages=n_stages, **common)
    return plan_stages(model, units.cls, n_stages, memory=memory, **common)
