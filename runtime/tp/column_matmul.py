"""A column-parallel layer's matmul whose weight gradient overlaps its input's
reduction: Megatron's backward overlap, on the model's own layers.

A column-parallel layer's input gradient is partial on each tp rank and is
all-reduced (reduce-scattered, with sequence parallelism) by the entry the
layer reads its input through (``CopyToTP``, ``GatherSequence`` in
:mod:`annot.runtime.tp.comm`). Autograd computes a linear layer's input and
weight gradients in one node, and the entry reduces only after every layer
reading it (q, k and v; gate and up) has run: the weight GEMMs before the
collective, the collective alone on the critical path. Megatron
(``LinearWithGradAccumulationAndAsyncCommunication``) starts the all-reduce
first and computes the weight gradient while it runs.

:class:`ColumnMatmul`'s backward computes the input gradient first and hands
it to the entry's :class:`~annot.runtime.tp.comm.InputGradReduction`; in the
last layer to run, that starts the collective on the sum, and the weight
gradient is computed while it is in flight. The weight gradients still go
back through autograd from the layer's own node, so hooks, ``torch.autograd.grad``
and the zero-bubble split passes see an ordinary linear layer. Layers that
share an entry keep one reduction between them; the weight GEMMs of the
layers before the last stay ahead of it, as before (Megatron fuses q, k and
v into one layer for this; annot leaves the model's layers as they are).

Under autocast the matmul runs in the autocast dtype as ``F.linear``'s does
(input, weight and bias cast; each gradient cast back to its tensor's dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from annot.runtime.tp.comm import InputGradReduction

__all__ = ["column_matmul", "hf_conv1d", "matmul"]


def column_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``transposed``: HF ``Conv1D``'s
    ``x @ weight + bias``, weight ``(in, out)``); when ``x`` comes straight
    from a column entry and autograd records, its input gradient is handed
    to the entry's reduction and the weight gradient overlaps it."""
    reduction = getattr(x.grad_fn, "reduction", None)
    if not isinstance(reduction, InputGradReduction) or not torch.is_grad_enabled():
        return matmul(x, weight, bias, transposed)
    reduction.read()
    return ColumnMatmul.apply(x, weight, bias, transposed)


def matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool
) -> torch.Tensor:
    """``F.linear`` (``transposed``: :func:`hf_conv1d`)."""
    return hf_conv1d(x, weight, bias) if transposed else F.linear(x, weight, bias)


def hf_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``transformers.pytorch_utils.Conv1D.forward``: ``x @ weight (+ bias)``,
    weight ``(in, out)``, over the last dim of ``x``."""
    size_out = x.size()[:-1] + (weight.size(1),)
    x2 = x.reshape(-1, x.size(-1))
    y = torch.mm(x2, weight) if bias is None else torch.addmm(bias, x2, weight)
    return y.view(size_out)


def _autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes ``F.linear`` in on ``x``'s device, or None."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` as autocast would hand it to ``F.linear``: floating point other
    than float64 in ``dtype``, anything else as it is."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def _will_run(node) -> bool:
    """Whether the running backward executes ``node``; True for a leaf's
    accumulator that ``torch.autograd.grad`` captures (its gradient is
    wanted all the same)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as err:
        if "autograd.grad" not in str(err):
            raise
        return True  # autograd.grad(..., inputs=[leaf]) asks for it


class ColumnMatmul(torch.autograd.Function):
    """``matmul(x, weight, bias, transposed)`` whose backward hands its input
    gradient to the reduction of ``x``'s entry (``x.grad_fn``), then computes
    the weight and bias gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed):
        dtype = _autocast_dtype(x)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if dtype is None:
            y = matmul(x, weight, bias, transposed)
        else:
            x, weight, bias = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
            with torch.autocast(x.device.type, enabled=False):
                y = matmul(x, weight, bias, transposed)
        ctx.save_for_backward(x, weight)
        ctx.transposed = transposed
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad = grad.to(x.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        entry = ctx.next_functions[0][0]
        if ctx.needs_input_grad[0] and _will_run(entry):
            grad_x = (grad @ (weight.t() if ctx.transposed else weight)).to(x_dtype)
            if not torch.is_grad_enabled():  # (a double backward needs it in the graph)
                entry.reduction.arrive(grad_x)  # the last reader starts the collective
                grad_x = None
        # Computed while the collective runs, where this layer started it.
        if ctx.needs_input_grad[1] and _will_run(ctx.next_functions[1][0]):
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = (x2.t().mm(g2) if ctx.transposed else g2.t().mm(x2)).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2] and _will_run(ctx.next_functions[2][0]):
            grad_b = g2.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None
