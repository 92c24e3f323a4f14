"""Attention under context parallelism: each rank's queries against the whole
sequence's keys and values.

The keys and values of a layer are all-gathered over the cp group along the
sequence (backward: their gradients reduce-scattered back to the ranks whose
tokens made them), and the causal mask is built from the tokens' positions in
the whole sequence (:func:`annot.runtime.cp.sequence.positions`), so each query
attends to exactly the keys it attends to on one device, through the same
softmax: exact, no logsumexp merge needed. Memory: one layer's keys and values
for the whole sequence at a time (``O(S)``), the scores for this rank's
queries only (``S / cp`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from annot.runtime.tp.comm import gather_along

__all__ = ["SequenceSplit", "gather_keys", "causal_mask"]


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
