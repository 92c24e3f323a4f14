"""FLOPs of what FlopCounterMode lacks (annot.plan.flops)."""

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import annot.plan.flops  # noqa: F401  (registers the fused CPU attention's formulas)


def _flops(q, k, v, **kw) -> int:
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
    return counter.get_total_flops()


def test_grouped_query_attention_counts_the_query_heads():
    """Four query heads over two key/value heads cost what four full heads do
    (the kernel broadcasts k and v); torch 2.11's formula asserted instead."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, generator=g, requires_grad=True)
    full = _flops(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert full > 0
    assert _flops(q, k, v, enable_gqa=True) == full
