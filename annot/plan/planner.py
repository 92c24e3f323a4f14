"""Automatic pipeline partitioning of a model's ``forward``: where to cut.

:func:`plan` over :class:`annot.plan.segments.SourceSegments` answers "at
which module paths should ``GPT.forward`` be split into ``n`` stages so that
the slowest stage is as fast as possible and every stage fits in memory?" in
four steps:

1. **Split points.** :func:`split_points` lists every place
   :func:`annot.rewriters.split.stage_split.split_stages` can begin a stage: before each
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
3. **Costs.** With a sample input, :func:`annot.plan.cost.profile_segments` runs
   the segments in turn (forward + backward): time, FLOPs, activation bytes,
   bytes crossing to the next segment. Parameter, gradient and optimizer-state
   bytes are counted from the segments' modules; a parameter several segments
   use (an embedding tied to the LM head) becomes a shared group, charged once
   per stage that holds it. Without a sample only parameters are counted.
   What is balanced is a :class:`annot.plan.costs.UnitCost` of each
   segment: "time", "flops" or "params" (bytes held), or a user's own.
   A segment's time is its median of ``rounds`` passes over all segments
   (a busy machine preempts some runs; the median is the statistic
   :mod:`annot.plan.module_units` keeps too, :func:`annot.plan.costs.median_round`).
   Segments timed on their own run with their weights in cache, so on a CPU
   a stage holding a large layer (an LM head) can run somewhat slower whole
   than its segments add up to: :func:`measure_split` times the stages of a
   given split whole, to check a plan or compare it with a hand split.
4. **Partition.** :func:`annot.plan.partition.partition` (exact min-bottleneck,
   per-device ``memory`` budget), or :func:`annot.plan.partition.fit` for the
   fewest stages that fit (``plan(..., fit=True)``, RaNNC's memory-fit mode).

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
begin, the segments of a source split (:class:`annot.plan.segments.SourceSegments`,
steps 1 to 3 above) or the module calls at any depth the replay runner cuts
at (:class:`annot.plan.module_units.ModuleUnits`), and the answer is one
:class:`StagePlan` with one table. ``parallelize`` (:mod:`annot.build.stage_choice`),
``annot plan`` (:mod:`annot.cli.plan`) and :mod:`annot.plan.what_if` call it.

This module holds the entry points; steps 1 to 3 live in
:mod:`annot.plan.points`, :mod:`annot.plan.segments` and
:mod:`annot.plan.costs`, the result in :mod:`annot.plan.result`.
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

from annot.core.errors import HintError, PartitionError, RewriteError
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
from annot.plan.points import (
    module_at,
    no_markers,
    points_and_split,
    split_forward,
    split_points,
)
from annot.plan.result import StagePlan
from annot.plan.segments import exec_class, stage_fn, stage_modules

__all__ = [
    "StagePlan",
    "TooFewSplitPoints",
    "DEFAULT_SEQ_LEN",
    "UnitCost",
    "assumed_sample",
    "default_cost",
    "measure_split",
    "partition_units",
    "plan",
    "plans_over_modules",
    "split_points",
]


def default_cost(sample: Any) -> str:
    """What the planner balances where no cost is asked, for every caller
    (``parallelize``, ``annot plan``, :func:`plan`): the FLOPs of one
    microbatch where a ``sample`` is given (counted on meta: no weights, the
    same answer on every rank), else the parameters."""
    return "flops" if sample is not None else "params"


def plans_over_modules(cls: type) -> bool:
    """The one rule for the units an automatic split chooses among, for
    ``parallelize`` and ``annot plan`` alike: module calls at any depth
    (:class:`annot.plan.module_units.ModuleUnits`: every block and block part,
    in call order) for a class without ``@stage``, or a transformers model
    whose ``@stage`` names no boundaries (its blocks sit in nested forwards);
    the segments of the class's own forward
    (:class:`annot.plan.segments.SourceSegments`) under ``@stage(auto=True)``."""
    from annot.core.hints import get_stage_spec
    from annot.hf.tp_plan import is_hf_class

    spec = get_stage_spec(cls)
    return spec is None or (not spec.split and is_hf_class(cls))


# tokens per sequence of the microbatch a transformers model's plan assumes
# when no sample is given (annot plan --seq-len, parallelize(memory=...))
DEFAULT_SEQ_LEN = 2048


def assumed_sample(
    model: nn.Module,
    sample: Any = None,
    *,
    seq_len: Optional[int] = None,
    microbatch_size: Optional[int] = None,
) -> tuple[Any, bool]:
    """The microbatch a plan's activations are measured on, and whether it was
    made here: ``sample`` as given; without one, for a transformers model,
    ``microbatch_size`` (default 1) sequences of ``seq_len`` (default
    :data:`DEFAULT_SEQ_LEN`) tokens (``labels`` too where forward takes
    them: the loss's saved tensors count), made from
    :func:`annot.hf.sample_inputs`'s tiny one (a model that takes no token ids
    keeps that one's shape); else None: no activations. The one rule of
    ``annot plan`` and ``parallelize(memory=...)``, so both fit a budget alike."""
    if sample is not None:
        return sample, False
    from annot.hf.models import sample_inputs

    tiny = sample_inputs(model)
    if tiny is None or "input_ids" not in tiny:
        return tiny, tiny is not None
    shape = (microbatch_size or 1, seq_len or DEFAULT_SEQ_LEN)
    out = {
        k: torch.zeros(shape, dtype=torch.long) if k.endswith("input_ids") else v
        for k, v in tiny.items()
    }
    if "labels" in inspect.signature(type(model).forward).parameters:
        out["labels"] = out["input_ids"]
    return out, True


class TooFewSplitPoints(PartitionError):
    """forward has fewer places to cut than the stages asked for (``annot
    plan`` then plans the model's nested blocks instead)."""


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
        cost = default_cost(sample)
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


def _plan_segments(
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
    """:func:`plan` over a :class:`annot.plan.segments.SourceSegments`:
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


def plan(
    model: nn.Module,
    n_stages: int,
    *,
    units: Any,
    cost: Union[str, UnitCost, None] = None,
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
    :class:`annot.plan.segments.SourceSegments` (the segments of its class's
    forward, for the source runner) or an :class:`annot.plan.module_units.ModuleUnits`
    (module calls at any depth, for the replay runner; from
    :class:`annot.plan.stage_points.StagePoints` by ``ModuleUnits.of(points)``)::

        plan = annot.plan.planner.plan(model, 4, units=ModuleUnits(), sample=batch, cost="flops")
        print(plan.table())
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=4), split=list(plan.boundaries))

    ``cost``: what is balanced, "params", "flops" or "time" (default: with
    source segments "time" with a sample, else "params"; with module units
    "params") or a user's :class:`annot.plan.costs.UnitCost` (an object
    with ``name``, ``needs`` and ``unit_costs(units)``). With source
    segments "params" is the bytes each segment holds; with module units the
    parameters each unit multiplies by (:attr:`annot.plan.module_units.Unit.work`).
    ``memory``: bytes each stage must fit (:class:`PartitionError`, with
    the numbers, when no split does); ``fit``: the fewest stages, at most
    ``n_stages``, that fit it (RaNNC's memory-fit mode); ``sample``: one
    microbatch of forward's arguments (a tuple, a dict or a tensor); ``tp``,
    ``dp``: the degrees the figures are for (``tp``: see the module
    docstring; ``dp``: module units only, for fsdp's shares); ``setup``: how
    the model trains (:class:`annot.plan.memory_model.Training`: precision,
    optimizer, the schedule's microbatches in flight; default ``optimizer``
    in float32 under 1F1B over 8 microbatches)."""
    from annot.plan.module_units import ModuleUnits, measure_units, plan_units
    from annot.plan.segments import SourceSegments

    if isinstance(units, ModuleUnits):
        if units.measures is not None:
            return plan_units(
                units.measures, n_stages, tp=tp, dp=dp, memory=memory, fit=fit,
                sharded=units.sharded,
            )  # fmt: skip
        from annot.plan.memory_model import Training

        if fit and memory is None:
            raise HintError("plan: fit=True needs memory= (the budget)")
        measures = measure_units(
            model,
            sample=sample,
            cost=cost or default_cost(sample),
            repeats=units.repeats,
            order=units.order,
            stranded=units.stranded,
            setup=setup if setup is not None else Training(optimizer=optimizer),
            min_units=1 if fit else n_stages,
            progress=units.progress,
        )
        return plan_units(
            measures, n_stages, tp=tp, dp=dp, memory=memory, fit=fit, sharded=units.sharded
        )
    if not isinstance(units, SourceSegments):
        raise PartitionError(
            f"plan: units={units!r}; expected annot.plan.segments.SourceSegments(cls) or "
            "annot.plan.module_units.ModuleUnits(...)"
        )
    return _plan_segments(
        model, units, n_stages, sample=sample, cost=cost, memory=memory, fit=fit,
        optimizer=optimizer, tp=tp, setup=setup,
    )  # fmt: skip
