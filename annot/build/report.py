"""What :func:`annot.parallelize` built, step by step: ``model.report``.

Read by :func:`annot.training.explain` and by tests; every field is set by the build
step named beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from annot.core.hints import ShardSpec
from annot.core.mesh import Mesh

if TYPE_CHECKING:
    from annot.plan.inferred_hints import Inferred

__all__ = ["BuildReport"]


@dataclass
class BuildReport:
    mesh: Mesh
    # where the stages sit: "loop" (rank r: r, r + pp, ...) or "v" (r and 2 pp - 1 - r)
    placement: str = "loop"
    # step 3, hints: the shard spec each class's rewrite applies
    specs: dict[type, ShardSpec] = field(default_factory=dict)
    # stages: where they begin, and the runner that runs them (annot.plan.stage_points.choose_runner):
    # "source" (the rewriter's stage methods) or "replay" (cut at run time); None without a pipeline
    boundaries: tuple[str, ...] = ()
    runner: Optional[str] = None
    runner_reason: str = ""
    plan_table: Optional[str] = None  # the planner's table, when it chose the boundaries
    # how hand boundaries were read (a module list given: its stage begins at its first call)
    boundary_notes: list[str] = field(default_factory=list)
    # step 4, rewrite: annot.rewrite_cache's record of each rewritten source
    rewritten: list = field(default_factory=list)
    # sequence parallelism: the blocks run on sequence shards
    sequence_blocks: list[str] = field(default_factory=list)
    # step 6: "passed", "on the first call" or "not run" (tp = 1, or pp > 1)
    preflight: str = "not run"
    # step 5 with annot.from_pretrained: where the weights were read
    # (annot.io.pretrained.Source: the directory, each model name's stored name)
    pretrained: Optional[object] = None
    # step 3 with nothing hinted and no transformers plan: the hints read off the
    # sources (annot.plan.inferred_hints.Inferred), checked on the first call
    inferred: Optional[Inferred] = None
    # step 4 at ep > 1: the modules hinted Experts(), split over the expert group
    experts: list[str] = field(default_factory=list)

    @property
    def replay(self) -> bool:
        """Whether the stages are cut at run time (:mod:`annot.runtime.runners.replay`)."""
        return self.runner == "replay"
