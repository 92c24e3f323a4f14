"""A user's hooks on a layer tp splits see what they saw on one device.

A forward hook on an ``nn.Linear`` (a library's, PEFT's, a logit scaler) was
written for the whole layer. Under tp a column-parallel layer returns this
rank's slice of the output features and a row-parallel layer takes this
rank's slice of the input features, so the hook would see a shard: right for
an elementwise hook, silently wrong for any other. Each such hook is wrapped
once (:func:`view_hooks`) in a :class:`WholeView`: it is given the whole
tensor (all-gathered over tp, differentiably: the backward keeps this rank's
slice of the gradient) and this rank keeps its slice of what it returns
(the backward all-gathers). That is exact for any hook, at one all-gather
per hooked call.

A hook the tp layer cannot give whole tensors is refused with
:class:`~annot.core.errors.IntegrationError`, naming the module: a full
backward hook on a split layer (its gradients are shards), and a hook on a
layer whose sequence is split (``sequence_parallel=True``). annot's own hooks
(any defined in annot) are left as they are.

:func:`carry_hooks` moves a layer's hooks onto the tp layer that replaces it
(:func:`annot.runtime.tp.convert.to_parallel`), the same dictionaries, so a
handle the user holds still removes them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from annot.core.errors import IntegrationError
from annot.runtime.tp import embedding as E
from annot.runtime.tp import layers as L
from annot.runtime.tp.comm import GatherFromTP, ScatterToTP, tp_env

__all__ = ["WholeView", "carry_hooks", "is_annots", "lost_hooks", "split_layers", "view_hooks"]

# every hook dictionary of an nn.Module (the flags are keyed by hook id)
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)

COLUMN = (L.ColumnParallelLinear, L.ColumnParallelConv1D, E.ColumnParallelEmbedding)
ROW = (L.RowParallelLinear, L.RowParallelConv1D)


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (the tp layer built from ``old``) ``old``'s hooks."""
    for name in HOOK_DICTS:
        hooks = getattr(old, name, None)
        if hooks:
            setattr(new, name, hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


def split_side(module: nn.Module) -> Optional[str]:
    """``"output"`` for a layer that returns a shard of its output features,
    ``"input"`` for one that takes a shard of its input features, else None."""
    if isinstance(module, COLUMN) and not getattr(module, "gather", False):
        return "output"
    if isinstance(module, ROW) and not module.split_input:
        return "input"
    return None


def split_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(path, layer, side)`` of each layer of ``model`` that tp splits (see
    :func:`split_side`): found once, as the layers stay."""
    found = [(path, m, split_side(m)) for path, m in model.named_modules()]
    return [(path, m, side) for path, m, side in found if side is not None]


def view_hooks(layers: list[tuple[str, nn.Module, str]]) -> None:
    """Wrap each user hook on the tp-split ``layers`` (:func:`split_layers`)
    that sees a shard in a :class:`WholeView` (once); refuse those that
    cannot be."""
    for path, module, side in layers:
        if module._backward_hooks or module._backward_pre_hooks:
            raise IntegrationError(
                f"a backward hook on {path!r}, a {type(module).__name__} split over tp: its "
                "gradients are this rank's shards, not the layer's. Register it on the "
                "module around the layer (whose gradients are whole), or leave this layer "
                "unsplit"
            )
        hooks = module._forward_hooks if side == "output" else module._forward_pre_hooks
        kwargs = (
            module._forward_hooks_with_kwargs
            if side == "output"
            else module._forward_pre_hooks_with_kwargs
        )
        for hid, hook in list(hooks.items()):
            if isinstance(hook, WholeView) or is_annots(hook):
                continue
            hooks[hid] = WholeView(hook, side, path, with_kwargs=hid in kwargs)


class WholeView:
    """A forward hook (``side="output"``) or pre-hook (``side="input"``) of a
    tp-split layer, run on the whole tensor (see the module docstring)."""

    def __init__(self, hook: Any, side: str, path: str, *, with_kwargs: bool):
        self.hook = hook
        self.side = side
        self.path = path
        self.with_kwargs = with_kwargs

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        group, size, rank = tp_env()
        if size == 1:
            return self.hook(module, *args)
        if getattr(module, "sequence_dim", None) is not None:
            raise IntegrationError(
                f"a forward hook on {self.path!r}, a {type(module).__name__} whose sequence is "
                "split (sequence_parallel=True): annot gives hooks the layer's whole tensors "
                "over tp only. Build without sequence_parallel, or register the hook on the "
                "module around the layer"
            )
        chunks = getattr(module, "chunks", 1) if self.side == "output" else 1

        def whole(t: torch.Tensor) -> torch.Tensor:
            return GatherFromTP.apply(t, group, size, rank, -1, chunks)

        def mine(t: torch.Tensor) -> torch.Tensor:
            return ScatterToTP.apply(t, group, size, rank, -1, chunks)

        if self.side == "output":  # (args, [kwargs,] output)
            out = tree_map_only(torch.Tensor, whole, args[-1])
            result = self.hook(module, *args[:-1], out)
            return tree_map_only(torch.Tensor, mine, out if result is None else result)
        inputs = tree_map_only(torch.Tensor, whole, args[0])  # (args, [kwargs])
        result = self.hook(module, inputs, *args[1:])
        if result is None:
            result = (inputs, *args[1:]) if self.with_kwargs else inputs
        if self.with_kwargs:
            new_args, new_kwargs = result
            return tree_map_only(torch.Tensor, mine, new_args), new_kwargs
        return tree_map_only(torch.Tensor, mine, result)


def lost_hooks(ref: nn.Module, built: nn.Module) -> list[str]:
    """The module paths where ``ref`` (built from the user's classes) has
    more user hooks (forward, pre-forward, backward) than ``built`` (annot's
    rewritten classes, built from the same arguments): a constructor that
    registers hooks by ``isinstance(m, TheirClass)`` in code outside the
    class skips annot's rewritten copy of that class. transformers' own
    hooks (its output capture, which annot carries across the stages) are
    not counted."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    mine = dict(built.named_modules(remove_duplicate=False))

    def users(hook: Any) -> bool:
        module = getattr(getattr(hook, "__func__", hook), "__module__", None) or ""
        return not is_annots(hook) and not module.startswith("transformers.")

    def count(m: nn.Module) -> int:
        return sum(users(h) for k in kinds for h in getattr(m, k).values())

    return [
        path
        for path, m in ref.named_modules(remove_duplicate=False)
        if path in mine and count(m) > count(mine[path])
    ]


def is_annots(hook: Any) -> bool:
    """Whether ``hook`` is annot's own (defined in annot), not a user's (a
    :class:`WholeView` is the user's hook it wraps)."""
    if isinstance(hook, WholeView):
        return False
    module = getattr(getattr(hook, "__func__", hook), "__module__", None) or ""
    return module == "annot" or module.startswith("annot.")
