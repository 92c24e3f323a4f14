"""Automatic pipeline boundaries over a model's modules, at any depth.

With stages cut at run time (:mod:`annot.runtime.runners.replay`) any module call can begin
a stage, so the candidates are every block of the model's block lists
(``model.layers.3``) and, inside a block, each of its parts with weights
(``model.layers.3.mlp``: attention | MLP), plus the modules with weights
outside the blocks (embeddings, final norm, head), in the order forward calls
them; with measured costs also the parts of those parts (``self_attn.o_proj``)
where a split there balances the stages clearly better. Each candidate *unit*
runs until the next one begins; its cost is its parameter count, or its
measured time. :func:`annot.plan.partition.partition`
then gives the exact min-bottleneck contiguous split::

    plan = annot.plan.planner.plan(model, 4, units=ModuleUnits(), sample={"input_ids": ids}, cost="time")
    print(plan.table())
    annot.parallelize(LlamaForCausalLM, cfg, mesh=annot.Mesh(pp=4), split=plan.boundaries)

Measured time holds up under load: each unit's forward and backward are
timed in ``repeats`` full steps and the *median* is kept (one load spike moves
a mean or a single run, not a median).

:func:`annot.plan.planner.plan` with a :class:`ModuleUnits` is :func:`measure_units`
then :func:`plan_units`. Its ``cost``: "params" (no sample needed; a meta model
is fine: each unit's parameters as a proxy for its FLOPs per token, an
embedding's table counting zero and a tied head counting in full,
:attr:`Unit.work`), "time" (real weights and ``sample``), "flops" (``sample``,
one microbatch of forward's arguments: a dict, a tuple or a tensor; a meta
model and meta sample are fine) or a user's
:class:`annot.plan.costs.UnitCost`. ``memory``: bytes each stage must fit
(:mod:`annot.plan.memory_model`: its weights, gradients, master copy and
optimizer state by ``setup``, a tied weight in every stage that holds it, plus
with a sample the activations of the microbatches the schedule keeps in flight
on it). ``tp``: the stages' figures at that tp degree (the layers ``@shard`` or
the transformers tp plan splits hold ``1/tp``, and so do the activations
computed from them); ``dp``: the data-parallel degree (what fsdp shards over).
A split at the parts is taken only where it makes the slowest stage more
than 5% faster than the best split at whole blocks (:data:`DEEPER_GAIN`:
only the replay cuts inside a block); with a measured cost the split may
also begin inside a block part (``self_attn.o_proj``, :func:`units` at
``depth=2``), where that makes the slowest stage more than 3% faster than
the best split at the parts (5% than one at whole blocks): such a boundary
carries more tensors than one between parts.
``stranded``: the module calls where no stage can begin
(:func:`annot.runtime.runners.stranded.stranded`; found on ``sample`` when not given):
their units join the one before.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

from annot.core.errors import HintError, PartitionError
from annot.plan.result import StagePlan
from annot.plan.stage_points import StagePoints
from annot.plan.unit_figures import (
    UnitFigures,
    measurable,
    measure_figures,
    on_meta,
    tp_sharded,
)
from annot.plan.unit_source import default_cost
from annot.plan.units import (
    Unit,
    begin_where_possible,
    block_paths,
    call_order,
    coarser,
    unit_groups,
    units,
)

__all__ = ["ModuleUnits", "StageMemoryError", "UnitMeasures", "measure_units", "plan_units"]


class StageMemoryError(PartitionError):
    """No split into the stages asked for fits the memory budget: names the
    stage of the balanced split that needs the most, its memory and the budget."""

    def __init__(self, plan: StagePlan, stage: int):
        from annot.plan.cost_table import format_bytes

        self.plan, self.stage = plan, stage
        d = plan.stage_detail[stage]
        first, last = plan.stage_units(stage)
        n = len(plan.stage_costs)
        p = d.params
        act = (
            f", activations {format_bytes(d.activations)} for {d.in_flight} microbatch"
            f"{'es' if d.in_flight != 1 else ''} in flight"
            if d.in_flight
            else ""
        )
        master = f", master copy {format_bytes(p.master)}" if p.master else ""
        budget = plan.memory_budget
        assert budget is not None  # a plan made under a budget
        super().__init__(
            f"no split into {n} pipeline stage{'s' if n != 1 else ''} at tp={plan.tp} fits the "
            f"memory budget of {format_bytes(budget)} per device: stage {stage} "
            f"({first} .. {last}) needs {format_bytes(d.total)} (weights "
            f"{format_bytes(p.weights)}, gradients {format_bytes(p.grads)}{master}, optimizer "
            f"state {format_bytes(p.optimizer)}{act}). To fix: more pipeline stages or "
            "tensor-parallel degree, activation checkpointing, fewer microbatches in flight "
            "(a smaller microbatch), fsdp, or a larger budget"
        )


def _measured(flops: int, activations: int) -> Any:
    """A unit's measurements as :class:`annot.plan.cost_segments.SegmentCost`'s
    measured fields."""
    from types import SimpleNamespace

    return SimpleNamespace(
        flops=flops, forward_flops=0, activations=activations, time=0.0, output_bytes=0
    )


@dataclass(frozen=True)
class UnitMeasures:
    """A model's units and what one microbatch showed of them, measured once
    and planned at any pp and tp (:func:`plan_units`)."""

    model: nn.Module
    fine: list[Unit]
    figures: Optional[list[UnitFigures]]  # None: nothing ran (cost "params", no sample)
    timed: Optional[list[float]]
    cost: Any  # an annot.plan.costs.UnitCost
    setup: Any  # annot.plan.memory_model.Training


@dataclass(frozen=True)
class ModuleUnits:
    """A unit source of :func:`annot.plan.planner.plan`: every block, block part
    and weighted module outside the blocks, in call order (``order``; default:
    the call order on the sample, else registration order), less the calls
    where no stage can begin (``stranded``), for stages cut at run time
    (:mod:`annot.runtime.runners.replay`). ``measures``: units measured already (one
    measurement planned at many pp and tp, :mod:`annot.plan.what_if`); ``sharded``:
    the ids of the parameters tp splits (default: found from the hints)."""

    order: Optional[list[str]] = None
    stranded: Optional[dict[str, str]] = None
    repeats: int = 7
    progress: Any = None  # an annot.plan.what_if.Progress
    measures: Optional[UnitMeasures] = None
    sharded: Optional[set[int]] = None

    @staticmethod
    def of(points: StagePoints) -> ModuleUnits:
        """The module calls where :class:`annot.plan.stage_points.StagePoints` says a stage may begin."""
        return ModuleUnits(order=points.order, stranded=points.stranded)

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
        """Measure the units (unless :attr:`measures` holds them), then plan them."""
        if self.measures is not None:
            return plan_units(
                self.measures, n_stages, tp=tp, dp=dp, memory=memory, fit=fit,
                sharded=self.sharded,
            )  # fmt: skip
        from annot.plan.memory_model import Training

        if fit and memory is None:
            raise HintError("plan: fit=True needs memory= (the budget)")
        measures = measure_units(
            model,
            sample=sample,
            cost=cost or default_cost(sample, over_modules=True),
            repeats=self.repeats,
            order=self.order,
            stranded=self.stranded,
            setup=setup if setup is not None else Training(optimizer=optimizer),
            min_units=1 if fit else n_stages,
            progress=self.progress,
        )
        return plan_units(
            measures, n_stages, tp=tp, dp=dp, memory=memory, fit=fit, sharded=self.sharded
        )


def measure_units(
    model: nn.Module,
    *,
    sample: Any = None,
    cost: Any = "params",
    repeats: int = 7,
    order: Optional[list[str]] = None,
    stranded: Optional[dict[str, str]] = None,
    setup: Any = None,
    min_units: int = 1,
    progress: Any = None,
) -> UnitMeasures:
    """Step 1 of :func:`annot.plan.planner.plan` over :class:`ModuleUnits`: the
    units, and with a sample their FLOPs and saved bytes (and with a ``cost``
    that needs "time", its times: on a
    model built on the meta device, each unit materialized alone,
    :func:`annot.plan.unit_timing.time_units_alone`). ``progress``: an
    :class:`annot.plan.what_if.Progress` to note each unit timed on."""
    from annot.plan.costs import WEIGHTED_PARAMS, resolve_cost
    from annot.plan.memory_model import Training
    from annot.runtime.runners.stage_modules import record_calls

    setup = setup if setup is not None else Training()
    cost = resolve_cost(cost, WEIGHTED_PARAMS, "modules")
    if cost.needs != "params" and sample is None:
        raise HintError(f"plan: cost={cost.name!r} needs sample= (one microbatch)")
    if order is None and sample is not None:
        order = call_order(record_calls(model, sample))
    # measured costs also weigh the parts of block parts (a parameter count is
    # too rough a proxy for that); without an order a block is one unit
    fine = units(model, order, depth=1 if cost.needs == "params" else 2)
    if stranded is None and sample is not None:
        stranded = StagePoints(model, type(model), sample).stranded
    fine = begin_where_possible(fine, stranded or {})
    if len(fine) < min_units:
        raise HintError(
            f"{type(model).__name__} has {len(fine)} places a pipeline stage can begin, fewer "
            f"than the {min_units} stages asked for"
        )
    figures = None
    if sample is not None:
        figures = measure_figures(
            measurable(model),
            fine,
            sample,
            blocks=block_paths(model),
            float_size=setup.activation_dtype_bytes if setup.precision != "fp32" else None,
            recompute=setup.recompute,
        )
    timed = None
    if cost.needs == "time" and on_meta(model):  # one unit materialized at a time
        from annot.plan.unit_timing import time_units_alone

        timed = time_units_alone(model, fine, sample, repeats, progress)
    elif cost.needs == "time":
        from annot.plan.unit_timing import time_units_in_steps

        timed = time_units_in_steps(model, fine, sample, repeats)
    return UnitMeasures(model, fine, figures, timed, cost, setup)


def plan_units(
    measures: UnitMeasures,
    n_stages: int,
    *,
    tp: int = 1,
    dp: int = 1,
    memory: Optional[int] = None,
    fit: bool = False,
    sharded: Optional[set[int]] = None,
) -> StagePlan:
    """Step 2 of :func:`annot.plan.planner.plan` over :class:`ModuleUnits`: the balanced split of the
    measured units into ``n_stages`` stages at ``tp`` (and ``dp``, which only
    FSDP's shares depend on). ``sharded``: the ids of the parameters tp
    splits (default: found from the model's hints)."""
    fine = measures.fine
    if len(fine) < n_stages and not fit:
        raise HintError(
            f"{type(measures.model).__name__} has {len(fine)} places a pipeline stage can "
            f"begin, fewer than the {n_stages} stages asked for"
        )
    if tp > 1 and sharded is None:
        sharded = tp_sharded(measures.model, tp)
    best, best_level = None, 0
    levels = [lv for lv in (0, 1, 2) if lv == 0 or len(coarser(fine, lv - 1)) < len(fine)]
    for level in levels:  # whole blocks, their parts, then the parts of those parts
        try:
            plan = _plan_level(measures, level, n_stages, memory, fit, tp, dp, sharded or set())
        except PartitionError:
            if best is None and level == levels[-1]:
                raise
            continue  # too few blocks, or they do not fit the memory; their parts may
        if best is None or _deeper_pays(best, plan, DEEPER_GAIN[best_level]):
            best, best_level = plan, level
    assert best is not None  # the last level planned, or raised
    return best


# How much faster than the best plan at level k (0: whole blocks, 1: their
# parts) a deeper level must make the slowest stage to be taken. A boundary
# inside a block only the replay cuts (the source split cuts a loop between
# its elements, and is 5-15% faster on the same plan: benchmarks/runners.py);
# one inside a part carries every tensor alive in that part's forward (the
# frame walk of annot.runtime.runners.replay), more than one between parts.
DEEPER_GAIN = {0: 0.05, 1: 0.03}


def _deeper_pays(shallow: StagePlan, deep: StagePlan, gain: float) -> bool:
    if len(deep.stage_costs) != len(shallow.stage_costs):  # fit=True: fewer stages fit
        return len(deep.stage_costs) < len(shallow.stage_costs)
    return max(deep.stage_costs) < (1 - gain) * max(shallow.stage_costs)


def _plan_level(
    measures: UnitMeasures,
    level: int,
    n_stages: int,
    memory: Optional[int],
    fit: bool,
    tp: int,
    dp: int,
    sharded: set[int],
) -> StagePlan:
    """The balanced split over ``coarser(fine, level)``, its figures the sums of
    the fine units' measurements.

    The partition charges every stage the activations of the most
    microbatches any stage keeps in flight (1F1B: stage 0's pp) and, with
    checkpointing, the largest recomputed block: never less than a stage
    holds. Each stage's own figure (:func:`annot.plan.memory_model.stage_memory`)
    is what the plan reports; where that charge refuses every split, the
    balanced split is checked stage by stage at its own figures."""
    from annot.plan.cost import partition_args
    from annot.plan.costs import apply_cost, facts_of, segment_costs, stage_memories
    from annot.plan.memory_model import in_flight
    from annot.plan.partition import partition_units

    model, fine, setup, cost = measures.model, measures.fine, measures.setup, measures.cost
    groups = unit_groups(fine, level)
    found = coarser(fine, level)
    modules = dict(model.named_modules(remove_duplicate=False))
    owned = [[modules[p] for p in u.owns] for u in found]
    figures = None
    if measures.figures is not None:
        figures = [
            functools.reduce(UnitFigures.__add__, (measures.figures[i] for i in g)) for g in groups
        ]
    pp = n_stages
    flight = in_flight(setup.schedule, pp, setup.microbatches)
    most = max(flight)  # with fit, at most n_stages stages: never less than a stage holds
    per_mb: Optional[list[int]] = None
    measured = None
    if figures:
        per_mb = [f.activations(tp, setup.recompute) for f in figures]
        measured = [_measured(f.flops, a * most) for f, a in zip(figures, per_mb)]
    costs_of = segment_costs(
        model,
        [u.path for u in found],
        owned,
        measured,
        optimizer=setup.optimizer,
        tp=tp,
        sharded=sharded,
        setup=setup,
        dp=dp,
        pp=pp,
    )
    share = [1.0] * len(found)  # this rank's part of each unit at tp: params, or time alike
    if tp > 1:
        whole = [
            sum({id(p): p.numel() for m in ms for p in m.parameters()}.values()) for ms in owned
        ]
        share = [c.n_params / n if n else 1.0 for c, n in zip(costs_of, whole)]
    if measures.timed is not None:
        timed = [sum(measures.timed[i] for i in g) for g in groups]
        costs_of = [dataclasses.replace(c, time=t) for c, t in zip(costs_of, timed)]
    facts = [facts_of(c, ms, u.work, f) for c, ms, u, f in zip(costs_of, owned, found, share)]
    costs_of = apply_cost(cost, costs_of, facts)
    recomputed = [f.recomputed(tp) for f in figures] if figures and setup.recompute else None
    transient = [f.transient(tp) for f in figures] if figures else None
    args = partition_args(costs_of)
    most_extra = max(recomputed or [0]) + max(transient or [0])  # charged to every stage
    budget = memory - most_extra if memory is not None and most_extra else memory
    if memory is not None and budget is not None and budget <= 0:
        from annot.plan.cost_table import format_bytes

        raise PartitionError(
            f"the memory budget of {format_bytes(memory)} per device is less than what "
            f"backward holds at once in one stage ({format_bytes(most_extra)}: gradients on "
            "their way, a recomputed block); raise the budget or use a smaller microbatch"
        )
    # where no split fits as charged: the split whose largest stage is least,
    # checked stage by stage at its own figures below
    part = partition_units(
        args, n_stages, memory=budget, fit=fit, least_when_none_fits=memory is not None
    )
    if fit:
        flight = in_flight(setup.schedule, part.n_stages, setup.microbatches)
    detail = stage_memories(
        part,
        owned,
        setup,
        per_microbatch=per_mb,
        flight=flight,
        tp=tp,
        sharded=sharded,
        dp=dp,
        recompute=recomputed,
        transient=transient,
    )
    plan = StagePlan(
        class_name=type(model).__name__,
        boundaries=tuple(found[b].path for b in part.boundaries),
        partition=part,
        segments=tuple(u.path for u in found),
        costs=tuple(costs_of),
        cost=cost.name,
        measured=figures is not None,
        tp=tp,
        memory_budget=memory,
        stage_detail=tuple(detail),
        timed=measures.timed is not None,
        units=tuple(found),
    )
    if memory is not None:
        over = max(range(len(detail)), key=lambda s: detail[s].total)
        if detail[over].total > memory:
            raise StageMemoryError(plan, over)
    return plan
