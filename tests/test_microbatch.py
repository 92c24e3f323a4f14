"""Splitting a step's arguments into microbatches (annot.microbatch)."""

import torch

from annot.microbatch import split_microbatches


def _step(x, w=None):
    return x


def test_an_in_place_change_of_one_microbatch_leaves_the_others_backward():
    """1F1B runs microbatch 1's forward before microbatch 0's backward; a
    forward that changes its input in place must not invalidate what
    microbatch 0 saved (chunks of one tensor shared a version counter)."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4)
    before = x.clone()
    (first, _), (second, _) = split_microbatches(_step, (x,), {}, 2)
    out = first[0] @ w  # saves microbatch 0's input for backward
    second[0].add_(1.0)  # microbatch 1's forward changes its own input
    out.sum().backward()
    assert torch.equal(w.grad, first[0].t() @ torch.ones(2, 4))
    assert torch.equal(x[2:], before[2:] + 1)  # the chunks are still the batch's memory
    assert torch.equal(x[:2], before[:2])


def test_a_chunk_that_requires_grad_stays_a_view_of_the_batch():
    x = torch.randn(4, 3, requires_grad=True)
    parts = split_microbatches(_step, (x,), {}, 2)
    sum(args[0].sum() * (i + 1) for i, (args, _) in enumerate(parts)).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))
