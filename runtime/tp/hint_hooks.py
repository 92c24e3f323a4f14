"""Hints applied to a built module with forward hooks (:mod:`annot.runtime.tp.convert`
applies them; the rewriter's code calls :func:`partial_module` for a
constructor): ``Partial()`` (:func:`partial_module`: the inputs enter the tp
region, the output is summed over tp) and ``Heads()`` (:func:`slice_heads`:
the forward gets this rank's heads of an argument).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from annot.core.errors import HintError
from annot.core.specs import Heads
from annot.runtime.tp.checks import mesh_for

__all__ = ["partial_module", "slice_heads"]


class _PartialHooks:
    """Forward hooks of a ``Partial()`` module: floating tensor inputs that
    need a gradient enter the tp region, the output is all-reduced."""

    @staticmethod
    def enter(module, args, kwargs):
        from annot.runtime.tp.comm import copy_to_tp

        def enter(x):
            return copy_to_tp(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    @staticmethod
    def leave(module, args, kwargs, output):
        from torch.utils._pytree import tree_map

        from annot.runtime.tp.comm import reduce_from_tp

        def leave(y):
            return reduce_from_tp(y) if isinstance(y, torch.Tensor) and y.is_floating_point() else y

        return tree_map(leave, output)


def partial_module(module: nn.Module, *, tp: int = 1) -> nn.Module:
    """``Partial()`` applied to a built module: its output is summed over tp and
    its inputs' gradients too (see :class:`annot.core.specs.Partial`). Returns
    ``module`` itself, hooked once."""
    mesh_for("partial_module", tp)
    if tp > 1 and not getattr(module, "annot_partial", False):
        module.register_forward_pre_hook(_PartialHooks.enter, with_kwargs=True)
        module.register_forward_hook(_PartialHooks.leave, with_kwargs=True)
        # a plain flag, where nn.Module's __setattr__ puts one (typed for tensors and modules)
        module.__dict__["annot_partial"] = True
    return module


def slice_heads(module: nn.Module, name: str, spec: Heads, tp: int, where: str = "") -> None:
    """``Heads()`` on argument ``name`` of a built module: a forward pre-hook
    gives its forward this rank's heads of that argument (see
    :class:`annot.core.specs.Heads`). Hooked once per argument."""
    mesh_for("slice_heads", tp)
    done = module.__dict__.setdefault("annot_heads", set())
    if tp == 1 or name in done:
        return
    done.add(name)
    order = list(inspect.signature(module.forward).parameters)
    index = order.index(name) if name in order else None
    where = where or f"{type(module).__name__}.forward({name}=)"

    def own(x):
        from annot.runtime.tp.comm import scatter_to_tp

        if not isinstance(x, torch.Tensor):
            return x
        size = x.shape[spec.dim]
        if size == 1 and spec.heads is None:
            return x  # broadcast over the heads
        heads = spec.heads or size
        if size % heads or heads % tp:
            raise HintError(
                f"{where}: {spec!r} reads dim {spec.dim} (size {size}) as blocks of {heads} "
                f"heads split over tp={tp}; that does not divide. Give heads= the number of "
                "heads in that dim"
            )
        return scatter_to_tp(x, spec.dim, size // heads)

    def enter(mod, args, kwargs):
        if name in kwargs:
            kwargs[name] = own(kwargs[name])
        elif index is not None and index < len(args):
            args = (*args[:index], own(args[index]), *args[index + 1 :])
        return args, kwargs

    module.register_forward_pre_hook(enter, with_kwargs=True)
