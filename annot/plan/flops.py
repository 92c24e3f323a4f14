"""FLOPs per unit of a model, by where forward and backward are when each op
runs (:class:`SpanFlops`), and the formulas ``FlopCounterMode`` lacks.

``FlopCounterMode``'s own per-module counts follow a module's backward only
when its positional arguments carry the gradient: a module called with
keyword arguments (transformers' ``self_attn(hidden_states=...)``) is never
left in backward, so every later op of backward is also counted as its own
(layer k's attention counted 2k + 1 times). :class:`SpanFlops` charges each
op's FLOPs to the unit the run is in instead: in forward, the unit whose call
came last; in backward, the unit whose input gradient has not been made yet.

CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu``, which
real CPU runs and annot's meta runs use) has no formula in torch's table;
registering this module gives it the formula of the other fused kernels.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

__all__ = ["SpanFlops"]

_aten = torch.ops.aten
_FLASH_CPU = _aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward

if _FLASH_CPU.default not in flop_registry and _FLASH_CPU not in flop_registry:

    @register_flop_formula(_FLASH_CPU)
    def _flash_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        k, v = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
        return sdpa_flop_count(query_shape, k, v)

    @register_flop_formula(_FLASH_CPU_BACKWARD)
    def _flash_cpu_backward_flop(
        grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
    ):
        k, v = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
        return sdpa_backward_flop_count(grad_out_shape, query_shape, k, v)


def _query_heads(query_shape, shape):
    """Grouped-query attention's key or value shape with the query's head
    count, as the kernel broadcasts it (torch before 2.12 counts only equal
    heads, and asserts otherwise; later versions broadcast the same way)."""
    if len(shape) == 4 and len(query_shape) == 4 and shape[1] != query_shape[1]:
        return (shape[0], query_shape[1], *shape[2:])
    return shape


class SpanFlops:
    """Each op's FLOPs charged to the key current when it ran: call
    :meth:`enter` when a unit's forward call begins, :meth:`back` when
    backward has made the gradient of a unit's input (backward then is in
    the unit whose call came before that one's, in forward's order of
    calls, which need not be the units' order)."""

    def __init__(self, counter: FlopCounterMode, n: int):
        self.counter = counter
        self.flops = [0] * n
        self.key = 0
        self.last = 0
        self.on = True
        self.when: dict[int, int] = {}  # key -> its first call's place in forward
        self.before: dict[int, int] = {}  # key -> the key current when it was called

    def charge(self) -> None:
        if not self.on:
            return
        now = self.counter.get_total_flops()
        self.flops[self.key] += now - self.last
        self.last = now

    def enter(self, key: int) -> None:
        self.charge()
        if key not in self.when:
            self.when[key] = len(self.when)
            self.before[key] = self.key
        self.key = key

    def back(self, key: int) -> None:
        """Backward has passed unit ``key``'s start."""
        self.charge()
        prev = self.before.get(key, self.key)
        if self.when.get(prev, -1) < self.when.get(self.key, -1):
            self.key = prev
