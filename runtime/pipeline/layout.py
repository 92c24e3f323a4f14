"""This rank's pipeline stages, cut out of the (tp-sharded) model.

The stage-split rewriter gives each stage a method on the root module
(``_annot_stage_k``) and the list of module paths it uses. Here each rank
keeps the modules its stages use and replaces every other submodule with an
empty placeholder (:mod:`annot.runtime.runners.stage_prune`; ``self.h[2:4]`` still
indexes the same blocks), finds
parameters shared by modules of different stages (tied weights, a module
used by two stages) and builds a process group over exactly the ranks that
hold each, so their gradients can be summed.

Stage ``s`` of ``pp * chunks`` stages lives on pipeline rank ``s % pp``
(interleaved: rank r holds stages r, r + pp, r + 2 pp, ...), or placed in a V
(``v``, ZB-V's: rank r holds stages r and 2 pp - 1 - r):
:func:`annot.runtime.pipeline.schedules.stage_rank`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from annot.runtime.pipeline.schedules import rank_stages, stage_rank
from annot.runtime.runners.stage_prune import absent_paths, covered, logged_modules, prune
from annot.runtime.runners.stage_runner import ReplayRunner, SourceRunner, StageRunner

__all__ = []

_SLICE = re.compile(r"^(?P<path>[\w.]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


@dataclass
class Tie:
    """One parameter held under several names by modules of different stages."""

    names: tuple[str, ...]
    stages: tuple[int, ...]
    group: Optional[Any] = None  # ProcessGroup over the ranks holding it (None if one rank)

    def local_param(self, module: nn.Module):
        """The parameter as ``module`` (this rank's part) registers it, under
        the first of the names it holds; None if it holds none (an absent
        module's shadow does not count: after FSDP2 its weight is stale)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        return next((params[n] for n in self.names if n in params), None)


@dataclass
class PipelineLayout:
    """What every rank knows about the pipeline; built by :func:`build_layout`."""

    runner: StageRunner  # how the stages run: the source split or the replay
    pp: int
    chunks: int
    pp_rank: int
    boundaries: tuple[str, ...]
    ties: list[Tie] = field(default_factory=list)
    local_keys: tuple[str, ...] = ()
    stage_modules: dict[int, set[str]] = field(default_factory=dict)
    recompute: bool = False  # @stage(recompute=True): recompute each stage in backward
    v: bool = False  # two stages per rank placed in a V (ZB-V)
    # replayed stages: the module paths whose outputs are logged, with their keys
    logged: dict[str, str] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def split(self) -> Any:
        """The stage-split rewriter's result the source runner runs; None for the replay."""
        return getattr(self.runner, "split", None)

    @property
    def output_arity(self) -> Optional[int]:
        return self.runner.output_arity

    def owner(self, stage: int) -> int:
        return stage_rank(stage, self.pp, self.v)

    @property
    def local_stage_ids(self) -> list[int]:
        return rank_stages(self.pp_rank, self.pp, self.chunks, self.v)

    def local_stages(self, module: nn.Module) -> list:
        """The executor's view of this rank's stages, as the runner runs them;
        with ``@stage(recompute=True)`` each stage's activations are
        recomputed in backward."""
        from annot.runtime.pipeline.executor import LocalStage
        from annot.runtime.recompute import recompute_stage

        wrap = recompute_stage if self.recompute else (lambda f: f)
        fns = self.runner.stage_functions(module, self, wrap)
        return [
            LocalStage(index=s, fn=fns[s], module=module, runner=self.runner)
            for s in self.local_stage_ids
        ]


def build_layout(
    model: nn.Module,
    runner: Any,
    ctx,
    *,
    chunks: int,
    boundaries: tuple[str, ...],
    calls: Optional[dict[int, set[str]]] = None,
    recompute: bool = False,
    v: bool = False,
) -> PipelineLayout:
    """Prune ``model`` (in place) to this rank's stages and find the ties.

    ``runner``: how the stages run (:mod:`annot.runtime.runners.stage_runner`); a
    stage-split rewriter's result stands for its :class:`SourceRunner`, None
    for a :class:`ReplayRunner` cutting at module-path ``boundaries`` at run
    time (``calls``: see :func:`call_order_stage_modules`). ``recompute``:
    recompute each stage's activations in backward (``@stage(recompute=True)``,
    read by the build). ``v``: two stages per rank placed in a V.

    Every rank must call this (tied-weight process groups are created
    collectively, in the same order everywhere).
    """
    mesh = ctx.mesh
    if not isinstance(runner, StageRunner):
        runner = ReplayRunner(calls) if runner is None else SourceRunner(runner)
    stage_modules = runner.stage_modules(model, tuple(boundaries), mesh.pp * chunks)
    at_run_time = runner.cuts_at_run_time
    # Tied parameters: one Parameter object under several names.
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    ties: list[Tie] = []
    for names in by_id.values():
        holders = sorted(
            {
                s
                for s, keep in stage_modules.items()
                for nm in names
                if covered(nm.rpartition(".")[0], keep) or covered(nm, keep)
            }
        )
        owners = sorted({stage_rank(h, mesh.pp, v) for h in holders})
        if len(owners) > 1:
            ties.append(Tie(tuple(names), tuple(holders)))
    # Process groups for ties, created by every rank in the same order.
    if dist.is_initialized() and ties:
        dp_, _, tp_ = mesh.coords(ctx.rank)
        for tie in ties:
            owners = sorted({stage_rank(h, mesh.pp, v) for h in tie.stages})
            for d in range(mesh.dp):
                for t in range(mesh.tp):
                    ranks = [mesh.rank_of(d, o, t) for o in owners]
                    g = dist.new_group(ranks)
                    if d == dp_ and t == tp_ and ctx.pp_rank in owners:
                        tie.group = g

    def held(pp_rank: int) -> tuple[set[str], frozenset]:
        """What rank ``pp_rank``'s part keeps, and the boundaries it crosses."""
        ids = rank_stages(pp_rank, mesh.pp, chunks, v)
        keep = set().union(*(stage_modules[s] for s in ids))
        through = frozenset(
            boundaries[b] for s in ids for b in (s - 1, s) if 0 <= b < len(boundaries)
        )
        return keep, through

    # replayed stages: the modules some rank holds as a placeholder, whose
    # outputs the rank that runs them logs (annot.runtime.runners.replay)
    logged = (
        logged_modules(model, set().union(*(absent_paths(model, *held(r)) for r in range(mesh.pp))))
        if at_run_time
        else {}
    )
    keep, through = held(ctx.pp_rank)
    prune(model, keep, shadows=at_run_time, through=through)
    local_keys = tuple(model.state_dict().keys())
    return PipelineLayout(
        runner=runner,
        pp=mesh.pp,
        chunks=chunks,
        pp_rank=ctx.pp_rank,
        boundaries=tuple(boundaries),
        ties=ties,
        local_keys=local_keys,
        stage_modules=stage_modules,
        recompute=recompute,
        v=v,
        logged=logged,
    )
