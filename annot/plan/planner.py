"""Automatic pipeline partitioning of a model's ``forward``: where to cut.

:func:`plan` over :class:`annot.plan.segment_plan.SourceSegments` answers "at
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
begin, the segments of a source split (:class:`annot.plan.segment_plan.SourceSegments`,
steps 1 to 3 above) or the module calls at any depth the replay runner cuts
at (:class:`annot.plan.module_units.ModuleUnits`), and the answer is one
:class:`StagePlan` with one table. ``parallelize`` (:mod:`annot.build.stage_choice`),
``annot plan`` (:mod:`annot.cli.plan`) and :mod:`annot.plan.what_if` call it.

This module holds the entry point; :func:`plan` asks its ``units`` (a
:class:`annot.plan.unit_source.UnitSource`) for the plan, and the rule that
picks them and the default cost are in :mod:`annot.plan.unit_source`. Steps 1
to 3 over source segments live in :mod:`annot.plan.segment_plan` (with
:mod:`annot.plan.points`, :mod:`annot.plan.segments` and
:mod:`annot.plan.costs`); over module calls in :mod:`annot.plan.module_units`
(with :mod:`annot.plan.units`); the result in :mod:`annot.plan.result`.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.core.errors import PartitionError
from annot.plan.costs import UnitCost
from annot.plan.points import split_points
from annot.plan.result import StagePlan
from annot.plan.segment_plan import SourceSegments, measure_split
from annot.plan.unit_source import UnitSource

__all__ = [
    "DEFAULT_SEQ_LEN",
    "SourceSegments",
    "StagePlan",
    "UnitCost",
    "UnitSource",
    "assumed_sample",
    "measure_split",
    "plan",
    "split_points",
]


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
    :func:`annot.hf.models.sample_inputs`'s tiny one (a model that takes no token ids
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
    :class:`annot.plan.segment_plan.SourceSegments` (the segments of its class's
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
    parameters each unit multiplies by (:attr:`annot.plan.units.Unit.work`).
    ``memory``: bytes each stage must fit (:class:`PartitionError`, with
    the numbers, when no split does); ``fit``: the fewest stages, at most
    ``n_stages``, that fit it (RaNNC's memory-fit mode); ``sample``: one
    microbatch of forward's arguments (a tuple, a dict or a tensor); ``tp``,
    ``dp``: the degrees the figures are for (``tp``: see the module
    docstring; ``dp``: module units only, for fsdp's shares); ``setup``: how
    the model trains (:class:`annot.plan.memory_model.Training`: precision,
    optimizer, the schedule's microbatches in flight; default ``optimizer``
    in float32 under 1F1B over 8 microbatches)."""
    if not isinstance(units, UnitSource):
        raise PartitionError(
            f"plan: units={units!r}; expected annot.plan.segment_plan.SourceSegments(cls), "
            "annot.plan.module_units.ModuleUnits(...) or another UnitSource (an object with "
            "plan(model, n_stages, ...))"
        )
    return units.plan(
        model, n_stages, cost=cost, memory=memory, fit=fit, sample=sample, tp=tp, dp=dp,
        setup=setup, optimizer=optimizer,
    )  # fmt: skip
