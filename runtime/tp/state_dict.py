"""Full (single-device) state dicts into and out of a tensor-parallel model.

A tp model built from rewritten source has the reference model's keys; only
the shapes of the sharded tensors differ. Which tensors are sharded, and how,
comes from the layers themselves (``annot_shard_layout()`` in
``annot.runtime.tp.layers``) and from ``shard_parameter``'s ``annot_shard_dim``:

    ref = GPT(config)                               # single device
    model = build_tp_model(config)                  # under annot.runtime.process_groups.use(ctx)
    load_full_state_dict(model, ref.state_dict())   # each rank takes its shard
    assert full_state_dict(model).keys() == ref.state_dict().keys()

Every rank must call these together (they all-gather over the tp group), in
the same order. Tied parameters (one tensor under two keys) load twice from
the same values and gather once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from annot.core.errors import CheckpointError, MeshError
from annot.runtime.ep.shards import expert_degree, gather_experts, own_experts
from annot.runtime.fsdp import copy_full_into, full
from annot.runtime.tp.comm import gather_full, split_local, tp_env

__all__ = [
    "load_full_state_dict",
    "full_state_dict",
    "full_grads",
    "full_shape",
    "gather_whole",
    "whole",
    "shard_layouts",
]

Layout = tuple[int, int, int]  # (dim, chunks, tp)


def shard_layouts(model: nn.Module) -> dict[int, Layout]:
    """``id(tensor) -> (dim, chunks, tp)`` for every sharded tensor of ``model``."""
    found: dict[int, tuple[Layout, str]] = {}

    def add(t: torch.Tensor, layout: Layout, where: str) -> None:
        seen = found.get(id(t))
        if seen is not None and seen[0] != layout:
            raise CheckpointError(
                f"one tensor is sharded two ways: {seen[1]} as (dim, chunks, tp)={seen[0]} "
                f"and {where} as {layout}; tied parameters must share one layout "
                f"(e.g. a Vocab() embedding tied to a Col() head, both split on dim 0)"
            )
        found[id(t)] = (layout, where)

    for mod_name, mod in model.named_modules():
        layout_fn = getattr(mod, "annot_shard_layout", None)
        if not callable(layout_fn):
            continue
        tp = getattr(mod, "tp", 1)
        for name, (dim, chunks) in layout_fn().items():
            t = getattr(mod, name)
            if t is not None:
                add(t, (dim, chunks, tp), f"{mod_name}.{name}" if mod_name else name)
    for name, p in model.named_parameters(remove_duplicate=False):
        dim = getattr(p, "annot_shard_dim", None)
        if dim is not None:
            add(p, (dim, getattr(p, "annot_shard_chunks", 1), getattr(p, "annot_tp", 1)), name)
    return {k: v[0] for k, v in found.items()}


def _env_for(tp: int, key: str):
    group, size, rank = tp_env()
    if size != tp:
        raise MeshError(
            f"{key} is sharded for tp={tp} but the current tp degree is {size}; call this "
            f"inside annot.runtime.process_groups.use(ctx) with the mesh the model was built for"
        )
    return group, rank


def full_shape(t: torch.Tensor, layout: Optional[Layout], ep: int = 1) -> tuple[int, ...]:
    """The single-device shape of ``t``, this rank's part: its tp ``layout``
    (None: not split over tp) and its experts' split (``ep``) undone."""
    shape = list(t.shape)
    if layout is not None:
        shape[layout[0] % t.dim()] *= layout[2]
    if ep > 1:
        shape[0] *= ep
    return tuple(shape)


def load_full_state_dict(
    model: nn.Module, full_sd: Mapping[str, torch.Tensor], strict: bool = True
) -> _IncompatibleKeys:
    """Copy a single-device state dict into ``model``: sharded tensors take this
    rank's slice, the rest are copied whole. Shapes are checked against the
    full shapes before anything is written.

    Returns ``(missing_keys, unexpected_keys)`` like ``Module.load_state_dict``;
    with ``strict=True`` any of either raises :class:`CheckpointError`.
    """
    local = model.state_dict(keep_vars=True)
    layouts = shard_layouts(model)
    missing = [k for k in local if k not in full_sd]
    unexpected = [k for k in full_sd if k not in local]
    if strict and (missing or unexpected):
        raise CheckpointError(
            "load_full_state_dict: keys do not match the model: "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}; "
            "pass strict=False to load the keys that do match"
        )
    plan = []
    errors = []
    for key, t in local.items():
        if key not in full_sd:
            continue
        src = full_sd[key]
        if t.is_meta:
            errors.append(
                f"{key} is on the meta device; call model.to_empty(device=...) before loading"
            )
            continue
        layout = layouts.get(id(t))
        ep = expert_degree(t)
        expected = full_shape(t, layout, ep)
        if tuple(src.shape) != expected:
            what = "" if layout is None else f" (local shard {tuple(t.shape)}, tp={layout[2]})"
            errors.append(
                f"{key}: the full state dict has shape {tuple(src.shape)}, the model "
                f"expects {expected}{what}"
            )
            continue
        src = own_experts(src, ep, key)
        if layout is not None:
            dim, chunks, tp = layout
            _, rank = _env_for(tp, key)
            src = split_local(src, dim, chunks, tp, rank)
        plan.append((t, src))
    if errors:
        raise CheckpointError("load_full_state_dict: " + "; ".join(errors))
    with torch.no_grad():
        for t, src in plan:
            copy_full_into(t, src)
    return _IncompatibleKeys(missing, unexpected)


def gather_whole(t: torch.Tensor, layout: Layout, key: str) -> torch.Tensor:
    """The full tensor ``key`` of which ``t`` is this rank's tp shard (and, a
    DTensor, its dp chunk): all-gathered over tp (and dp) on every rank of
    those groups, which call it together."""
    dim, chunks, tp = layout
    group, _ = _env_for(tp, key)
    return gather_full(full(t.detach()), dim, chunks, tp, group)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The single-device state dict of a tp model, on every rank: sharded
    tensors are all-gathered over tp, the rest returned as ``state_dict()``
    would (detached, sharing storage). Keys equal the reference model's."""
    layouts = shard_layouts(model)
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in gathered:
            gathered[id(t)] = whole(t, layouts.get(id(t)), expert_degree(t), key)
        out[key] = gathered[id(t)]
    return out


def whole(t: torch.Tensor, layout: Optional[Layout], ep: int, key: str) -> torch.Tensor:
    """The single-device tensor ``key`` of which ``t`` is this rank's part:
    all-gathered over tp by ``layout`` (None: whole over tp), then over its
    expert group (``ep``; :mod:`annot.runtime.ep.shards`), on every rank of
    those groups, which call it together."""
    x = full(t.detach()) if layout is None else gather_whole(t, layout, key)
    return gather_experts(x, ep, key)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full .grad}`` over ``model.named_parameters()`` (tied parameters
    once, under their first name), gathered over tp on every rank. Parameters
    without a gradient are left out."""
    layouts = shard_layouts(model)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        out[name] = whole(p.grad, layouts.get(id(p)), expert_degree(p), name)
    return out
