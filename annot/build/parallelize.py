"""``annot.parallelize``: build this rank's part of a hinted model, in named
steps, each logged at debug level and recorded in ``model.report``:

1. the options checked before any rank works (:mod:`annot.build.options`), and
   the mesh joined (torchrun's environment; gloo on CPU, NCCL on CUDA);
2. the single-device reference built on the meta device (structure only: the
   truth every shard is cut from, without its memory);
3. the hints collected (``@shard`` on classes, ``hints=`` by module path, a
   transformers model's own tp plan) and checked against the reference;
   with pp > 1 the stage boundaries chosen (given, or planned) and the runner
   that cuts them there (:mod:`annot.build.stage_choice`);
4. the model's source rewritten just in time (cached on disk) and this rank's
   tp shard built from it on meta;
5. this rank's stages cut out and its part of the weights given, tensor by
   tensor (deferred initialization: no rank ever holds the full model);
6. at tp > 1, a pre-flight on meta tensors of a sample's shapes that refuses
   hints that would crash (:mod:`annot.build.preflight`; on the first call when
   no sample is known);
7. FSDP2 over dp (``fsdp=True``), the guards against torch's wrappers, a
   weight source read, ``torch.compile``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.build.hint_sources import build_hints
from annot.build.materialize import (
    adopt,
    check_same_rng,
    materialize,
    materialize_from,
    take_rewritten_classes,
)
from annot.build.options import Options, option_defaults, resolve_options
from annot.build.preflight import preflight
from annot.build.report import BuildReport
from annot.build.stage_choice import calls_to_cut, choose_boundaries, resplit
from annot.core.errors import HintError, IntegrationError, PipelineError
from annot.core.hints import (
    ShardSpec,
    get_shard_spec,
    recomputed_classes,
    stage_recompute,
)
from annot.core.mesh import Mesh
from annot.parallel_model import ParallelModel
from annot.plan.stage_points import StagePoints, choose_runner, verify_call_order
from annot.rewrite_cache import last_rewritten, rewrite_classes
from annot.rewriters.split.stage_split import split_stages
from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from annot.runtime import process_groups
from annot.runtime.init.deferred import meta_copy
from annot.runtime.pipeline.layout import build_layout
from annot.runtime.recompute import apply_recompute
from annot.runtime.runners.shape_run import call_with
from annot.runtime.runners.stage_modules import stage_calls
from annot.runtime.runners.stage_runner import ReplayRunner, SourceRunner
from annot.runtime.tp.sequence_parallel import apply_sequence_parallel, stage_runs
from annot.runtime.wrap_guard import guard as guard_wrappers
from annot.training.clip_grad import guard as guard_clip

__all__ = ["parallelize"]

log = logging.getLogger("annot")


def _external_for_module(specs: dict[type, ShardSpec], module) -> dict[str, ShardSpec]:
    return {
        cls.__name__: s
        for cls, s in specs.items()
        if cls.__module__ == module.__name__ and get_shard_spec(cls) != s
    }


def parallelize(
    model: Any,
    *args: Any,
    mesh: Optional[Mesh] = None,
    hints: Optional[dict] = None,
    seed: Optional[int] = None,
    chunks: int = 1,
    placement: str = "loop",
    split: Optional[list[str]] = None,
    sample: Any = None,
    precision: Optional[str] = None,
    verify: Optional[bool] = None,
    sequence_parallel: Union[bool, str, list[str]] = False,
    sequence_dim: int = 1,
    overlap_grad_reduce: bool = True,
    bucket_cap_mb: float = 25.0,
    fsdp: bool = False,
    compile: Union[bool, dict, None] = None,
    model_kwargs: Optional[dict] = None,
    weights: Any = None,
    memory: Union[int, str, None] = None,
    runner: str = "auto",
    **kwargs: Any,
) -> ParallelModel:
    """Build this rank's part of ``model`` over ``mesh``.

    ``model`` is an ``nn.Module`` class (built as ``model(*args, **kwargs)``)
    whose classes carry ``@shard`` / ``@stage`` hints, or ``hints=`` give them
    from outside, keyed by module-path patterns::

        model = annot.parallelize(GPT, config, mesh=annot.Mesh(tp=2), seed=0)

    With ``seed`` the result equals ``torch.manual_seed(seed); GPT(config)``
    cut into shards. With ``mesh.pp > 1`` the root class's forward is split
    into ``pp * chunks`` stages (``chunks > 1`` for the interleaved schedule;
    ``chunks=2, placement="v"`` places them in a V, rank r holding stages r and
    2 pp - 1 - r, for ``schedule="zbv"``)
    at ``split=[...]`` (module paths where stages begin; overrides the class's
    ``@stage(split=[...])``), at ``annot.boundary()`` markers, or balanced
    automatically by the planner (``@stage(auto=True, cost=..., memory=...)``;
    ``sample=`` one microbatch of forward's arguments, a tuple or a dict, lets
    it count FLOPs or measure time instead of parameters).
    ``precision="bf16"`` runs forward and the loss under bfloat16 autocast
    with float32 master weights, gradients and reductions (:mod:`annot.runtime.precision`).
    ``verify=True`` (default: the ``ANNOT_VERIFY=1`` environment variable)
    checks after every backward that each parameter replicated over tp has
    the same gradient on every tp rank, and raises :class:`VerifyError` naming
    the parameters that do not (their gradients are partial: hint them
    ``Replicate(sum_grad=True)``).
    ``sequence_parallel=True`` runs the model's blocks on sequence shards
    (Megatron-SP, :mod:`annot.runtime.tp.sequence_parallel`): its block list (a
    transformers model's pp plan, else its largest ``nn.ModuleList``), or the
    container or block paths given, split along ``sequence_dim`` (1: batch
    first); in a pipeline each stage's blocks enter and leave the shards.
    ``fsdp=True`` shards parameters, gradients and so the state of an
    optimizer built afterwards over dp with torch's FSDP2 (``fully_shard`` on
    each block and the root, :mod:`annot.runtime.fsdp`); at dp = 1 there is
    nothing to shard and it changes nothing.
    ``model_kwargs={...}`` passes constructor arguments whose names are
    also options here (a model's own ``compile=``, ``seed=``): an option
    given by name that the constructor also takes is refused, never taken
    silently by one of the two.
    ``compile=True`` (or a dict of ``torch.compile`` options) compiles each
    block of this rank's model after sharding (:mod:`annot.runtime.compile`; the
    same as ``model.compile(**options)`` on the result).
    ``weights=`` a weight source in place of the seed or the built model:
    :class:`annot.io.pretrained.PretrainedWeights`, which
    :func:`annot.from_pretrained` passes (storage given at step 5, values
    read once FSDP2 has sharded the parameters).
    ``memory=`` (bytes, or ``"80GiB"``) per device: the automatic split is
    planned so that every stage fits it (weights, gradients and AdamW state
    by ``precision`` and ``fsdp``; also the activations of the microbatches
    1F1B keeps in flight, measured on meta on ``sample=`` or, without one, on
    the microbatch ``annot plan`` assumes (:func:`annot.plan.planner.assumed_sample`);
    :mod:`annot.plan.memory_model`), the planner ``annot plan`` uses; a
    model that cannot fit is refused before any rank allocates, naming the
    stage, its memory and the budget.
    ``runner=`` how the pipeline stages run (:mod:`annot.runtime.runners.stage_runner`):
    ``"auto"`` chooses once from the plan (:func:`annot.plan.stage_points.choose_runner`),
    ``"replay"`` cuts them at run time at module calls, ``"source"`` runs the
    stage methods the rewriter cuts the root's forward into (and the forwards it
    calls, for boundaries in nested forwards: the split ``annot rewrite --pp``
    prints); the choice and its reason are in ``model.report.runner`` and
    ``explain``.
    Returns a :class:`ParallelModel`.
    """
    # first, before any option is rebound: the options as the caller gave them
    given = {k: v for k, v in locals().items() if k in _OPTION_DEFAULTS}
    model_kwargs = model_kwargs or {}
    opts = resolve_options(
        model, args, {**kwargs, **model_kwargs}, given, _OPTION_DEFAULTS, model_kwargs
    )
    mesh, cls, n_stages = opts.mesh, opts.cls, opts.mesh.pp * chunks
    ctx = process_groups.init(mesh)
    log.debug("annot: step 1: joined %r as rank %d", mesh, ctx.rank)
    ref = _reference(opts, args, seed, ctx)
    log.debug("annot: step 2: built the reference %s on the meta device", cls.__name__)
    report = BuildReport(mesh, placement=opts.placement)
    report.specs, paths = build_hints(ref, hints, mesh, report)
    log.debug("annot: step 3: verified hints on %s", sorted(c.__name__ for c in report.specs))

    points = StagePoints(ref, cls, sample)  # where a stage may begin; shared by planner and stages
    if n_stages > 1:
        report.boundaries, choice = _choose_stages(
            points, opts, args, split, runner, seed, ctx, report
        )
        report.runner, report.runner_reason = choice.name, choice.reason
        log.debug("annot: stages at %s, runner %s", report.boundaries, choice)
    local, split_plan = _rewrite_and_build(opts, args, paths, ref, ctx, report, n_stages)
    log.debug("annot: step 4: built %s for tp=%d (meta)", type(local).__qualname__, mesh.tp)
    if opts.sequence_parallel is not False and mesh.tp > 1:
        report.sequence_blocks = _sequence_blocks(local, opts.sequence_parallel, report.boundaries)
    check = _preflight_check(opts, ref, local, split_plan, ctx, report, paths, n_stages)
    layout = order_check = None
    if n_stages > 1:
        layout = _pipeline_layout(local, split_plan, points, ctx, chunks, report)
        log.debug("annot: pipeline stages %s on this rank", layout.local_stage_ids)
        order_check = _order_check(opts, ref, points, layout, report)
    _materialize(local, opts, args, ref, seed, ctx, layout)
    whole = None  # what the first-call check of inferred hints compares with
    if report.inferred is not None and report.inferred.hints:
        whole = ref if opts.instance is None else meta_copy(opts.instance)
    del ref, points
    log.debug("annot: step 5: materialized this rank's shard of the reference weights")

    built = _assemble(local, opts, ctx, layout, report, paths)
    built.order_check = order_check
    if whole is not None:
        from annot.build.inferred_check import install

        install(built, whole, report)
    if check is not None:
        _run_preflight(built, check, sample)
        log.debug("annot: step 6: pre-flight %s", report.preflight)
    _shard_over_dp(built, opts, layout)
    _guard(built, layout)
    if opts.weights is not None:
        opts.weights.fill(built)
        log.debug("annot: step 7b: read this rank's part of the weights")
    if opts.compile_kw is not None:
        built.compile(**opts.compile_kw)
        log.debug("annot: step 8: torch.compile on %s", built.compiled_blocks)
    return built


def _choose_stages(points: StagePoints, opts: Options, args, split, runner, seed, ctx, report):
    """``(boundaries, runner choice)``: where the stages begin (given, or
    planned) and which runner cuts them there, the same on every rank."""
    mesh = opts.mesh
    boundaries = choose_boundaries(
        points,
        mesh.pp * opts.chunks,
        split,
        tp=mesh.tp,
        ctx=ctx,
        seed=seed,
        build=lambda: opts.cls(*args, **opts.kwargs),
        report=report,
        budget=opts.memory_budget(),
    )
    choice = choose_runner(points, boundaries, runner)
    if choice.name == "replay":
        boundaries = calls_to_cut(points, boundaries, report)
    points.check(boundaries, choice.name)
    differing = ctx.ranks_differing((boundaries, choice.name))
    if differing:  # each rank plans alone: a difference would hang or mix stages
        raise PipelineError(
            f"ranks {differing} planned other pipeline stages than rank 0 "
            f"(boundaries {boundaries}, runner {choice.name!r} on rank {ctx.rank}): "
            "every rank must see the same model source, options and sample. To fix: "
            "give split=[...] and runner=... explicitly, and check that no rank reads "
            "files that change while the ranks start"
        )
    return boundaries, choice


def _preflight_check(opts: Options, ref, local, split_plan, ctx, report, paths, n_stages):
    """At tp > 1, the pre-flight bound to what it compares against (the
    reference, every stage's tp shard before this rank keeps its own); else None."""
    if opts.mesh.tp == 1:
        return None
    twin = ref if opts.instance is None else meta_copy(opts.instance)
    whole = None
    if n_stages > 1:  # every stage's tp shard, copied before this rank keeps its own
        whole = meta_copy(local)
        apply_sequence_parallel(whole, report.sequence_blocks, opts.sequence_dim, opts.mesh.tp)
    return functools.partial(
        preflight,
        whole=whole,
        split_forwards=split_plan.forwards if split_plan is not None else (),
        ref=twin,
        ctx=ctx,
        specs=report.specs,
        paths=paths,
        inferred=report.inferred is not None,
    )


def _materialize(local, opts: Options, args, ref, seed, ctx, layout) -> None:
    """Step 5: this rank's part of the weights: storage for a weight source to
    fill later, the given model's values, or the seed's, tensor by tensor."""
    if opts.weights is not None:
        opts.weights.allocate(local, ref, ctx)
    elif opts.instance is not None:
        materialize_from(local, opts.instance, ctx)
    else:
        materialize(local, opts.cls, args, opts.kwargs, seed, ctx, layout)


def _assemble(local, opts: Options, ctx, layout, report, paths) -> ParallelModel:
    """The :class:`ParallelModel`: activation recompute, ``sum_grad``
    marks, sequence parallelism and context parallelism applied to this rank's modules."""
    apply_recompute(local, recomputed_classes(local))
    _mark_grad_sums(local, paths)
    runs = (
        [report.sequence_blocks]
        if layout is None
        else stage_runs(layout, local, report.sequence_blocks)
    )
    for run in runs:
        apply_sequence_parallel(local, run, opts.sequence_dim, opts.mesh.tp)
    built = ParallelModel(
        local,
        ctx,
        pipeline=layout,
        report=report,
        autocast=opts.autocast,
        verify=opts.verify,
        overlap_grad_reduce=opts.overlap_grad_reduce,
        bucket_cap_mb=opts.bucket_cap_mb,
    )
    if opts.mesh.cp > 1:  # each rank its part of every sequence
        from annot.hf.context_parallel import install as context_parallel

        context_parallel(local, ctx)
    return built


def _guard(built: ParallelModel, layout) -> None:
    """Refuse from now on what would be wrong around a model whose ranks hold
    different parts: torch's clip_grad_norm_ on one part's norm, DDP or
    fully_shard over the parts."""
    ctx = built.ctx
    if ctx.distributed and (
        (layout is not None and layout.num_stages > 1)
        or ctx.mesh.tp > 1
        or ctx.mesh.ep > 1
        or built.fsdp is not None
    ):
        guard_clip(built)
    if ctx.distributed:
        guard_wrappers(built)


def _shard_over_dp(built: ParallelModel, opts: Options, layout) -> None:
    """Step 7 (``fsdp=True``): FSDP2 over dp, a unit per block of the
    model's block list (:func:`annot.hf.models.nested_blocks`) and the root."""
    if not opts.fsdp:
        return
    if not (built.ctx.distributed and opts.mesh.dp > 1):
        log.info("annot: fsdp=True at dp=1: nothing to shard over dp")
        return
    from annot.hf.models import nested_blocks
    from annot.runtime.fsdp import ShardedData, blocks_of
    from annot.runtime.runners.stage_prune import forget_real_weights

    local = built.module
    if built.preflight is not None and built.preflight.keywords.get("whole") is None:
        # the pre-flight on the first call runs on a meta copy of the model as built
        built.preflight = functools.partial(built.preflight, whole=meta_copy(local))
    blocks = blocks_of(local, nested_blocks(local))
    built.fsdp = ShardedData(
        local,
        built.ctx.device_mesh["dp"],
        blocks,
        pipelined=layout is not None and layout.num_stages > 1,
    )
    forget_real_weights(local)  # a shadow's tied weight: FSDP2 holds the live one now
    log.debug("annot: step 7: FSDP2 over dp on %d units", len(built.fsdp.units))


_OPTION_DEFAULTS = option_defaults(parallelize)


def _reference(opts: Options, args: tuple, seed, ctx) -> nn.Module:
    """Step 2: the single-device model, on meta (structure only: no rank builds
    the full model), or the built one."""
    if opts.instance is not None:
        return opts.instance
    rng = torch.random.get_rng_state()
    with torch.device("meta"):
        ref = opts.cls(*args, **opts.kwargs)
    if seed is None:
        check_same_rng(ctx, rng)
    return ref


def _rewrite_and_build(opts: Options, args, paths, ref, ctx, report, n_stages):
    """Step 4: rewrite the model's sources just in time (cached) and build this
    rank's model from them on meta, its hinted layers sharded; ``(model, the
    stage split of the root's forward or None)``."""
    from annot.runtime.ep.experts import convert_experts
    from annot.runtime.tp.convert import convert_hinted, tied_names

    cls, instance, kwargs, specs = opts.cls, opts.instance, opts.kwargs, report.specs
    tp, boundaries = report.mesh.tp, report.boundaries
    split_root = report.runner == "source"
    splits: dict = {}

    def transform(source: str, path: str, module) -> str:
        out = rewrite_tensor_parallel(
            source,
            tp,
            path=path,
            extra_hints=_external_for_module(specs, module),
            extra_by_path=True,  # convert_hinted converts what __init__ does not assign
        )
        if split_root and module.__name__ == cls.__module__:
            split = split_stages(out, cls.__qualname__, list(boundaries), path=path, nested=True)
            splits["split"] = split
            out = split.source
        return out

    key = (  # the split's class too: another class of the same file splits the file otherwise
        f"tp={tp};stages={n_stages}:{cls.__module__}.{cls.__qualname__}:{boundaries}:"
        f"{report.runner or 'one stage'};"
        f"hints={sorted((f'{c.__module__}.{c.__qualname__}', repr(s)) for c, s in specs.items())}"
    )
    needed = {*specs, cls} if split_root else set(specs)
    classes = list({type(m) for m in ref.modules()})
    mapping = rewrite_classes(classes, key=key, transform=transform, needed=needed)
    report.rewritten = last_rewritten()
    if instance is not None:
        local = adopt(instance, mapping)
    else:
        with process_groups.use(ctx), torch.random.fork_rng(), torch.device("meta"):
            local = mapping.get(cls, cls)(*args, **kwargs)
        take_rewritten_classes(local, mapping)  # modules built by an unchanged factory
        _check_hooks_kept(ref, local)
    with process_groups.use(ctx), torch.device("meta"):  # what construction did not shard
        convert_hinted(local, paths, tp, tied_names(ref))
        report.experts = convert_experts(local, paths, report.mesh.ep)
    split = splits.get("split")
    if split is None and split_root:
        split = resplit(cls, boundaries)  # a cache hit: the split of the source
    return local, split


def _check_hooks_kept(ref: nn.Module, local: nn.Module) -> None:
    """Refuse a model whose constructor registered hooks on the single-device
    model that it did not register on annot's build of it (rewritten classes
    are copies: ``isinstance(m, MLP)`` outside ``MLP`` is False for them)."""
    from annot.runtime.tp.user_hooks import lost_hooks

    lost = lost_hooks(ref, local)
    if lost:
        raise IntegrationError(
            f"{type(ref).__name__}(...) registers hooks on {lost[:4]} when built from your "
            "classes, but not when built from annot's rewritten copies of them (a check such "
            "as isinstance(m, YourClass) in code outside the class is False for a copy), so "
            "the parallel model would run without them. To fix: build the model yourself and "
            "pass the instance, annot.parallelize(model, ...), which keeps its hooks"
        )


def _pipeline_layout(local, split, points: StagePoints, ctx, chunks: int, report):
    """This rank's stages, run by the runner the build chose (``report.runner``):
    the root's forward split into stage methods by the rewriter, or cut at run
    time (replay) at the boundaries' module calls."""
    boundaries = report.boundaries
    runner: Union[SourceRunner, ReplayRunner]
    if report.runner == "source":
        runner = SourceRunner(split)
    else:
        seq = points.calls
        runner = ReplayRunner(stage_calls(seq, boundaries) if seq is not None else None)
    return build_layout(
        local,
        runner,
        ctx,
        chunks=chunks,
        boundaries=boundaries,
        recompute=stage_recompute(type(local)),
        v=report.placement == "v",
    )


def _order_check(opts: Options, ref, points: StagePoints, layout, report):
    """Stages cut at run time and placed without a call order (no probe: the
    modules' registration order): the check of that placement on the first
    call, before any stage runs (:func:`annot.plan.stage_points.verify_call_order`)."""
    if report.runner != "replay" or points.calls is not None:
        return None
    whole = ref if opts.instance is None else meta_copy(opts.instance)
    return functools.partial(verify_call_order, whole, layout.boundaries, layout.stage_modules)


def _run_preflight(built: ParallelModel, check, sample) -> None:
    """Step 6: the pre-flight on the sample's shapes (a transformers model
    makes its own tiny one), or on the first call when there is none."""
    from annot.hf.models import sample_inputs

    probe = sample if sample is not None else sample_inputs(check.keywords["ref"])
    if probe is None:  # checked on the first call, with its shapes
        built.preflight = check
        built.report.preflight = "on the first call"
        return
    with built.forward_context():
        built.dropout = call_with(lambda *a, **k: check(built.module, a, k), probe)
    built.report.preflight = "passed"


def _sequence_blocks(
    model: nn.Module, option: Union[bool, str, list[str]], boundaries: tuple[str, ...]
) -> list[str]:
    """The block paths ``sequence_parallel=`` names: ``True`` the model's block
    list, a container's path its children, else the paths given. A pipeline
    boundary inside one of them is refused."""
    blocks = _named_blocks(model, option)
    for b in boundaries:
        block = next((k for k in blocks if b.startswith(f"{k}.")), None)
        if block is not None:
            raise HintError(
                f"parallelize: the pipeline boundary {b!r} lies inside the block {block!r}, "
                "which sequence_parallel= runs on sequence shards; a stage must hand whole "
                f"blocks on. Put the boundary at a block ({block!r} or the next one), or leave "
                "the block out of sequence_parallel=[...]"
            )
    return blocks


def _named_blocks(model: nn.Module, option: Union[bool, str, list[str]]) -> list[str]:
    from annot.hf.models import nested_blocks

    if option is True:
        found = nested_blocks(model)
        if found is None:
            raise HintError(
                f"parallelize: sequence_parallel=True, but {type(model).__name__} has no "
                "nn.ModuleList of blocks; name them, e.g. sequence_parallel='blocks' or "
                "sequence_parallel=['blocks.0', 'blocks.1']"
            )
        option = found
    if isinstance(option, str):
        container = dict(model.named_modules()).get(option)
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            return [f"{option}.{name}" for name, _ in container.named_children()]
        return [option]
    if isinstance(option, (list, tuple)) and all(isinstance(p, str) for p in option):
        return list(option)
    raise HintError(
        f"parallelize: sequence_parallel={option!r}; expected True, a container's path "
        "('model.layers') or a list of block paths"
    )


def _mark_grad_sums(local: nn.Module, paths: dict) -> None:
    """Mark the parameters hinted ``Replicate(sum_grad=True)`` (a module's or a
    raw parameter's) for the runtime: their gradients are summed over tp."""
    from annot.core.specs import Replicate

    for path, s in paths.items():
        if not (isinstance(s, Replicate) and s.sum_grad):
            continue
        owner, _, name = path.rpartition(".")
        try:
            target = getattr(local.get_submodule(owner), name, None)
        except AttributeError:  # on another pipeline stage
            continue
        params = target.parameters() if isinstance(target, nn.Module) else [target]
        for p in params:
            if isinstance(p, nn.Parameter):
                p.__dict__["annot_grad_sum"] = "tp"  # a flag nn.Parameter does not declare
