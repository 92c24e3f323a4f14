"""runtime/pipeline/split_backward.py: the input half then the weight half of a
stage's backward give exactly what one ``torch.autograd.backward`` gives,
for every input and every weight, with no processes."""

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from annot.runtime.pipeline.split_backward import backward_input, backward_weight, takes_edge_grads


class Stage(nn.Module):
    """A stage with the shapes that matter: weights behind the input path,
    one weight used twice, a norm, two outputs, and optionally a parameter
    one of whose paths reaches an output without touching the input."""

    def __init__(self, width=6, depth=2, shared=True, bias_only_path=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.shared = nn.Linear(width, width, bias=False) if shared else None
        self.offset = nn.Parameter(torch.randn(width)) if bias_only_path else None

    def forward(self, x, mask):
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        if self.shared is not None:
            x = self.shared(self.shared(x) * mask)
        h = self.norm(x)
        if self.offset is not None:
            h = h + self.offset * 2  # joins the input path: W takes it
            side = self.offset.exp().sum().expand(h.shape[0])  # an output of its own
        else:
            side = h.sum(-1)
        return h, side


def _run(stage, x, mask, split: bool, gh, gs):
    x = x.clone().requires_grad_(True)
    h, side = stage(x, mask)
    weights = list(stage.parameters())
    if split:
        (gx,), work = backward_input([h, side], [gh, gs], [x], weights)
        if work is not None:
            assert h.grad_fn is None, "the input pass cuts the outputs from the graph"
        backward_weight(work)
    else:
        torch.autograd.backward([h, side], [gh, gs])
        gx, work = x.grad, None
    return gx, {n: p.grad for n, p in stage.named_parameters()}, work


def _compare(stage, x, mask, gh, gs):
    other = copy.deepcopy(stage)
    gx, grads, work = _run(stage, x, mask, True, gh, gs)
    rx, ref, _ = _run(other, x, mask, False, gh, gs)
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-7)
    assert sorted(grads) == sorted(ref)
    for name in ref:
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)
    return work


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    depth=st.integers(0, 3),
    shared=st.booleans(),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_split_equals_one_backward(depth, shared, batch, seed):
    torch.manual_seed(seed)
    stage = Stage(depth=depth, shared=shared)
    x, mask = torch.randn(batch, 6), (torch.rand(batch, 6) > 0.3).float()
    work = _compare(stage, x, mask, torch.randn(batch, 6), torch.randn(batch))
    assert work is not None, "the weights' half is left for W"
    assert work.groups, "the weights' half is left for W"


def test_weight_off_the_input_path_gets_its_gradient_at_once():
    torch.manual_seed(0)
    stage = Stage(bias_only_path=True)
    x, mask = torch.randn(2, 6), torch.ones(2, 6)
    work = _compare(stage, x, mask, torch.randn(2, 6), torch.randn(2))
    assert work is None, "a weight the input pass cannot reach: the whole backward ran at I"


def test_inputs_without_gradient_leave_the_whole_backward_to_w():
    torch.manual_seed(0)
    stage = Stage()
    other = copy.deepcopy(stage)
    x = torch.randn(2, 6)  # the first stage: token ids, images, nothing requiring grad
    h, side = stage(x, torch.ones(2, 6))
    in_grads, work = backward_input([(h * h).sum() + side.sum()], None, [x], stage.parameters())
    assert in_grads == [None]
    assert not work.retains_graph
    assert all(p.grad is None for p in stage.parameters()), "nothing runs at I"
    assert backward_weight(work) == []  # autograd accumulated them
    h, side = other(x, torch.ones(2, 6))
    ((h * h).sum() + side.sum()).backward()
    for p, q in zip(stage.parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_an_output_without_gradient_and_an_unused_input():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x, unused = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    y = lin(x)
    in_grads, work = backward_input([y], [torch.ones(3, 4)], [x, unused], list(lin.parameters()))
    backward_weight(work)
    assert in_grads[1] is None
    torch.testing.assert_close(in_grads[0], torch.ones(3, 4) @ lin.weight)
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 4).T @ x)
    torch.testing.assert_close(lin.bias.grad, torch.full((4,), 3.0))


def test_weight_gradients_accumulate_over_microbatches():
    torch.manual_seed(0)
    stage = Stage()
    other = copy.deepcopy(stage)
    for _ in range(3):
        x, mask = torch.randn(2, 6), torch.ones(2, 6)
        gh, gs = torch.randn(2, 6), torch.randn(2)
        _run(stage, x, mask, True, gh, gs)
        _run(other, x, mask, False, gh, gs)
    for (name, p), q in zip(stage.named_parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


class Scale(torch.autograd.Function):
    """``x * w`` as a custom Function (as activation checkpointing and annot's
    collectives are): the weight's path leaves the input path at its node."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def test_weight_behind_a_custom_function():
    """W starts at the custom Function's node where this torch takes a
    gradient there (2.13), else the whole backward runs at I (torch 2.11
    raised from inside autograd.grad: seen on the GPU machine's image);
    either way, exactly one backward's gradients."""
    torch.manual_seed(0)
    lin, w = nn.Linear(4, 4), nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    y = Scale.apply(lin(x), w)
    node = y.grad_fn
    g = torch.randn(3, 4)
    (gx,), work = backward_input([y], [g], [x], [w, *lin.parameters()])
    backward_weight(work)
    assert (work is not None) == takes_edge_grads(node)
    ref_lin, ref_w = copy.deepcopy(lin), nn.Parameter(w.detach().clone())
    ref_x = x.detach().clone().requires_grad_(True)
    Scale.apply(ref_lin(ref_x), ref_w).backward(g)
    torch.testing.assert_close(gx, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)
    for p, q in zip(lin.parameters(), ref_lin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_nothing_to_do():
    assert backward_weight(None) == []
    x = torch.randn(2, requires_grad=True)
    assert backward_input([torch.zeros(2)], [torch.ones(2)], [x], []) == ([None], None)


if __name__ == "__main__":
    pytest.main([__file__])
