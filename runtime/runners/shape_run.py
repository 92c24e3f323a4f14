"""A model run on one sample for shapes alone: weights on the meta device,
inputs meta or real, value reads of meta tensors answered with zero / False
(:func:`shape_run`, :func:`meta_values`); for the probes of call order, the
pre-flight and the planner's measurements, and :func:`call_with`, how a
sample is passed to forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from annot.runtime.runners.meta_ops import has_meta, on_meta
from annot.runtime.runners.value_reads import DECISIONS

__all__ = ["Arguments", "call_with", "meta_values", "shape_run"]


def meta_values() -> TorchFunctionMode:
    """A mode in which a model on the meta device runs forward and backward
    as :func:`shape_run` runs forward (value reads of meta tensors answer
    zero / False), autograd on: for measuring what a step keeps and
    computes from shapes alone."""
    return _ShapeMode()


class _ShapeMode(TorchFunctionMode):
    """For :func:`shape_run`: ops with a meta operand run on meta; a value read
    of a meta tensor answers zero / False, and an op that meta cannot run
    (its output shape depends on the data, like ``nonzero``; its meta kernel
    refuses a dtype the real one takes) runs on zeros: the path taken is a
    guess there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if has_meta(args, kwargs):
            if func in DECISIONS:
                t = args[0]
                if func is torch.Tensor.tolist:
                    return torch.zeros(t.shape, dtype=t.dtype).tolist()
                return (
                    False
                    if func in (torch.Tensor.__bool__, torch.Tensor.__contains__, torch.equal)
                    else 0
                )
            meta = on_meta(func, args, kwargs)
            try:
                return func(*meta[0], **meta[1])
            except (NotImplementedError, RuntimeError) as exc:
                return _on_zeros(func, args, kwargs, exc)
        return func(*args, **kwargs)


_ZEROS_LIMIT = 1 << 28  # bytes of zeros one op of the probe may make


def _on_zeros(func, args: tuple, kwargs: dict, failed: Exception) -> Any:
    """``func`` run for real with zeros for its meta operands (up to
    :data:`_ZEROS_LIMIT` bytes, else it raises ``failed``, meta's error), its
    tensors moved to meta."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    if sum(t.numel() * t.element_size() for t in tensors if t.is_meta) > _ZEROS_LIMIT:
        raise failed
    real = tree_map(
        lambda t: (
            torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) and t.is_meta else t
        ),
        (args, kwargs),
    )
    out = func(*real[0], **real[1])
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, out)


@dataclass(frozen=True)
class Arguments:
    """The positional and keyword arguments of one call, as a sample (the
    model's first call, :func:`annot.plan.stage_points.verify_call_order`)."""

    args: tuple
    kwargs: dict


def call_with(fn, sample: Any) -> Any:
    """``fn`` called on one microbatch of forward's arguments: a dict (keyword
    arguments), a tuple (positional), :class:`Arguments` (both) or a single value."""
    if isinstance(sample, Arguments):
        return fn(*sample.args, **sample.kwargs)
    if isinstance(sample, dict):
        return fn(**sample)
    if isinstance(sample, tuple):
        return fn(*sample)
    return fn(sample)


def shape_run(fn, sample: Any) -> Any:
    """``fn`` on ``sample`` (see :func:`call_with`) for shapes and the order of
    module calls only, over a model whose weights are on the meta device while
    the inputs may be real (value reads of meta tensors answer zero / False),
    without autograd."""
    with torch.no_grad(), _ShapeMode():
        return call_with(fn, sample)
