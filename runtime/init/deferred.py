"""Deferred initialization: this rank's slice of a model's initial weights,
without ever holding the whole model.

``deferred_reference(build, wanted)`` returns what ``torch.manual_seed(s);
build()`` makes eagerly (bit for bit, with the global CPU generator left in
the same state), but keeps only ``wanted(name)(full_tensor)`` of each
parameter, buffer and tensor attribute::

    torch.manual_seed(0)
    ref, values = deferred_reference(lambda: GPT(cfg), wanted)
    # ref: the model on the meta device (names, shapes, ties; no memory)
    # values: {"h.0.mlp.c_fc.weight": this rank's slice, ...}

How. ``build()`` runs once under a ``TorchDispatchMode`` that makes every new
tensor a meta tensor and *records* each op that gives a storage values: its
function, its arguments (tensors as ``(storage, version, view)``), which
storages it writes or creates. Storages are thus versioned histories.

1. Random ops (any op with a ``generator`` argument) are also executed for
   real, on CPU tensors of the full shape, when they happen: the global
   generator advances exactly as in an eager build, and its state before the
   op is recorded. The result is dropped.
2. When ``__init__`` asks for a value (``bool(mask.any())`` in
   ``trunc_normal_``'s rejection loop, ``.item()``, a data-dependent shape),
   that value is computed by replaying its history (below) and returned.
3. When ``build()`` returns, names are known. For each storage some wanted
   name lives in, its last version is replayed: each recorded op is run for
   real, random ones under their recorded generator state; the wanted slices
   are cut and the full values dropped before the next storage.

Replay follows only what a version depends on: an op that overwrites a
whole storage without reading it (``normal_``, ``uniform_``, ``fill_``,
``zero_``, ``copy_``) cuts its history, so ``nn.Linear``'s ``kaiming_uniform_``
followed by GPT's ``normal_`` replays just the ``normal_``. Ops that read a
parameter's previous values (``p.data.mul_(2)``, ``weight[pad].fill_(0)``,
``trunc_normal_``'s steps, ``orthogonal_``'s QR) replay the chain they need.

Memory. At rest: the wanted slices and the op record (a 5 KiB generator
state per random op; small tensors from outside ``build()`` are copied into
the record, large ones referenced). Transiently: the full tensors one replay
needs (for a plain weight: that one full weight, plus its slice). Time: each
random op runs once while building and once more if this rank wants it.

``t.is_meta`` reads False for tensors being built (``nn.init.orthogonal_``
and ``trunc_normal_`` skip meta tensors). Tensors made from Python data
(``torch.tensor([...])``, ``torch.from_numpy``) are real and kept whole.
Refused with :class:`DeferredInitError` naming the line in ``__init__``:
``set_`` / ``resize_`` (lazy modules), a meta tensor made outside ``build()``,
writing values computed inside ``build()`` into a tensor made outside it.

The recorder (the dispatch mode and the replay of its op record) is
:mod:`annot.runtime.init.recorder`, the record itself
:mod:`annot.runtime.init.ops`; this module holds the entry points
(:func:`deferred_reference`, :func:`shard_slicers`, :func:`materialize_`,
:func:`meta_copy`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from annot.runtime.init.ops import Geometry, geometry
from annot.runtime.init.recorder import DeferredInitError, HideMeta, Recorder

__all__ = [
    "DeferredInitError",
    "deferred_reference",
    "materialize_",
    "meta_copy",
    "shard_slicers",
]

Slicer = Callable[[torch.Tensor], torch.Tensor]
Wanted = Callable[[str], Optional[Slicer]]


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device
    (structure, no memory; tied tensors stay tied; other attributes copied)."""
    import copy

    memo: dict = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes, tied ones under every name."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        if b is not None:
            out[name] = b
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, v in vars(mod).items():
            if isinstance(v, torch.Tensor):
                out[f"{mod_name}.{attr}" if mod_name else attr] = v
    return out


def _cut(view: torch.Tensor, slicer: Slicer, flat: torch.Tensor, name: str) -> torch.Tensor:
    """``slicer(view)`` as a tensor that does not keep ``flat`` alive (unless it is all of it)."""
    local = slicer(view)
    if not isinstance(local, torch.Tensor):
        raise DeferredInitError(
            f"deferred init: wanted({name!r}) returned a slicer that gave "
            f"{type(local).__name__}, expected a tensor (e.g. lambda t: t.narrow(0, 0, n))"
        )
    if local.untyped_storage()._cdata == flat.untyped_storage()._cdata and not (
        local.numel() == flat.numel() and local.is_contiguous()
    ):
        local = local.clone(memory_format=torch.contiguous_format)
    return local.detach()


def deferred_reference(
    build: Callable[[], nn.Module], wanted: Wanted
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Build ``build()``'s values slice by slice, never the whole model.

    ``wanted(name)`` is asked once per parameter, buffer and tensor attribute
    name (tied tensors under each of their names): ``None`` if this rank does
    not hold it, else a function from the full tensor to this rank's part
    (``lambda t: t`` for all of it). Returns the module built on the meta
    device (structure, names, ties) and ``{name: part}`` for every wanted name.

    The parts equal what ``build()`` makes eagerly from the same generator
    state, which this call advances exactly as the eager build does::

        torch.manual_seed(0)
        ref, values = deferred_reference(lambda: GPT(cfg), lambda name: lambda t: t)
    """
    recorder = Recorder()
    try:
        with HideMeta(recorder), recorder:
            module = build()
    except DeferredInitError:
        raise
    except Exception as exc:  # e.g. ConvNext's __init__ reads .tolist() of a tensor it made
        raise DeferredInitError(
            f"its constructor fails on the meta device ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(module, nn.Module):
        raise DeferredInitError(
            f"deferred init: build() returned {type(module).__name__}, expected an nn.Module"
        )
    by_sid: dict[int, list[tuple[str, Slicer, Geometry]]] = {}
    values: dict[str, torch.Tensor] = {}
    for name, t in named_tensors(module).items():
        rec = recorder.record(t)
        if t.is_meta and rec is None:
            raise DeferredInitError(
                f"deferred init: {name} is a meta tensor that was not made inside build(); "
                "pass real tensors to the model's constructor"
            )
        slicer = wanted(name)
        if slicer is None:
            continue
        if rec is None:  # a real tensor (torch.tensor([...]), from numpy, passed in)
            values[name] = _cut(t.detach(), slicer, t, name).clone()
        else:
            by_sid.setdefault(rec.sid, []).append((name, slicer, geometry(t)))
    for sid, wants in by_sid.items():
        rec = recorder.by_sid[sid]
        flat = recorder.value(sid, len(rec.versions) - 1, {})
        done: dict = {}
        for name, slicer, geom in wants:  # tied names with one slicer share one tensor
            key = (geom, id(slicer))
            if key not in done:
                done[key] = _cut(flat.as_strided(*geom), slicer, flat, name)
            values[name] = done[key]
        del flat, done
    return module, values


# --------------------------------------------------------------------------- #
# Wiring into a tensor-parallel model
# --------------------------------------------------------------------------- #


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def shard_slicers(local: nn.Module) -> Wanted:
    """``wanted`` for :func:`deferred_reference` from this rank's model: names
    it does not hold give ``None``; sharded tensors (``annot_shard_layout()``,
    ``shard_parameter``) give this rank's ``split_local`` slice, experts split
    over ep (:mod:`annot.runtime.ep.experts`) this rank's experts first; the rest whole.

    ``local`` may be on the meta device (built under ``torch.device("meta")``
    and pruned to this rank's stages). Call inside ``annot.runtime.process_groups.use(ctx)``.
    """
    from annot.core.errors import MeshError
    from annot.runtime.ep.shards import expert_degree, expert_env, own_experts
    from annot.runtime.tp.comm import split_local, tp_env
    from annot.runtime.tp.state_dict import shard_layouts

    layouts = shard_layouts(local)
    _, size, rank = tp_env()
    _, ep_size, ep_rank = expert_env()
    table: dict[str, Slicer] = {}
    for name, t in named_tensors(local).items():
        layout = layouts.get(id(t))
        ep = expert_degree(t)
        if layout is None and ep == 1:
            table[name] = _identity
            continue
        if ep != 1 and ep != ep_size:
            raise MeshError(
                f"{name} is split over ep={ep} but the current ep degree is {ep_size}; call "
                "shard_slicers inside annot.runtime.process_groups.use(ctx)"
            )
        experts = functools.partial(own_experts, ep=ep, what=name, rank=ep_rank)
        if layout is None:
            table[name] = experts
            continue
        dim, chunks, tp = layout
        if tp != size:
            raise MeshError(
                f"{name} is sharded for tp={tp} but the current tp degree is {size}; call "
                "shard_slicers inside annot.runtime.process_groups.use(ctx) with the mesh the model was built for"
            )
        tp_cut = functools.partial(split_local, dim=dim, chunks=chunks, size=tp, rank=rank)
        table[name] = tp_cut if ep == 1 else _then(experts, tp_cut)
    return table.get


def _then(first: Slicer, second: Slicer) -> Slicer:
    return lambda x: second(first(x))


def _fill(model: nn.Module, t: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``t`` the storage of ``value``, keeping the object (ties, subclass, attributes)."""
    cls, attrs = type(t), dict(t.__dict__)
    new = (
        nn.Parameter(value, requires_grad=t.requires_grad)
        if isinstance(t, nn.Parameter)
        else value.detach()  # a new object: the caller's dict keeps its tensors
    )
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError:  # something holds a view of t: replace it wherever the model has it
        if cls is not type(new):
            new.__class__ = cls
        new.__dict__.update(attrs)
        for mod in model.modules():
            tables: tuple[dict[str, Any], ...] = (mod._parameters, mod._buffers, mod.__dict__)
            for table in tables:
                for k, v in list(table.items()):
                    if v is t:
                        table[k] = new
        return
    if type(t) is not cls:
        t.__class__ = cls
    t.__dict__.update(attrs)


def materialize_(
    model: nn.Module, values: dict[str, torch.Tensor], device: Optional[torch.device] = None
) -> nn.Module:
    """Give a (meta) model real storage on ``device`` holding ``values``, by
    name. Parameter objects are kept, so ties (one parameter under two names),
    parameter subclasses and their attributes survive (``Module.to_empty``
    keeps none of them). Every parameter, buffer and tensor attribute must
    have a value of its shape, else :class:`DeferredInitError` lists them.
    ``values`` are used in place when already on ``device`` with the dtype."""
    device = torch.device(device or "cpu")
    tensors = named_tensors(model)
    missing = [n for n in tensors if n not in values]
    wrong = [
        f"{n}: value {tuple(values[n].shape)}, model {tuple(t.shape)}"
        for n, t in tensors.items()
        if n in values and values[n].shape != t.shape
    ]
    if missing or wrong:
        raise DeferredInitError(
            f"materialize_: missing values for {missing or 'none'}; wrong shapes: "
            f"{wrong or 'none'}; build values with deferred_reference(build, "
            "shard_slicers(model)) for this same model"
        )
    done: set[int] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            if id(t) not in done:  # tied: once
                done.add(id(t))
                _fill(model, t, values[name].to(device=device, dtype=t.dtype).contiguous())
    return model
