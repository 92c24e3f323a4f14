"""annot.runtime.grads called directly on real gloo ranks, on a plain module
(no rewriting): what ``model.backward`` relies on after every step."""

import pytest
import torch
import torch.nn as nn

from annot.testing import run_ranks


def _grads_over_dp():
    """dp=2: every gradient becomes the mean of the ranks' gradients."""
    from annot.mesh import Mesh
    from annot.runtime.grads import reduce_gradients
    from annot.runtime.mesh import init

    ctx = init(Mesh(dp=2))
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.rank + 1))  # 1 on rank 0, 2 on rank 1
    model.weight.annot_grad_sum = "tp"  # no tp here: nothing to sum over
    reduce_gradients(model, ctx)
    return [p.grad.unique().tolist() for p in model.parameters()]


def _replicated_disagreement():
    from annot.errors import VerifyError
    from annot.mesh import Mesh
    from annot.runtime.grads import check_replicated_grads, reduce_gradients
    from annot.runtime.mesh import init

    ctx = init(Mesh(tp=2))
    model = nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norm_w = model[1].weight
    norm_w.grad = torch.full_like(norm_w, float(ctx.rank + 1))  # a partial gradient
    with pytest.raises(VerifyError) as err:
        check_replicated_grads(model, ctx)
    named = str(err.value)
    norm_w.annot_grad_sum = "tp"  # Replicate(sum_grad=True): summed over tp
    reduce_gradients(model, ctx)
    check_replicated_grads(model, ctx)  # now they agree
    return named, norm_w.grad.unique().tolist()


def test_dp_gradients_are_averaged():
    for grads in run_ranks(_grads_over_dp, 2):
        assert grads == [[1.5], [1.5]]


def test_a_partial_gradient_is_named_then_summed():
    for named, summed in run_ranks(_replicated_disagreement, 2):
        assert "1 replicated parameter(s): 1.weight (off by up to 100%)" in named
        assert summed == [3.0]  # 1 + 2, summed over the two tp ranks
