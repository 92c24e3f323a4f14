"""``annot.parallelize``: build this rank's part of a hinted model.

Steps (each logged at debug level):

1. join the mesh (torchrun's environment; gloo on CPU, NCCL on CUDA);
2. build the single-device reference on the meta device (structure only: the
   truth every shard is cut from, without its memory);
3. collect hints (``@shard`` on classes, external ``hints=`` by module path)
   and verify them against the reference (names, types, divisibility);
4. rewrite the model's source just in time (cached on disk) and build the
   rewritten classes: each rank constructs only its tp shard;
5. give each shard its part of the reference weights, computed tensor by
   tensor (deferred initialization: no rank ever holds the full model); wrap
   ``@checkpoint`` classes for activation checkpointing;
6. at tp > 1, run the model once on meta tensors of a sample's shapes and
   refuse hints that would crash (:mod:`annot.preflight`; on the first call
   when no sample is known).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.errors import HintError
from annot.hints import (
    ShardSpec,
    checkpointed_classes,
    get_shard_spec,
    hinted_paths,
    resolve_hints,
    stage_checkpoint,
)
from annot.mesh import Mesh
from annot.parallel_model import ParallelModel
from annot.runtime.deferred_init import meta_copy

__all__ = ["parallelize"]

log = logging.getLogger("annot")


def _class_specs(
    ref: nn.Module, hints: Optional[dict]
) -> tuple[dict[type, ShardSpec], dict[str, object]]:
    """(the specs each class's source rewrite applies, every hint by path):
    ``@shard`` decorators, merged with external ``hints=`` (which win)."""
    specs: dict[type, ShardSpec] = {}
    for m in ref.modules():
        s = get_shard_spec(type(m))
        if s is not None:
            specs[type(m)] = s
    external: dict[str, object] = {}
    if hints:
        ext_specs, external = resolve_hints(ref, hints)
        for cls, ext in ext_specs.items():
            base = specs.get(cls)
            if base is not None:  # external entries override the decorator's
                ext = ShardSpec(
                    {**base.specs, **ext.specs}, tuple(dict.fromkeys(base.local + ext.local))
                )
            specs[cls] = ext
    return specs, {**hinted_paths(ref, specs), **external}


def _external_for_module(specs: dict[type, ShardSpec], module) -> dict[str, ShardSpec]:
    return {
        cls.__name__: s
        for cls, s in specs.items()
        if cls.__module__ == module.__name__ and get_shard_spec(cls) != s
    }


def _check_same_rng(ctx, rng_state: torch.Tensor) -> None:
    """Without ``seed=`` every rank must start from the same RNG state, or the
    ranks would cut their shards from different initial weights."""
    import hashlib

    import torch.distributed as dist

    if not ctx.distributed:
        return
    digest = hashlib.sha256(rng_state.numpy().tobytes()).hexdigest()
    states: list = [None] * ctx.world_size
    dist.all_gather_object(states, digest)
    bad = [r for r, d in enumerate(states) if d != states[0]]
    if bad:
        raise HintError(
            f"ranks {bad} would build different initial weights than rank 0 (their random "
            "state differs): pass seed= to annot.parallelize (or seed every rank the same "
            "before building the model)"
        )


def parallelize(
    model: Any,
    *args: Any,
    mesh: Optional[Mesh] = None,
    hints: Optional[dict] = None,
    seed: Optional[int] = None,
    chunks: int = 1,
    split: Optional[list[str]] = None,
    sample: Any = None,
    precision: Optional[str] = None,
    verify: Optional[bool] = None,
    sequence_parallel: Union[bool, str, list[str]] = False,
    sequence_dim: int = 1,
    **kwargs: Any,
) -> ParallelModel:
    """Build this rank's part of ``model`` over ``mesh``.

    ``model`` is an ``nn.Module`` class (built as ``model(*args, **kwargs)``)
    whose classes carry ``@shard`` / ``@stage`` hints, or ``hints=`` give them
    from outside, keyed by module-path patterns::

        model = annot.parallelize(GPT, config, mesh=annot.Mesh(tp=2), seed=0)

    With ``seed`` the result equals ``torch.manual_seed(seed); GPT(config)``
    cut into shards. With ``mesh.pp > 1`` the root class's forward is split
    into ``pp * chunks`` stages (``chunks > 1`` for the interleaved schedule)
    at ``split=[...]`` (module paths where stages begin; overrides the class's
    ``@stage(split=[...])``), at ``annot.boundary()`` markers, or balanced
    automatically by the planner (``@stage(auto=True, cost=..., memory=...)``;
    ``sample=`` one microbatch of forward's arguments, a tuple or a dict, lets
    it count FLOPs or measure time instead of parameters).
    ``precision="bf16"`` runs forward and the loss under bfloat16 autocast
    with float32 master weights, gradients and reductions (:mod:`annot.precision`).
    ``verify=True`` (default: the ``ANNOT_VERIFY=1`` environment variable)
    checks after every backward that each parameter replicated over tp has
    the same gradient on every tp rank, and raises :class:`VerifyError` naming
    the parameters that do not (their gradients are partial: hint them
    ``Replicate(sum_grad=True)``).
    ``sequence_parallel=True`` runs the model's blocks on sequence shards
    (Megatron-SP, :mod:`annot.runtime.sequence_parallel`): its block list (a
    transformers model's pp plan, else its largest ``nn.ModuleList``), or the
    container or block paths given, split along ``sequence_dim`` (1: batch
    first).
    Returns a :class:`ParallelModel`.
    """
    from annot.compiler import compile_classes
    from annot.precision import parse_precision
    from annot.runtime import mesh as rmesh
    from annot.verify import verify_shard_hints

    autocast = parse_precision(precision)
    mesh = mesh or Mesh()
    if not isinstance(mesh, Mesh):
        raise HintError(f"parallelize: mesh={mesh!r}; expected annot.Mesh(dp=, pp=, tp=)")
    instance = None
    if isinstance(model, nn.Module):  # built already (e.g. by a library's loader)
        if args or kwargs:
            raise HintError(
                "parallelize: got a built model and constructor arguments; pass either the "
                "class and its arguments, or the model alone"
            )
        instance, model = model, type(model)
    elif not (isinstance(model, type) and issubclass(model, nn.Module)):
        raise HintError(
            f"parallelize: expected an nn.Module class (and its constructor arguments) or a "
            f"built nn.Module, got {type(model).__name__}; e.g. "
            "annot.parallelize(GPT, config, mesh=mesh)"
        )
    if sequence_parallel is not False and mesh.pp * chunks > 1:
        raise HintError(
            "parallelize: sequence_parallel= with pipeline stages is not supported yet; "
            "use it at pp=1 (tp and dp), or build without it"
        )
    ctx = rmesh.init(mesh)
    log.debug("annot: step 1: joined %r as rank %d", mesh, ctx.rank)

    rng = torch.random.get_rng_state()
    if instance is not None:
        ref = instance
    else:
        with torch.device("meta"):  # structure only: no rank builds the full model
            ref = model(*args, **kwargs)
    if seed is None and instance is None:
        _check_same_rng(ctx, rng)
    log.debug("annot: step 2: built the reference %s on the meta device", model.__name__)

    if hints is None and mesh.tp > 1 and not any(get_shard_spec(type(m)) for m in ref.modules()):
        from annot.hf import hints_from_hf_config  # {} unless a transformers model with a plan

        hints = hints_from_hf_config(ref, tp=mesh.tp) or None
    specs, paths = _class_specs(ref, hints)
    verify_shard_hints(ref, specs, mesh.tp, paths)
    from annot.runtime.tp_convert import convert_hinted, tied_names

    ties = tied_names(ref)
    log.debug("annot: step 3: verified hints on %s", sorted(c.__name__ for c in specs))

    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise HintError(f"parallelize: chunks={chunks!r}; expected an int >= 1")
    n_stages = mesh.pp * chunks
    boundaries: tuple[str, ...] = ()
    planned: dict = {}
    # one meta forward when needed, shared by the planner and the stage plan
    calls = functools.cache(functools.partial(_record_calls, ref, sample))

    if n_stages > 1:
        boundaries = _choose_boundaries(
            ref,
            model,
            n_stages,
            split,
            sample=sample,
            tp=mesh.tp,
            ctx=ctx,
            seed=seed,
            build=lambda: model(*args, **kwargs),
            report=planned,
            calls=calls,
        )
        log.debug("annot: stage boundaries %s", boundaries)
    replay = n_stages > 1 and _needs_replay(ref, model, boundaries)
    splits: dict = {}

    def transform(source: str, path: str, module) -> str:
        from annot.rewriters.tensor_parallel import rewrite_tensor_parallel

        out = rewrite_tensor_parallel(
            source, mesh.tp, path=path, extra_hints=_external_for_module(specs, module)
        )
        if n_stages > 1 and not replay and module.__name__ == model.__module__:
            from annot.rewriters.stage_split import split_stages

            split = split_stages(out, model.__qualname__, list(boundaries), path=path)
            splits["split"] = split
            out = split.source
        return out

    key = (
        f"tp={mesh.tp};stages={n_stages}:{boundaries}:{'replay' if replay else 'split'};"
        f"hints={sorted((c.__qualname__, repr(s)) for c, s in specs.items())}"
    )
    classes = list({type(m) for m in ref.modules()})
    mapping = compile_classes(classes, key=key, transform=transform)
    new_cls = mapping.get(model, model)
    if instance is not None:
        local = _adopt(instance, mapping)
    else:
        with rmesh.use(ctx), torch.random.fork_rng(), torch.device("meta"):
            local = new_cls(*args, **kwargs)
    with rmesh.use(ctx), torch.device("meta"):  # what construction did not shard
        convert_hinted(local, paths, mesh.tp, ties)
    log.debug("annot: step 4: built %s for tp=%d (meta)", new_cls.__qualname__, mesh.tp)

    plan = None
    if n_stages > 1:
        from annot.runtime.stages import build_plan

        split = None if replay else splits.get("split") or _resplit(model, boundaries)
        from annot.runtime.stages import stage_calls

        seq = calls() if replay else None
        plan = build_plan(
            local,
            split,
            ctx,
            chunks=chunks,
            boundaries=boundaries,
            calls=stage_calls(seq, boundaries) if seq is not None else None,
            checkpoint=stage_checkpoint(type(local)),
        )
        log.debug("annot: pipeline stages %s on this rank", plan.local_stage_ids)

    check = None
    if mesh.tp > 1 and n_stages == 1:
        from annot.preflight import preflight

        twin = ref if instance is None else meta_copy(instance)
        check = functools.partial(preflight, ref=twin, ctx=ctx, specs=specs, paths=paths)
    if instance is not None:
        _materialize_from(local, instance, ctx)
    else:
        _materialize(local, model, args, kwargs, seed, ctx, plan)
    del ref, calls
    log.debug("annot: step 5: materialized this rank's shard of the reference weights")

    from annot.runtime.checkpointing import apply_activation_checkpointing

    apply_activation_checkpointing(local, checkpointed_classes(local))
    _mark_grad_sums(local, paths)
    if sequence_parallel is not False and mesh.tp > 1:
        from annot.runtime.sequence_parallel import apply_sequence_parallel

        apply_sequence_parallel(
            local, _sequence_blocks(local, sequence_parallel), sequence_dim, mesh.tp
        )
    if verify is None:
        verify = os.environ.get("ANNOT_VERIFY") == "1"

    built = ParallelModel(
        local,
        ctx,
        pipeline=plan,
        info={"compiled": list(compile_classes.last), "specs": specs, **planned},
        autocast=autocast,
        verify=verify,
    )
    if check is not None:
        from annot.hf import sample_inputs

        probe = sample if sample is not None else sample_inputs(check.keywords["ref"])
        if probe is None:  # checked on the first call, with its shapes
            built.preflight = check
        else:
            from annot.runtime.replay import call_with

            with built.forward_context():
                built.dropout = call_with(lambda *a, **k: check(local, a, k), probe)
        log.debug("annot: step 6: pre-flight %s", "deferred" if probe is None else "passed")
    return built


def _sequence_blocks(model: nn.Module, option: Union[bool, str, list[str]]) -> list[str]:
    """The block paths ``sequence_parallel=`` names: ``True`` the model's block
    list, a container's path its children, else the paths given."""
    from annot.hf import nested_blocks

    if option is True:
        option = nested_blocks(model)
        if option is None:
            raise HintError(
                f"parallelize: sequence_parallel=True, but {type(model).__name__} has no "
                "nn.ModuleList of blocks; name them, e.g. sequence_parallel='blocks' or "
                "sequence_parallel=['blocks.0', 'blocks.1']"
            )
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
    from annot.specs import Replicate

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
                p.annot_grad_sum = "tp"


def _adopt(instance: nn.Module, mapping: dict) -> nn.Module:
    """A built model as if its rewritten classes had built it: a copy on the
    meta device whose modules take their rewritten classes (forward reads the
    per-rank sizes). Its hinted layers are converted afterwards, as every
    layer construction did not shard is (``convert_hinted``)."""
    local = meta_copy(instance)
    for mod in local.modules():
        if type(mod) in mapping:
            mod.__class__ = mapping[type(mod)]
    return local


def _materialize_from(local: nn.Module, instance: nn.Module, ctx) -> None:
    """Cut this rank's shards out of a built model's own weights."""
    from annot.runtime import mesh as rmesh
    from annot.runtime.deferred_init import materialize_, named_tensors, shard_slicers

    with rmesh.use(ctx):
        wanted = shard_slicers(local)
    have = named_tensors(local)
    values = {}
    for name, t in named_tensors(instance).items():
        cut = wanted(name) if name in have else None
        if cut is not None:
            values[name] = cut(t.detach())
    materialize_(local, values, ctx.device)


def _materialize(local, model, args, kwargs, seed, ctx, plan) -> None:
    """Give ``local`` (built on meta) this rank's part of the reference weights:
    the values of ``torch.manual_seed(seed); model(*args)``, computed tensor by
    tensor without ever holding the full model (annot.runtime.deferred_init). A model
    whose construction deferred init cannot replay is built in full instead,
    with a warning saying why. With ``seed`` the random state afterwards is
    the reference's after its construction, the same on every rank, so random
    ops in replicated regions (dropout) draw what the single-device run draws."""
    from annot.runtime import mesh as rmesh
    from annot.runtime.deferred_init import (
        DeferredInitError,
        deferred_reference,
        materialize_,
        shard_slicers,
    )

    with rmesh.use(ctx):
        wanted = shard_slicers(local)
    with torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        try:
            _, values = deferred_reference(lambda: model(*args, **kwargs), wanted)
            after = torch.random.get_rng_state()
        except DeferredInitError as err:
            import warnings

            warnings.warn(
                f"annot: building the full {model.__name__} on each rank (deferred "
                f"initialization cannot replay it: {err})",
                stacklevel=3,
            )
            values = None
    if values is not None:
        materialize_(local, values, ctx.device)
        if seed is not None:
            torch.random.set_rng_state(after)
        return
    from annot.runtime.state_dict import load_full_state_dict

    with torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        full = model(*args, **kwargs).state_dict()
        after = torch.random.get_rng_state()
    if seed is not None:
        torch.random.set_rng_state(after)
    local.to_empty(device=ctx.device)
    if plan is not None:
        full = {k: v for k, v in full.items() if k in set(plan.local_keys)}
    with rmesh.use(ctx):
        load_full_state_dict(local, full, strict=plan is None)


def _record_calls(ref: nn.Module, sample: Any) -> Optional[list]:
    """The module calls of one meta forward of the reference on ``sample`` (for
    a transformers model without one, a tiny input made from its config), in
    order: which modules each replayed stage calls, and the planner's call
    order. None when there is no sample or the meta forward fails: modules
    then go by registration order."""
    from annot.hf import sample_inputs
    from annot.runtime.stages import record_calls

    probe = sample if sample is not None else sample_inputs(ref)
    if probe is None:
        return None
    try:
        return record_calls(ref, probe)
    except Exception as exc:  # noqa: BLE001 - the order is a refinement, not required
        log.debug("annot: the meta probe of %s failed (%s)", type(ref).__name__, exc)
        return None


def _module_boundaries(ref: nn.Module, n_stages: int, calls: Optional[list], report) -> list[str]:
    """annot.module_plan's balanced split of a model without ``@stage``:
    parameter counts over every block and block part, in call order."""
    from annot.module_plan import call_order, plan_module_boundaries

    order = call_order(calls) if calls is not None else None
    plan = plan_module_boundaries(ref, n_stages, order=order)
    log.debug("annot: planned stages\n%s", plan.table())
    if report is not None:
        report["plan_table"] = plan.table()
    return plan.boundaries


def _needs_replay(ref: nn.Module, cls: type, boundaries: tuple[str, ...]) -> bool:
    """Whether the stages are cut at run time (:mod:`annot.runtime.replay`): a
    boundary the stage-split rewriter cannot place in the root's ``forward``
    (inside a nested forward, a helper method, a container called whole).
    Boundaries that name no submodule are refused here, listing the options."""
    from annot.errors import RewriteError

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
        _resplit(cls, boundaries)
    except (RewriteError, OSError, TypeError):
        return True
    return False


def _resplit(cls: type, boundaries: tuple[str, ...]):
    """On a cache hit the rewritten source already has the stage methods; the
    plan (what each stage uses, what crosses) is the same as for the original
    source, which the tensor-parallel rewrite does not rename, so split that."""
    import inspect

    from annot.compiler import read_source
    from annot.rewriters.stage_split import split_stages

    path = inspect.getfile(cls)
    return split_stages(read_source(path), cls.__qualname__, list(boundaries), path=path)


def _choose_boundaries(
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
    report: Optional[dict] = None,
    calls=lambda: None,
) -> tuple[str, ...]:
    """Where stages begin: ``annot.boundary()`` markers, ``split=`` /
    ``@stage(split=[...])`` as given, a Hugging Face model's pp plan, else the
    planner's optimal balanced partition over every place forward can be cut
    (cost: measured time, FLOPs or parameters; under ``@stage(memory=...)``)."""
    import inspect

    from annot.compiler import read_source
    from annot.hints import StageSpec, get_stage_spec
    from annot.rewriters.stage_split import split_stages

    path = inspect.getfile(cls)
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
        return tuple(_module_boundaries(ref, n_stages, calls(), report))
    if spec is not None and spec.split:
        if len(spec.split) != n_stages - 1:
            raise HintError(
                f"@stage on {cls.__name__}: split={list(spec.split)!r} makes {len(spec.split) + 1} "
                f"stages but the mesh needs pp * chunks = {n_stages}; give {n_stages - 1} boundaries "
                "or use @stage(auto=True)"
            )
        return tuple(spec.split)
    from annot.errors import AnnotError
    from annot.planner import plan_stages

    auto = spec or StageSpec(auto=True)
    cost = auto.cost or ("flops" if sample is not None else "params")
    from annot.compiler import cache_dir

    # profiles are cached next to the rewritten sources
    kw = dict(
        cost=cost, memory=auto.memory, source_path=path, tp=tp, cache_dir=cache_dir() / "profiles"
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
    meta = None
    if sample is not None:
        meta = torch.utils._pytree.tree_map(
            lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample
        )
    plan = plan_stages(ref, cls, n_stages, sample=meta, **kw)  # ref is on meta: same on every rank
    log.debug("annot: planned stages\n%s", plan.table())
    if report is not None:
        report["plan_table"] = plan.table()
    return tuple(plan.boundaries)
