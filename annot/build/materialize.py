"""Give a rank's model, built on the meta device, its values: its part of the
single-device reference's weights, cut tensor by tensor (deferred
initialization, :mod:`annot.runtime.init.deferred`), or cut out of a model the
user built already. Step 5 of :func:`annot.parallelize`."""

from __future__ import annotations

import torch
import torch.nn as nn

from annot.core.errors import HintError
from annot.runtime.init.deferred import meta_copy

__all__ = ["adopt", "check_same_rng", "materialize", "materialize_from", "take_rewritten_classes"]


def check_same_rng(ctx, rng_state: torch.Tensor) -> None:
    """Without ``seed=`` every rank must start from the same RNG state, or the
    ranks would cut their shards from different initial weights."""
    bad = ctx.ranks_differing(rng_state.tolist())
    if bad:
        raise HintError(
            f"ranks {bad} would build different initial weights than rank 0 (their random "
            "state differs): pass seed= to annot.parallelize (or seed every rank the same "
            "before building the model)"
        )


def adopt(instance: nn.Module, mapping: dict) -> nn.Module:
    """A built model as if its rewritten classes had built it: a copy on the
    meta device whose modules take their rewritten classes (forward reads the
    per-rank sizes). Its hinted layers are converted afterwards, as every
    layer construction did not shard is (``convert_hinted``)."""
    return take_rewritten_classes(meta_copy(instance), mapping)


def take_rewritten_classes(model: nn.Module, mapping: dict) -> nn.Module:
    """Give every module of ``model`` still of an original class its
    rewritten class (``mapping``): a built model's modules, and those a
    rewritten class built through a factory function or a registry the
    rewrite left alone (``make_block(cfg)`` builds the original class).
    Their forward then reads the per-rank sizes; their hinted layers are
    converted afterwards (``convert_hinted``). Returns ``model``."""
    for mod in model.modules():
        if type(mod) in mapping:
            mod.__class__ = mapping[type(mod)]
    return model


def materialize_from(local: nn.Module, instance: nn.Module, ctx) -> None:
    """Cut this rank's shards out of a built model's own weights."""
    from annot.runtime import process_groups
    from annot.runtime.init.deferred import materialize_, named_tensors, shard_slicers

    with process_groups.use(ctx):
        wanted = shard_slicers(local)
    have = named_tensors(local)
    values = {}
    for name, t in named_tensors(instance).items():
        cut = wanted(name) if name in have else None
        if cut is not None:
            values[name] = cut(t.detach())
    materialize_(local, values, ctx.device)


def materialize(local, model, args, kwargs, seed, ctx, layout) -> None:
    """Give ``local`` (built on meta) this rank's part of the reference weights:
    the values of ``torch.manual_seed(seed); model(*args)``, computed tensor by
    tensor without ever holding the full model (annot.runtime.init.deferred). A model
    whose construction deferred init cannot replay is built in full instead,
    with a warning saying why. With ``seed`` the random state afterwards is
    the reference's after its construction, the same on every rank, so random
    ops in replicated regions (dropout) draw what the single-device run draws."""
    from annot.runtime import process_groups
    from annot.runtime.init.deferred import (
        DeferredInitError,
        deferred_reference,
        materialize_,
        shard_slicers,
    )

    with process_groups.use(ctx):
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
    from annot.runtime.tp.state_dict import load_full_state_dict

    with torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        full = model(*args, **kwargs).state_dict()
        after = torch.random.get_rng_state()
    if seed is not None:
        torch.random.set_rng_state(after)
    local.to_empty(device=ctx.device)
    if layout is not None:
        full = {k: v for k, v in full.items() if k in set(layout.local_keys)}
    with process_groups.use(ctx):
        load_full_state_dict(local, full, strict=layout is None)
