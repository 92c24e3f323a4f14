"""What the planner plans over: a *unit source* (the places a stage may
begin, and how to measure and partition them), the one rule that picks it
for a class, and the one default of what is balanced. :func:`annot.plan.planner.plan`
takes any :class:`UnitSource`: :class:`annot.plan.segment_plan.SourceSegments`
(the segments of a forward, for the source split) or
:class:`annot.plan.module_units.ModuleUnits` (module calls at any depth)."""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch.nn as nn

from annot.core.errors import PartitionError

__all__ = ["TooFewSplitPoints", "UnitSource", "default_cost", "plans_over_modules"]


@runtime_checkable
class UnitSource(Protocol):
    """Where a stage may begin in a model, and the plan over those places."""

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
    ) -> Any:
        """The :class:`annot.plan.result.StagePlan` of ``model`` in ``n_stages``."""
        ...


def default_cost(sample: Any, over_modules: bool) -> str:
    """What the planner balances where no cost is asked, for every caller
    (``parallelize``, ``annot plan``, :func:`annot.plan.planner.plan`): over
    module calls (``over_modules``, :func:`plans_over_modules`) the parameters
    each unit multiplies by (a measured cost may cut inside block parts, where
    a boundary carries more tensors: asked for, never the default); over the
    segments of a forward the FLOPs of one microbatch where a ``sample`` is
    given (counted on meta: no weights, the same answer on every rank), else
    the parameters."""
    return "flops" if sample is not None and not over_modules else "params"


def plans_over_modules(cls: type) -> bool:
    """The one rule for the units an automatic split chooses among, for
    ``parallelize`` and ``annot plan`` alike: module calls at any depth
    (:class:`annot.plan.module_units.ModuleUnits`: every block and block part,
    in call order) for a class without ``@stage``, or a transformers model
    whose ``@stage`` names no boundaries (its blocks sit in nested forwards);
    the segments of the class's own forward
    (:class:`annot.plan.segment_plan.SourceSegments`) under ``@stage(auto=True)``."""
    from annot.core.hints import get_stage_spec
    from annot.hf.tp_plan import is_hf_class

    spec = get_stage_spec(cls)
    return spec is None or (not spec.split and is_hf_class(cls))


class TooFewSplitPoints(PartitionError):
    """forward has fewer places to cut than the stages asked for (``annot
    plan`` then plans the model's nested blocks instead)."""
