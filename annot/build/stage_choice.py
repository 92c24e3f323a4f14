"""Which boundaries the pipeline stages begin at (:func:`annot.parallelize`
with pp > 1): ``annot.boundary()`` markers, ``split=`` / ``@stage(split=[...])``
as given, a transformers model's blocks, else the planner's balanced
partition, over the places :class:`annot.plan.stage_points.StagePoints` says a
stage may begin."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from annot.build.report import BuildReport
from annot.core.errors import HintError
from annot.plan.stage_points import StagePoints, check_stranded

__all__ = ["MemoryBudget", "check_stranded", "choose_boundaries", "resplit"]

log = logging.getLogger("annot")


@dataclass(frozen=True)
class MemoryBudget:
    """``parallelize(memory=...)``: the bytes each device has, and how the
    model trains (:class:`annot.plan.memory_model.Training`; precision and
    fsdp from ``parallelize``'s options), over ``dp`` data-parallel ranks."""

    bytes: int
    training: Any
    dp: int = 1

    @staticmethod
    def of(memory: Any, precision: Optional[str], fsdp: bool, dp: int) -> MemoryBudget:
        from annot.core.hints import parse_bytes
        from annot.plan.memory_model import Training

        kind = {None: "fp32", "bf16": "bf16-autocast"}.get(precision, "fp32")
        training = Training(precision=kind, fsdp=fsdp)
        return MemoryBudget(parse_bytes(memory, "parallelize"), training, dp)


def _module_boundaries(
    points: StagePoints,
    n_stages: int,
    report: Optional[BuildReport],
    budget: Optional[MemoryBudget] = None,
) -> list[str]:
    """The planner's balanced split of a model without ``@stage``
    (:func:`annot.plan.planner.plan` over :class:`annot.plan.module_units.ModuleUnits`):
    parameter counts over every block and block part, in call order, at the
    calls where a stage can begin (:class:`annot.plan.stage_points.StagePoints`).

    Stages cut at run time place each module and raw parameter by the order
    forward calls and reads them; without a probe of that order (no
    ``sample=``, no transformers config to make a tiny input from), the order
    the model registers its modules is all there is: the stages are placed
    in it, and the model's first call checks that placement against the order
    it shows before any stage runs (:func:`annot.plan.stage_points.verify_call_order`),
    refusing it, naming the module, where forward does not follow it. A
    plan the source split runs (``runner``, :func:`annot.plan.stage_points.choose_runner`)
    reads what each stage uses from the source, and stands, unless a memory
    ``budget`` rests on the units' order inside nested forwards.

    With ``sample`` (one microbatch) the units' FLOPs and activations are
    measured on meta, for the table; under a ``budget`` every stage must fit
    it, its activations in flight too: of ``sample``, else of the microbatch
    ``annot plan --memory`` assumes (:func:`annot.plan.planner.assumed_sample`: a
    transformers model's 1 x 2048 tokens), so both choose the same split;
    else :class:`annot.plan.module_units.StageMemoryError` names the stage."""
    from annot.plan.module_units import ModuleUnits
    from annot.plan.planner import assumed_sample, plan

    ref, order = points.ref, points.order
    sample = points.sample
    if budget is not None:
        sample, _ = assumed_sample(ref, sample)
    planned = plan(
        ref,
        n_stages,
        units=ModuleUnits.of(points),
        sample=_on_meta(sample),  # its figures, as annot plan --input shows them
        memory=budget.bytes if budget is not None else None,
        setup=budget.training if budget is not None else None,
        dp=budget.dp if budget is not None else 1,
    )
    log.debug("annot: planned stages\n%s", planned.table())
    if report is not None:
        report.plan_table = planned.table()
    b = planned.boundaries
    # under a budget the stages' figures must be forward's: nested, that order is unknown
    # (without a budget, stages cut at run time check their placement on the first
    # call: annot.plan.stage_points.verify_call_order)
    budgeted = budget is not None and points.source_refusal(b) is not None
    if order is None and budgeted:
        raise HintError(
            f"annot cannot split {type(ref).__name__} into {n_stages} pipeline stages "
            f"automatically without knowing the order its forward calls its modules and reads "
            f"its parameters: the balanced split begins stages at {list(planned.boundaries)} inside "
            "nested forwards, where each stage holds what it calls and reads, and the order "
            "the modules are registered in need not be the order forward calls them. To "
            "fix: pass sample=<one microbatch of forward's arguments, a tuple or a dict> to "
            "annot.parallelize (one meta forward, no FLOPs), or give the boundaries by hand "
            "with split=[...]"
        )
    return list(planned.boundaries)


def _on_meta(sample: Any) -> Any:
    if sample is None:
        return None
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample
    )


def resplit(cls: type, boundaries: tuple[str, ...]):
    """On a cache hit the rewritten source already has the stage methods; the
    plan (what each stage uses, what crosses) is the same as for the original
    source, which the tensor-parallel rewrite does not rename, so split that."""
    from annot.rewrite_cache import read_source
    from annot.rewriters.split.stage_split import split_stages

    path = inspect.getfile(cls)
    source = read_source(Path(path))
    return split_stages(source, cls.__qualname__, list(boundaries), path=path, nested=True)


def calls_to_cut(points: StagePoints, split: tuple[str, ...], report) -> tuple[str, ...]:
    """The module calls where the replay begins stages given at ``split``: a
    module list or dict (the source split cuts a loop over it; the replay cuts
    calls) begins its stage at the first call inside it
    (:meth:`StagePoints.first_call`), said in the log and ``explain``."""
    out = tuple(points.first_call(b) for b in split)
    moved = [f"{b!r} at {a!r}" for b, a in zip(split, out) if a != b]
    if moved:
        note = "stages given at a module container begin at its first call: " + ", ".join(moved)
        log.info("annot: %s", note)
        if report is not None:
            report.boundary_notes.append(note)
    return out


def choose_boundaries(
    points: StagePoints,
    n_stages: int,
    split: Optional[list[str]] = None,
    *,
    tp: int = 1,
    ctx=None,
    seed: Optional[int] = None,
    build=None,
    report: Optional[BuildReport] = None,
    budget: Optional[MemoryBudget] = None,
) -> tuple[str, ...]:
    """Where stages begin: ``annot.boundary()`` markers (``()``), ``split=`` /
    ``@stage(split=[...])`` as given, a Hugging Face model's pp plan, else the
    planner's optimal balanced partition over every place forward can be cut
    (cost: measured time, FLOPs or parameters; under ``@stage(memory=...)``
    or ``budget``, ``parallelize(memory=...)``). ``build()`` makes the model
    with real weights (rank 0 times it for ``cost="time"``)."""
    from annot.core.hints import StageSpec, get_stage_spec
    from annot.plan.unit_source import plans_over_modules

    ref, cls, sample = points.ref, points.cls, points.sample
    markers = points.markers()
    if markers:
        if markers != n_stages - 1:
            raise HintError(
                f"{cls.__name__}.forward has {markers} annot.boundary() markers, which make "
                f"{markers + 1} stages, but the mesh needs pp * chunks = {n_stages}"
            )
        return ()
    spec = get_stage_spec(cls)
    if split is not None:
        if isinstance(split, str) or not all(isinstance(b, str) for b in split):
            raise HintError(f"parallelize: split={split!r}; expected a list of module paths")
        spec = StageSpec(split=tuple(split))
    if split is None and plans_over_modules(cls):
        # no @stage of the user's: balance every nested block and block part
        return tuple(_module_boundaries(points, n_stages, report, budget))
    if spec is not None and spec.split:
        if len(spec.split) != n_stages - 1:
            raise HintError(
                f"@stage on {cls.__name__}: split={list(spec.split)!r} makes {len(spec.split) + 1} "
                f"stages but the mesh needs pp * chunks = {n_stages}; give {n_stages - 1} boundaries "
                "or use @stage(auto=True)"
            )
        return tuple(spec.split)
    from annot.core.errors import AnnotError
    from annot.plan.planner import plan
    from annot.plan.segment_plan import SourceSegments
    from annot.plan.unit_source import default_cost
    from annot.rewrite_cache import cache_dir

    auto = spec or StageSpec(auto=True)
    cost = auto.cost or default_cost(sample, over_modules=False)
    # profiles are cached next to the rewritten sources
    units = SourceSegments(
        cls, source_path=inspect.getfile(cls), cache_dir=cache_dir() / "profiles"
    )
    memory = budget.bytes if budget is not None else auto.memory
    setup = budget.training if budget is not None else None
    if cost == "time":
        # needs real weights and a clock: rank 0 measures, every rank gets its answer
        out: list = [None]
        if ctx.rank == 0:
            try:
                with torch.random.fork_rng():
                    if seed is not None:
                        torch.manual_seed(seed)
                    timed = plan(
                        build(), n_stages, units=units, sample=sample, cost=cost,
                        memory=memory, tp=tp, setup=setup,
                    )  # fmt: skip
                    out[0] = timed.boundaries
            except AnnotError as exc:
                out[0] = exc
        if ctx.distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], Exception):
            raise out[0]
        return tuple(out[0])
    # ref is on meta: the same on every rank
    planned = plan(
        ref, n_stages, units=units, sample=_on_meta(sample), cost=cost, memory=memory, tp=tp,
        setup=setup,
    )  # fmt: skip
    log.debug("annot: planned stages\n%s", planned.table())
    if report is not None:
        report.plan_table = planned.table()
    return tuple(planned.boundaries)
