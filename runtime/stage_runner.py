"""How this rank runs its pipeline stages: a runner, chosen once by the build
(:func:`annot.stage_points.choose_runner`) and recorded on the layout
(:class:`annot.runtime.stages.PipelineLayout`).

Both runners run the same plan (the same boundaries, the same stages):

* :class:`SourceRunner`: the stage-split rewriter cut the root's ``forward``
  into stage methods (``_annot_stage_k``); each stage is its method, and what
  a stage holds and sends is read from the source.
* :class:`ReplayRunner`: the model's own ``forward`` runs on every rank and
  the stages are cut at run time where a boundary module is called
  (:mod:`annot.runtime.replay`); each stage holds the modules of its range of
  calls (:func:`annot.runtime.stages.call_order_stage_modules`).

The rest of the runtime asks the runner, not how the layout was made.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Optional

import torch.nn as nn

from annot.core.errors import PipelineError

__all__ = ["ReplayRunner", "SourceRunner", "StageRunner"]


class StageRunner(ABC):
    """One way to run the stages of a plan."""

    name: ClassVar[str]  # "source" or "replay": what build reports and explain shows
    cuts_at_run_time: ClassVar[bool]  # every rank runs forward's code for every stage

    @abstractmethod
    def stage_modules(
        self, model: nn.Module, boundaries: tuple[str, ...], n_stages: int
    ) -> dict[int, set[str]]:
        """The module paths each stage holds."""

    @abstractmethod
    def stage_functions(
        self, module: nn.Module, layout: Any, wrap: Callable
    ) -> dict[int, Callable]:
        """This rank's stage functions by stage index (``wrap``: the
        ``@stage(checkpoint=True)`` recompute, identity otherwise)."""

    @property
    def output_arity(self) -> Optional[int]:
        return None


class SourceRunner(StageRunner):
    """Stages as the stage methods the rewriter wrote
    (:class:`annot.rewriters.stage_split.StageSplit`)."""

    name = "source"
    cuts_at_run_time = False

    def __init__(self, split: Any):
        self.split = split

    def stage_modules(self, model, boundaries, n_stages):
        from annot.runtime.stages import expand_module_paths

        if len(self.split.stages) != n_stages:
            raise PipelineError(
                f"the stage split has {len(self.split.stages)} stages but the mesh needs "
                f"pp * chunks = {n_stages}"
            )
        return {s.index: expand_module_paths(model, s.modules) for s in self.split.stages}

    def stage_functions(self, module, layout, wrap):
        return {
            s: wrap(getattr(module, self.split.stages[s].method)) for s in layout.local_stage_ids
        }

    @property
    def output_arity(self) -> Optional[int]:
        return self.split.output_arity


class ReplayRunner(StageRunner):
    """Stages cut at run time at module calls (:mod:`annot.runtime.replay`).
    ``calls``: the module paths each stage calls, from one meta forward
    (:func:`annot.runtime.stages.stage_calls`), or None (registration order)."""

    name = "replay"
    cuts_at_run_time = True

    def __init__(self, calls: Optional[dict[int, set[str]]] = None):
        self.calls = calls

    def stage_modules(self, model, boundaries, n_stages):
        from annot.runtime.stages import call_order_stage_modules

        return call_order_stage_modules(model, tuple(boundaries), self.calls)

    def stage_functions(self, module, layout, wrap):
        from annot.runtime.replay import ReplayStage, install_boundaries, install_output_log

        if layout.checkpoint:
            raise PipelineError(
                f"@stage(checkpoint=True) on {type(module).__name__}: its stages are cut "
                "inside nested forwards, so there is no stage function to recompute; put "
                "@checkpoint on the block classes instead (annot.checkpoint)"
            )
        if not getattr(module, "_annot_boundaries_installed", False):
            install_boundaries(module, layout.boundaries)
            install_output_log(module, layout.logged)
            module._annot_boundaries_installed = True
        return {s: ReplayStage(module, s, layout.boundaries) for s in layout.local_stage_ids}
