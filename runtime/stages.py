"""This rank's pipeline stages, cut out of the (tp-sharded) model.

The stage-split rewriter gives each stage a method on the root module
(``_annot_stage_k``) and the list of module paths it uses. Here each rank
keeps the modules its stages use and replaces every other submodule with an
empty placeholder (so ``self.h[2:4]`` still indexes the same blocks), finds
parameters shared by modules of different stages (tied weights, a module
used by two stages) and builds a process group over exactly the ranks that
hold each, so their gradients can be summed.

Stage ``s`` of ``pp * chunks`` stages lives on pipeline rank ``s % pp``
(interleaved: rank r holds stages r, r + pp, r + 2 pp, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from annot.errors import PipelineError

__all__ = []

_SLICE = re.compile(r"^(?P<path>[\w.]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


class Absent(nn.Module):
    """Placeholder for a submodule held by another pipeline stage."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, *args, **kwargs):
        raise PipelineError(
            f"module {self.path!r} belongs to another pipeline stage but was called here; "
            "the stage split missed a use of it (please report this with your model)"
        )

    def extra_repr(self) -> str:
        return f"held by another stage: {self.path}"


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = (
            obj[int(part)]
            if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential))
            else getattr(obj, part)
        )
    return obj


def expand_module_paths(root: nn.Module, uses: tuple[str, ...]) -> set[str]:
    """Module paths (``h.2``) for the uses the rewriter reported (``h[2:4]``,
    ``lm_head``, ``config``); non-module attributes are dropped."""
    out: set[str] = set()
    for use in uses:
        m = _SLICE.match(use)
        if m:
            seq = _get(root, m["path"])
            n = len(seq)
            start = int(m["start"]) if m["start"] else 0
            stop = int(m["stop"]) if m["stop"] else n
            for i in range(*slice(start, stop).indices(n)):
                out.add(f"{m['path']}.{i}")
            continue
        try:
            obj = _get(root, use)
        except (AttributeError, IndexError):
            continue
        if isinstance(obj, nn.Module):
            out.add(use)
        elif isinstance(obj, nn.Parameter):
            out.add(use)
    return out


def _covered(path: str, keep: set[str]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keep)


def _ancestor(path: str, keep: set[str]) -> bool:
    return any(k.startswith(path + ".") for k in keep)


def prune(root: nn.Module, keep: set[str], prefix: str = "") -> None:
    """Replace every submodule not in (or above) ``keep`` with :class:`Absent`."""
    for name, child in list(root.named_children()):
        path = f"{prefix}{name}"
        if _covered(path, keep):
            continue
        if _ancestor(path, keep):
            prune(child, keep, path + ".")
        else:
            root._modules[name] = Absent(path)
    for name in list(root._parameters):
        if not _covered(f"{prefix}{name}", keep):
            root._parameters[name] = None  # a parameter of another stage's module


@dataclass
class Tie:
    """One parameter held under several names by modules of different stages."""

    names: tuple[str, ...]
    stages: tuple[int, ...]
    group: Optional[Any] = None  # ProcessGroup over the ranks holding it (None if one rank)

    def local_param(self, module: nn.Module):
        for n in self.names:
            try:
                p = _get(module, n)
            except (AttributeError, IndexError):
                continue
            if isinstance(p, nn.Parameter):
                return p
        return None


@dataclass
class PipelinePlan:
    """What every rank knows about the pipeline; built by :func:`build_plan`."""

    split: Any  # rewriters.stage_split.StageSplit
    pp: int
    chunks: int
    pp_rank: int
    boundaries: tuple[str, ...]
    ties: list[Tie] = field(default_factory=list)
    local_keys: tuple[str, ...] = ()
    stage_modules: dict[int, set[str]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def output_arity(self) -> Optional[int]:
        return self.split.output_arity

    def owner(self, stage: int) -> int:
        return stage % self.pp

    @property
    def local_stage_ids(self) -> list[int]:
        return [self.pp_rank + c * self.pp for c in range(self.chunks)]

    def local_stages(self, module: nn.Module) -> list:
        """The executor's view of this rank's stages; with ``@stage(checkpoint=True)``
        each stage's activations are recomputed in backward."""
        from annot.hints import get_stage_spec
        from runtime.checkpointing import checkpoint_stage
        from runtime.pipeline import LocalStage

        spec = next(
            (get_stage_spec(c) for c in type(module).__mro__ if get_stage_spec(c) is not None),
            None,
        )
        wrap = checkpoint_stage if spec is not None and spec.checkpoint else (lambda f: f)
        return [
            LocalStage(
                index=s, fn=wrap(getattr(module, self.split.stages[s].method)), module=module
            )
            for s in self.local_stage_ids
        ]


def build_plan(
    model: nn.Module, split, ctx, *, chunks: int, boundaries: tuple[str, ...]
) -> PipelinePlan:
    """Prune ``model`` (in place) to this rank's stages and find the ties.

    Every rank must call this (tied-weight process groups are created
    collectively, in the same order everywhere).
    """
    mesh = ctx.mesh
    n = mesh.pp * chunks
    if len(split.stages) != n:
        raise PipelineError(
            f"the stage split has {len(split.stages)} stages but pp({mesh.pp}) * chunks({chunks}) = {n}"
        )
    stage_modules = {s.index: expand_module_paths(model, s.modules) for s in split.stages}
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
                if _covered(nm.rpartition(".")[0], keep) or _covered(nm, keep)
            }
        )
        owners = sorted({h % mesh.pp for h in holders})
        if len(owners) > 1:
            ties.append(Tie(tuple(names), tuple(holders)))
    # Process groups for ties, created by every rank in the same order.
    if dist.is_initialized() and ties:
        dp_, _, tp_ = mesh.coords(ctx.rank)
        for tie in ties:
            owners = sorted({h % mesh.pp for h in tie.stages})
            for d in range(mesh.dp):
                for t in range(mesh.tp):
                    ranks = [mesh.rank_of(d, o, t) for o in owners]
                    g = dist.new_group(ranks)
                    if d == dp_ and t == tp_ and ctx.pp_rank in owners:
                        tie.group = g
    local_ids = [ctx.pp_rank + c * mesh.pp for c in range(chunks)]
    keep = set().union(*(stage_modules[s] for s in local_ids))
    prune(model, keep)
    local_keys = tuple(model.state_dict().keys())
    return PipelinePlan(
        split=split,
        pp=mesh.pp,
        chunks=chunks,
        pp_rank=ctx.pp_rank,
        boundaries=tuple(boundaries),
        ties=ties,
        local_keys=local_keys,
        stage_modules=stage_modules,
    )
