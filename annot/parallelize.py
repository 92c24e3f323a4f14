"""``annot.parallelize``: build this rank's part of a hinted model.

Steps (each logged at debug level):

1. join the mesh (torchrun's environment; gloo on CPU, NCCL on CUDA);
2. build the single-device reference from the same seed (its weights are the
   truth every shard is cut from);
3. collect hints (``@shard`` on classes, external ``hints=`` by module path)
   and verify them against the reference (names, types, divisibility);
4. rewrite the model's source just in time (cached on disk) and build the
   rewritten classes: each rank constructs only its tp shard;
5. load the reference weights into the shards; check every rank built the
   same weights.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn as nn

from annot.errors import HintError
from annot.hints import ShardSpec, get_shard_spec, resolve_external_hints
from annot.mesh import Mesh
from annot.parallel_model import ParallelModel

__all__ = ["parallelize"]

log = logging.getLogger("annot")


def _class_specs(ref: nn.Module, hints: Optional[dict]) -> dict[type, ShardSpec]:
    specs: dict[type, ShardSpec] = {}
    for m in ref.modules():
        s = get_shard_spec(type(m))
        if s is not None:
            specs[type(m)] = s
    if hints:
        for cls, ext in resolve_external_hints(ref, hints).items():
            base = specs.get(cls)
            if base is not None:  # external entries override the decorator's
                ext = ShardSpec({**base.specs, **ext.specs}, tuple(dict.fromkeys(base.local + ext.local)))
            specs[cls] = ext
    return specs


def _external_for_module(specs: dict[type, ShardSpec], module) -> dict[str, ShardSpec]:
    return {
        cls.__name__: s
        for cls, s in specs.items()
        if cls.__module__ == module.__name__ and get_shard_spec(cls) != s
    }


def _check_same_weights(ctx, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed as dist

    if not ctx.distributed:
        return
    fp = torch.zeros(2, dtype=torch.float64)
    for i, t in enumerate(state.values()):
        if t.is_floating_point():
            fp[0] += t.double().sum().item()
            fp[1] += (t.double().flatten()[:64] * (i + 1)).sum().item()
    fps = [torch.zeros_like(fp) for _ in range(ctx.world_size)]
    dist.all_gather(fps, fp.to(ctx.device) if ctx.device.type == "cuda" else fp)
    bad = [r for r, f in enumerate(fps) if not torch.equal(f.cpu(), fps[0].cpu())]
    if bad:
        raise HintError(
            f"ranks {bad} built different initial weights than rank 0: pass seed= to "
            "annot.parallelize (or seed every rank the same before building the model)"
        )


def parallelize(
    model: Any,
    *args: Any,
    mesh: Optional[Mesh] = None,
    hints: Optional[dict] = None,
    seed: Optional[int] = None,
    **kwargs: Any,
) -> ParallelModel:
    """Build this rank's part of ``model`` over ``mesh``.

    ``model`` is an ``nn.Module`` class (built as ``model(*args, **kwargs)``)
    whose classes carry ``@shard`` / ``@stage`` hints, or ``hints=`` give them
    from outside, keyed by module-path patterns::

        model = annot.parallelize(GPT, config, mesh=annot.Mesh(tp=2), seed=0)

    With ``seed`` the result equals ``torch.manual_seed(seed); GPT(config)``
    cut into shards. Returns a :class:`ParallelModel`.
    """
    from annot.compiler import compile_classes
    from annot.verify import verify_shard_hints
    from runtime import mesh as rmesh
    from runtime.state_dict import load_full_state_dict

    mesh = mesh or Mesh()
    if not isinstance(mesh, Mesh):
        raise HintError(f"parallelize: mesh={mesh!r}; expected annot.Mesh(dp=, pp=, tp=)")
    if not (isinstance(model, type) and issubclass(model, nn.Module)):
        raise HintError(
            f"parallelize: expected an nn.Module class (and its constructor arguments), got "
            f"{type(model).__name__}; e.g. annot.parallelize(GPT, config, mesh=mesh)"
        )
    ctx = rmesh.init(mesh)
    log.debug("annot: step 1: joined %r as rank %d", mesh, ctx.rank)

    with torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        ref = model(*args, **kwargs)
    full_state = ref.state_dict()
    _check_same_weights(ctx, full_state)
    log.debug("annot: step 2: built the reference %s", model.__name__)

    specs = _class_specs(ref, hints)
    verify_shard_hints(ref, specs, mesh.tp)
    log.debug("annot: step 3: verified hints on %s", sorted(c.__name__ for c in specs))

    def transform(source: str, path: str, module) -> str:
        from rewriters.tensor_parallel import rewrite_tensor_parallel

        return rewrite_tensor_parallel(
            source, mesh.tp, path=path, extra_hints=_external_for_module(specs, module)
        )

    key = f"tp={mesh.tp};hints={sorted((c.__qualname__, repr(s)) for c, s in specs.items())}"
    classes = list({type(m) for m in ref.modules()})
    mapping = compile_classes(classes, key=key, transform=transform)
    new_cls = mapping.get(model, model)
    with rmesh.use(ctx), torch.random.fork_rng():
        local = new_cls(*args, **kwargs)
    log.debug("annot: step 4: built %s for tp=%d", new_cls.__qualname__, mesh.tp)

    with rmesh.use(ctx):
        load_full_state_dict(local, full_state)
    local.to(ctx.device)
    del ref, full_state
    log.debug("annot: step 5: loaded reference weights into the shards")
    from annot.compiler import compile_classes as cc

    return ParallelModel(local, ctx, info={"compiled": list(cc.last), "specs": specs})
