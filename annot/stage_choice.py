"""Where the pipeline stages begin (:func:`annot.parallelize` with pp > 1):
``annot.boundary()`` markers, ``split=`` / ``@stage(split=[...])`` as given, a
transformers model's blocks, else the planner's balanced partition; and
whether the stage-split rewriter can cut the root's forward there or the
stages are cut at run time (:mod:`annot.runtime.replay`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from annot.build_report import BuildReport
from annot.core.errors import HintError

__all__ = [
    "MemoryBudget",
    "check_stranded",
    "choose_boundaries",
    "needs_replay",
    "record_calls",
    "resplit",
    "stranded_calls",
]

log = logging.getLogger("annot")


@dataclass(frozen=True)
class MemoryBudget:
    """``parallelize(memory=...)``: the bytes each device has, and how the
    model trains (:class:`annot.runtime.memory_model.Training`; precision and
    fsdp from ``parallelize``'s options), over ``dp`` data-parallel ranks."""

    bytes: int
    training: Any
    dp: int = 1

    @staticmethod
    def of(memory: Any, precision: Optional[str], fsdp: bool, dp: int) -> MemoryBudget:
        from annot.core.hints import parse_bytes
        from annot.runtime.memory_model import Training

        kind = {None: "fp32", "bf16": "bf16-autocast"}.get(precision, "fp32")
        training = Training(precision=kind, fsdp=fsdp)
        return MemoryBudget(parse_bytes(memory, "parallelize"), training, dp)


def record_calls(ref: nn.Module, sample: Any) -> Optional[list]:
    """The module calls of one meta forward of the reference on ``sample`` (for
    a transformers model without one, a tiny input made from its config), in
    order: which modules each replayed stage calls, and the planner's call
    order. None when there is no sample or the meta forward fails: modules
    then go by registration order."""
    from annot.runtime.stages import record_calls as record

    return _probe(record, ref, sample)


def stranded_calls(ref: nn.Module, sample: Any) -> dict[str, str]:
    """The module calls where a stage cannot begin, from one meta forward on
    ``sample`` as for :func:`record_calls` (:func:`annot.runtime.stranded.stranded`);
    empty without a probe."""
    from annot.runtime.stranded import stranded

    return _probe(stranded, ref, sample) or {}


def _probe(fn, ref: nn.Module, sample: Any) -> Any:
    from annot.hf import sample_inputs

    probe = sample if sample is not None else sample_inputs(ref)
    if probe is None:
        return None
    try:
        return fn(ref, probe)
    except Exception as exc:  # noqa: BLE001 - a refinement, not required
        log.debug("annot: the meta probe of %s failed (%s)", type(ref).__name__, exc)
        return None


def check_stranded(ref: nn.Module, boundaries: tuple[str, ...], stranded: dict[str, str]) -> None:
    """Refuse a boundary cut at run time whose call would leave a tensor behind
    (:func:`stranded_calls`), before any rank runs a step, naming an enclosing
    module where the stage can begin instead."""
    from annot.module_plan import never_called

    names = dict(ref.named_modules())
    for b in boundaries:
        if b not in stranded:
            continue
        up = b.rpartition(".")[0]
        while up and (up in stranded or up not in names or never_called(names[up])):
            up = up.rpartition(".")[0]
        instead = f"begin the stage at {up!r}, which encloses it, or " if up else ""
        raise HintError(
            f"pipeline boundary {b!r}: a stage cannot begin at that call: {stranded[b]}, so "
            f"the next stage could not receive it. To fix: {instead}begin it at another "
            "module call, or assign that value to a local variable before the call"
        )


def _module_boundaries(
    ref: nn.Module,
    cls: type,
    n_stages: int,
    calls: Optional[list],
    report: Optional[BuildReport],
    stranded: dict[str, str],
    budget: Optional[MemoryBudget] = None,
    sample: Any = None,
) -> list[str]:
    """annot.module_plan's balanced split of a model without ``@stage``:
    parameter counts over every block and block part, in call order, at the
    calls where a stage can begin.

    Stages cut at run time place each module and raw parameter by the order
    forward calls and reads them; without a probe of that order (no
    ``sample=``, no transformers config to make a tiny input from), the order
    the model registers its modules is all there is, and nothing shows that
    forward follows it: such a plan is refused, asking for ``sample=``. A
    plan the stage-split rewriter cuts in the root's forward reads what each
    stage uses from the source, and stands.

    Under a ``budget`` every stage must fit it (with ``sample``, one
    microbatch, also its activations in flight; measured on meta), else
    :class:`annot.module_plan.StageMemoryError` names the stage."""
    from annot.module_plan import call_order, plan_module_boundaries

    order = call_order(calls) if calls is not None else None
    plan = plan_module_boundaries(
        ref,
        n_stages,
        order=order,
        stranded=stranded,
        sample=_on_meta(sample) if budget is not None else None,
        memory=budget.bytes if budget is not None else None,
        setup=budget.training if budget is not None else None,
        dp=budget.dp if budget is not None else 1,
    )
    log.debug("annot: planned stages\n%s", plan.table())
    if report is not None:
        report.plan_table = plan.table()
    if order is None and needs_replay(ref, cls, tuple(plan.boundaries)):
        raise HintError(
            f"annot cannot split {type(ref).__name__} into {n_stages} pipeline stages "
            f"automatically without knowing the order its forward calls its modules and reads "
            f"its parameters: the balanced split begins stages at {plan.boundaries} inside "
            "nested forwards, where each stage holds what it calls and reads, and the order "
            "the modules are registered in need not be the order forward calls them. To "
            "fix: pass sample=<one microbatch of forward's arguments, a tuple or a dict> to "
            "annot.parallelize (one meta forward, no FLOPs), or give the boundaries by hand "
            "with split=[...]"
        )
    return plan.boundaries


def _on_meta(sample: Any) -> Any:
    if sample is None:
        return None
    return torch.utils._pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample
    )


def needs_replay(ref: nn.Module, cls: type, boundaries: tuple[str, ...]) -> bool:
    """Whether the stages are cut at run time (:mod:`annot.runtime.replay`): a
    boundary the stage-split rewriter cannot place in the root's ``forward``
    (inside a nested forward, a helper method, a container called whole).
    Boundaries that name no submodule are refused here, listing the options."""
    from annot.core.errors import RewriteError

    if not boundaries:
        return False  # annot.boundary() markers: the rewriter places them
    names = dict(ref.named_modules(remove_duplicate=False))
    for b in boundaries:
        if b not in names:
            near = [n for n in names if n and b.rsplit(".", 1)[0] in n][:8]
            raise HintError(
                f"pipeline boundary {b!r} names no submodule of {type(ref).__name__}; a "
                f"boundary is the path of the module whose call begins a stage"
                + (f" (e.g. {', '.join(near)})" if near else "")
            )
    try:
        resplit(cls, boundaries)
    except (RewriteError, OSError, TypeError):
        pass
    else:
        return False
    from annot.module_plan import never_called

    for b in boundaries:  # cut at run time: a stage begins at a module's call
        if never_called(names[b]):
            first = next(iter(names[b].named_children()), ("0", None))[0]
            raise HintError(
                f"pipeline boundary {b!r} names an nn.{type(names[b]).__name__}, which is never "
                "called (forward calls its elements), so no stage could begin there; name "
                f"the element whose call begins the stage, e.g. {b + '.' + first!r}"
            )
    return True


def resplit(cls: type, boundaries: tuple[str, ...]):
    """On a cache hit the rewritten source already has the stage methods; the
    plan (what each stage uses, what crosses) is the same as for the original
    source, which the tensor-parallel rewrite does not rename, so split that."""
    import inspect

    from annot.rewrite_cache import read_source
    from annot.rewriters.stage_split import split_stages

    path = inspect.getfile(cls)
    return split_stages(read_source(path), cls.__qualname__, list(boundaries), path=path)


def choose_boundaries(
    ref: nn.Module,
    cls: type,
    n_stages: int,
    split: Optional[list[str]] = None,
    *,
    sample: Any = None,
    tp: int = 1,
    ctx=None,
    seed: Optional[int] = None,
    build=None,
    report: Optional[BuildReport] = None,
    calls=lambda: None,
    find_stranded=dict,
    budget: Optional[MemoryBudget] = None,
) -> tuple[str, ...]:
    """Where stages begin: ``annot.boundary()`` markers, ``split=`` /
    ``@stage(split=[...])`` as given, a Hugging Face model's pp plan, else the
    planner's optimal balanced partition over every place forward can be cut
    (cost: measured time, FLOPs or parameters; under ``@stage(memory=...)``
    or ``budget``, ``parallelize(memory=...)``)."""
    import inspect

    from annot.core.hints import StageSpec, get_stage_spec
    from annot.rewrite_cache import read_source
    from annot.rewriters.stage_split import split_stages

    path = inspect.getfile(cls)
    markers = 0  # a forward inherited from a base (x-transformers' wrappers) has none of the user's
    if "forward" in vars(cls):
        markers = len(split_stages(read_source(path), cls.__qualname__, [], path=path).stages) - 1
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
    from annot.hf import is_hf_model

    if spec is None or (not spec.split and is_hf_model(ref)):
        # no @stage of the user's: balance every nested block and block part
        return tuple(
            _module_boundaries(ref, cls, n_stages, calls(), report, find_stranded(), budget, sample)
        )
    if spec is not None and spec.split:
        if len(spec.split) != n_stages - 1:
            raise HintError(
                f"@stage on {cls.__name__}: split={list(spec.split)!r} makes {len(spec.split) + 1} "
                f"stages but the mesh needs pp * chunks = {n_stages}; give {n_stages - 1} boundaries "
                "or use @stage(auto=True)"
            )
        return tuple(spec.split)
    from annot.core.errors import AnnotError
    from annot.planner import plan_stages

    auto = spec or StageSpec(auto=True)
    cost = auto.cost or ("flops" if sample is not None else "params")
    from annot.rewrite_cache import cache_dir

    # profiles are cached next to the rewritten sources
    memory = budget.bytes if budget is not None else auto.memory
    kw = dict(
        cost=cost,
        memory=memory,
        source_path=path,
        tp=tp,
        cache_dir=cache_dir() / "profiles",
        setup=budget.training if budget is not None else None,
    )
    if (
        cost == "time"
    ):  # needs real weights and a clock: rank 0 measures, every rank gets its answer
        out: list = [None]
        if ctx.rank == 0:
            try:
                with torch.random.fork_rng():
                    if seed is not None:
                        torch.manual_seed(seed)
                    out[0] = plan_stages(build(), cls, n_stages, sample=sample, **kw).boundaries
            except AnnotError as exc:
                out[0] = exc
        if ctx.distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], Exception):
            raise out[0]
        return tuple(out[0])
    plan = plan_stages(
        ref, cls, n_stages, sample=_on_meta(sample), **kw
    )  # ref is on meta: same on every rank
    log.debug("annot: planned stages\n%s", plan.table())
    if report is not None:
        report.plan_table = plan.table()
    return tuple(plan.boundaries)
