"""Attention under context parallelism: each rank's queries against the whole
sequence's keys and values.

The keys and values of a layer are all-gathered over the cp group along the
sequence (backward: their gradients reduce-scattered back to the ranks whose
tokens made them), and the causal mask is built from the tokens' positions in
the whole sequence (:func:`annot.runtime.cp.sequence.positions`), so each query
attends to exactly the keys it attends to on one device, through the same
softmax: exact, no logsumexp merge needed. Memory: one layer's keys and values
for the whole sequence at a time (``O(S)``), the scores for this rank's
queries only (``S / cp`` rows). The gathered keys and values are not kept for
backward: :func:`attend` runs under activation recompute, so backward gathers
them again and each rank keeps only its own tokens' queries, keys and values
between forward and backward (what grows with the sequence stays ``1/cp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from annot.runtime.tp.comm import gather_along

__all__ = ["SequenceSplit", "attend", "causal_mask", "gather_keys"]


@dataclass(frozen=True)
class SequenceSplit:
    """One forward's split: this rank's positions, every rank's (in gathered
    order), the cp group and its size."""

    mine: torch.Tensor  # (S / cp,)
    gathered: torch.Tensor  # (S,): the positions of the all-gathered keys, in order
    group: object
    size: int


def gather_keys(x: torch.Tensor, split: SequenceSplit, dim: int = 2) -> torch.Tensor:
    """Every rank's keys (or values) along ``dim``, in gathered order."""
    return gather_along(x, dim, split.group, split.size)


def causal_mask(split: SequenceSplit) -> torch.Tensor:
    """``(1, 1, S / cp, S)``, True where this rank's query may attend to a key."""
    return (split.mine[:, None] >= split.gathered[None, :])[None, None]


def _attend(query, key, value, split: SequenceSplit, causal: bool, dropout: float, scale):
    key, value = gather_keys(key, split), gather_keys(value, split)
    return torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=causal_mask(split).to(query.device) if causal else None,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],  # grouped keys, not repeated per head
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    split: SequenceSplit,
    *,
    causal: bool = True,
    dropout: float = 0.0,
    scale=None,
) -> torch.Tensor:
    """SDPA of this rank's queries ``(B, H, S / cp, D)`` against every rank's
    keys and values (``(B, H_kv, S / cp, D)`` here, gathered), recomputed in
    backward rather than kept (the all-gather runs again there, on every rank
    of the group in the same order, as the forward's did)."""
    import torch.utils.checkpoint as cp

    if not torch.is_grad_enabled() or not (query.requires_grad or key.requires_grad):
        return _attend(query, key, value, split, causal, dropout, scale)
    return cp.checkpoint(
        _attend, query, key, value, split, causal, dropout, scale, use_reentrant=False
    )
