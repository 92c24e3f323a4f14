"""What one microbatch shows of each unit of a model, counted on the meta
device: its FLOPs (forward + backward) and the bytes its forward keeps for
backward, split as tensor parallelism would split them, with the blocks
recomputed or not (:func:`measure_figures`, for :mod:`annot.plan.module_units`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

__all__ = [
    "UnitFigures",
    "at_tp",
    "first_grad_input",
    "measurable",
    "measure_figures",
    "on_meta",
    "output_scalar",
    "split_layers",
    "tp_sharded",
]


def first_grad_input(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return a
    return None


def output_scalar(out: Any) -> Optional[torch.Tensor]:
    """A scalar to run backward from: the sum of every floating output that
    requires grad (the loss of a step body is not part of the model)."""
    from annot.runtime.trees import tensors

    if hasattr(out, "to_tuple"):  # transformers' ModelOutput
        out = out.to_tuple()
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        out = [getattr(out, f.name) for f in dataclasses.fields(out)]
    parts = [t.float().sum() for t in tensors(out) if t.requires_grad and t.is_floating_point()]
    return torch.stack(parts).sum() if parts else None


@dataclass(frozen=True)
class UnitFigures:
    """What one microbatch's forward and backward show of a unit (on meta as on
    real weights): its FLOPs and the bytes it keeps for backward
    (:class:`annot.plan.saved_bytes.SavedBytes`), of which ``*_split`` tp
    divides; ``kept``: what it keeps with the blocks recomputed;
    ``recompute``: for a block's first unit, the whole block's saved bytes
    (what backward recomputes at once); ``backward``: the most bytes backward
    holds at once in what it makes while it is in this unit (gradients on
    their way, :class:`annot.plan.saved_bytes.BackwardPeak`)."""

    flops: int = 0
    saved: int = 0
    saved_split: int = 0
    kept: int = 0
    kept_split: int = 0
    recompute: int = 0
    recompute_split: int = 0
    backward: int = 0

    def transient(self, tp: int) -> int:
        """:attr:`backward` at ``tp``, split in the unit's own share."""
        if not self.saved:
            return self.backward
        return self.backward * at_tp(self.saved, self.saved_split, tp) // self.saved

    def activations(self, tp: int, recompute: bool) -> int:
        """Bytes kept per microbatch at ``tp``."""
        if recompute:
            return at_tp(self.kept, self.kept_split, tp)
        return at_tp(self.saved, self.saved_split, tp)

    def recomputed(self, tp: int) -> int:
        return at_tp(self.recompute, self.recompute_split, tp)

    def __add__(self, other: UnitFigures) -> UnitFigures:
        joined = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)
        }
        joined["backward"] = max(self.backward, other.backward)  # one unit at a time
        return UnitFigures(**joined)


def measurable(model: nn.Module) -> nn.Module:
    """What :func:`measure_figures` runs: FLOPs and saved bytes are counted on meta,
    so a model with real weights (an instance, ``from_pretrained``) is
    measured on a meta copy of itself; and a transformers model's own
    activation checkpointing (``gradient_checkpointing_enable()``), whose
    recompute in backward runs outside the modes that measure the forward, is
    switched off on a copy (the user's model keeps it): it is measured as
    without it."""
    from annot.runtime.init.deferred import meta_copy

    copy = model if on_meta(model) else meta_copy(model)
    if getattr(copy, "is_gradient_checkpointing", False):
        copy = meta_copy(model) if copy is model else copy
        new = hasattr(copy, "activation_checkpointing_disable")  # transformers 5's name
        disable: Any = getattr(copy, f"{'activation' if new else 'gradient'}_checkpointing_disable")
        disable()
    return copy


def on_meta(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.is_meta


def at_tp(total: int, split: int, tp: int) -> int:
    return total - split + -(-split // tp)


def split_layers(model: nn.Module) -> dict[nn.Module, str]:
    """The layers tensor parallelism splits, as ``"col"`` (output split) or
    ``"row"`` (output reduced whole): ``@shard`` hints, else a transformers
    tp plan's. A vocab-parallel embedding's output is whole, as a row's."""
    from annot.core.hints import get_shard_spec, resolve_hints
    from annot.core.specs import Col, Row, Vocab
    from annot.hf import hints_from_hf_config

    kinds = {Col: "col", Row: "row", Vocab: "row"}
    out: dict[nn.Module, str] = {}
    for m in model.modules():
        spec = get_shard_spec(type(m))
        for name, sp in spec.specs.items() if spec is not None else ():
            target = getattr(m, name, None)
            if isinstance(target, nn.Module) and type(sp) in kinds:
                out[target] = kinds[type(sp)]
    hints: dict[str, object] = dict(hints_from_hf_config(model))
    if hints:
        named = dict(model.named_modules())
        for path, sp in resolve_hints(model, hints)[1].items():
            if isinstance(named.get(path), nn.Module) and type(sp) in kinds:
                out[named[path]] = kinds[type(sp)]
    return out


def measure_figures(
    model: nn.Module,
    found: list,
    sample: Any,
    *,
    blocks: set[str],
    float_size: Optional[int] = None,
    recompute: bool = False,
) -> list[UnitFigures]:
    """Per unit, from one forward and backward on ``sample``: its FLOPs
    (forward + backward: ``FlopCounterMode``'s counts of the ops run while
    the run is in it, :class:`annot.plan.flops.SpanFlops`)
    and the bytes its forward saves for backward (each storage once, by
    identity, parameters left out; on a meta model as on a real one), split
    as tp would split them; with ``recompute`` also what a second forward,
    its ``blocks`` recomputed, keeps. ``float_size``: see :class:`SavedBytes`."""
    from torch.utils.flop_counter import FlopCounterMode

    from annot.plan.flops import SpanFlops
    from annot.plan.saved_bytes import BackwardPeak, SavedBytes, real_paths_on_meta
    from annot.runtime.recompute import (
        apply_recompute,
        remove_recompute,
    )
    from annot.runtime.runners.shape_run import call_with, meta_values

    modules = dict(model.named_modules(remove_duplicate=False))
    params = list(model.parameters())
    layers = split_layers(model)
    saved = SavedBytes(params, layers, float_size)
    saved.key = 0  # glue before the first unit's call is the first unit's
    active = [saved]
    peak = BackwardPeak(float_size)
    hooked: set[int] = set()
    counter = FlopCounterMode(display=False)
    spans = SpanFlops(counter, len(found))

    def passed(i: int) -> None:  # backward past unit i's start: it is in unit i - 1
        spans.back(i)
        peak.key = spans.key

    def enter(i: int, module, args, kwargs) -> None:
        active[0].key = i
        if active[0] is not saved:
            return
        spans.enter(i)
        t = first_grad_input(args, kwargs) if torch.is_grad_enabled() else None
        if t is not None and i not in hooked:
            hooked.add(i)
            t.register_hook(lambda g, i=i: passed(i))

    handles = [
        modules[u.path].register_forward_pre_hook(functools.partial(enter, i), with_kwargs=True)
        for i, u in enumerate(found)
    ]
    kept = None
    try:
        with counter, meta_values(), real_paths_on_meta():
            with saved.counting():
                out = call_with(model, sample)
            loss = output_scalar(out)
            if loss is not None:
                for p in params:  # gradients accumulate in place, as after a first step
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
                spans.charge()  # forward's end: backward begins in the unit called last
                peak.key = spans.key
                with peak:
                    loss.backward()
            spans.charge()
            spans.on = False
        del out, loss
        if recompute:
            apply_recompute(model, {type(modules[b]) for b in blocks})
            kept = active[0] = SavedBytes(params, layers, float_size)
            kept.key = 0
            try:
                with kept.counting(), meta_values(), real_paths_on_meta():
                    call_with(model, sample)  # forward only: what it keeps
            finally:
                remove_recompute(model)
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    flops = spans.flops
    recompute_bytes = [0] * len(found)
    recompute_split = [0] * len(found)
    if recompute:
        first = {u.path: i for i, u in enumerate(found)}
        for b in blocks:
            if b in first:
                inside = [
                    i for i, u in enumerate(found) if u.path == b or u.path.startswith(b + ".")
                ]
                recompute_bytes[first[b]] = sum(saved.of(i) for i in inside)
                recompute_split[first[b]] = sum(saved.split_bytes(i) for i in inside)
    return [
        UnitFigures(
            flops=flops[i],
            saved=saved.of(i),
            saved_split=saved.split_bytes(i),
            kept=kept.of(i) if kept is not None else 0,
            kept_split=kept.split_bytes(i) if kept is not None else 0,
            recompute=recompute_bytes[i],
            recompute_split=recompute_split[i],
            backward=peak.of(i),
        )
        for i in range(len(found))
    ]


def tp_sharded(model: nn.Module, tp: int) -> set[int]:
    """The parameters tp splits: ``@shard`` hints, else a transformers tp plan's."""
    from annot.core.hints import resolve_hints
    from annot.hf import hints_from_hf_config
    from annot.plan.costs import sharded_ids

    hints: dict[str, object] = dict(hints_from_hf_config(model, tp=tp)) if tp > 1 else {}
    return sharded_ids(model, resolve_hints(model, hints)[1] if hints else None)
