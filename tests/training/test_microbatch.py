"""Splitting a step's arguments into microbatches (annot.training.microbatch)."""

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from annot.core.errors import PipelineError
from annot.training.microbatch import split_microbatches


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


def _pair(x, y):
    return x, y


def test_arguments_sharing_memory_keep_sharing_a_version_counter():
    """``step(t, t)``: a forward that saves one and changes the other in place
    must meet autograd's refusal, as plain torch does, not a gradient of the
    changed value."""

    w = torch.ones(2, 3, requires_grad=True)
    t = torch.ones(4, 3)
    (first, _), _ = split_microbatches(_pair, (t, t), {}, 2)
    x, y = first
    out = (w * y).sum()  # saves y
    x.add_(1.0)  # the same memory
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_conjugate_view_stays_one():
    x = torch.randn(4, 3, dtype=torch.complex64).conj()
    (first, _), (second, _) = split_microbatches(_step, (x,), {}, 2)
    assert first[0].is_conj()
    assert torch.equal(torch.cat([first[0], second[0]]), x)


def test_any_callable_is_a_step():
    """A step may be a callable object, hashable or not (a dataclass with
    ``__call__`` has no ``__hash__``)."""

    @dataclasses.dataclass
    class Step:
        scale: float = 1.0

        def __call__(self, x, w=None):
            return x

    parts = split_microbatches(Step(), (torch.arange(4.0),), {"w": torch.zeros(4)}, 2)
    assert [(a[0].tolist(), a[1].shape) for a, _ in parts] == [
        ([0.0, 1.0], (2,)),
        ([2.0, 3.0], (2,)),
    ]


class _Box:
    """A pytree node registered without key paths (``tree_flatten_with_path``
    refuses it)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


pytree.register_pytree_node(_Box, lambda box: ([box.a, box.b], None), lambda xs, _: _Box(*xs))


def test_unequal_batch_sizes_are_named_inside_a_node_without_key_paths():
    box = _Box(torch.zeros(4), torch.zeros(6))
    with pytest.raises(PipelineError, match=r"got x, leaf 0: 4, x, leaf 1: 6;"):
        split_microbatches(_step, (box,), {}, 2)
    box = _Box(torch.zeros(4), torch.ones(4))
    (first, _), (second, _) = split_microbatches(_step, (box,), {}, 2)
    assert first[0].a.shape == (2,)
    assert second[0].b.tolist() == [1.0, 1.0]
