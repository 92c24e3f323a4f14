"""annot.runtime.grads.reduce called directly on plain modules (no rewriting): what
``model.backward`` relies on after every step (dp averaging, partial gradients
summed over tp, a tied weight summed over its stages) on real gloo ranks, and
``clip_grad_norm_`` against torch's in one process and across stages."""

import pytest
import torch
import torch.nn as nn

from annot.testing import run_ranks


def _grads_over_dp():
    """dp=2: every gradient becomes the mean of the ranks' gradients."""
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import reduce_gradients
    from annot.runtime.process_groups import init

    ctx = init(Mesh(dp=2))
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(ctx.rank + 1))  # 1 on rank 0, 2 on rank 1
    model.weight.annot_grad_sum = "tp"  # no tp here: nothing to sum over
    reduce_gradients(model, ctx)
    return [p.grad.unique().tolist() for p in model.parameters()]


def _replicated_disagreement():
    from annot.core.errors import VerifyError
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import check_replicated_grads, reduce_gradients
    from annot.runtime.process_groups import init

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


def _tied_pair(mesh, **others):
    """This rank's part of a pipeline whose stage 0 ``emb.weight`` is stage 1's
    ``head.weight`` (a copy on each stage, equal), beside the modules
    ``others`` (name: module); returns ``(ctx, model, the tied weight, layout)``."""
    from annot.runtime.pipeline.layout import PipelineLayout, Tie
    from annot.runtime.process_groups import init
    from annot.runtime.runners.stage_runner import ReplayRunner

    ctx = init(mesh)
    tied = "emb" if ctx.pp_rank == 0 else "head"
    torch.manual_seed(0)  # the copies of one weight: equal
    model = nn.ModuleDict({tied: nn.Linear(3, 2, bias=False), **others})
    tie = Tie(names=("emb.weight", "head.weight"), stages=(0, 1), group=ctx.pp_group)
    plan = PipelineLayout(
        runner=ReplayRunner(), pp=2, chunks=1, pp_rank=ctx.pp_rank, boundaries=(), ties=[tie]
    )
    return ctx, model, model[tied].weight, plan


def _tied_across_stages():
    """pp=2: stage 0's ``emb.weight`` is stage 1's ``head.weight`` (one weight, a
    copy on each stage, each copy with the gradient of its own stage's use)."""
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import clip_grad_norm_, reduce_gradients

    ctx, model, w, plan = _tied_pair(Mesh(pp=2), body=nn.Linear(2, 2))
    w.grad = torch.full((2, 3), float(ctx.rank + 1))  # 1 and 2
    for p in model["body"].parameters():
        p.grad = torch.full_like(p, 2.0 if ctx.rank == 0 else -1.0)
    reduce_gradients(model, ctx, plan)
    summed = w.grad.unique().tolist()
    norm = clip_grad_norm_(model, ctx, plan, max_norm=1.0)
    return summed, norm.item(), w.grad.clone()


def test_a_tied_weight_is_summed_over_its_stages_and_counted_once():
    results = run_ranks(_tied_across_stages, 2)
    # the single-device gradient: the tied weight's 6 entries at 1 + 2 = 3, each
    # stage's own body (6 entries) at 2 and at -1
    expected = (6 * 3.0**2 + 6 * 2.0**2 + 6 * 1.0**2) ** 0.5
    for summed, norm, _ in results:
        assert summed == [3.0]  # summed, not averaged: each stage holds a part
        assert norm == pytest.approx(expected, rel=1e-6)  # the tie counted once
    (_, _, clipped0), (_, _, clipped1) = results
    assert torch.equal(clipped0, clipped1)  # the copies take the same step
    assert clipped0.unique().tolist() == pytest.approx([3.0 / (expected + 1e-6)])


def _tie_that_is_no_longer_one_parameter(case: str):
    """pp=2, a weight tied across the stages whose copies disagree: frozen on
    one stage only (frozen by the name the single device gives it, which the
    other stage does not use), or with different values (another optimizer
    setting for one name); or frozen on both, where nothing is summed."""
    from annot.core.errors import PipelineError
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import reduce_gradients

    ctx, model, w, plan = _tied_pair(Mesh(pp=2))
    if case == "frozen on one":
        w.requires_grad_(ctx.pp_rank == 1)
    elif case == "frozen on both":
        w.requires_grad_(False)
    else:
        with torch.no_grad():
            w[0, 0] += ctx.pp_rank  # one copy stepped differently
    if w.requires_grad:
        w.grad = torch.ones_like(w)
    try:
        reduce_gradients(model, ctx, plan)
    except PipelineError as err:
        return str(err)
    return w.grad


def _tie_differs_on_one_tp_shard():
    """pp=2 x tp=2: the tie's copies differ in tp rank 0's shard only: its
    group finds it, and the tp replicas, whose shards agree, raise with it
    (else they would wait for it in their next collective)."""
    from annot.core.errors import PipelineError
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import reduce_gradients

    ctx, model, w, plan = _tied_pair(Mesh(pp=2, tp=2))
    if ctx.pp_rank == 1 and ctx.tp_rank == 0:
        with torch.no_grad():
            w[0, 0] += 1.0
    w.grad = torch.ones_like(w)
    try:
        reduce_gradients(model, ctx, plan)
    except PipelineError as err:
        return str(err)
    return "summed"


def test_a_tie_that_differs_on_one_shard_is_refused_by_every_replica():
    errors = run_ranks(_tie_differs_on_one_tp_shard, 4)
    for rank, err in enumerate(errors):
        if rank % 2 == 0:  # tp rank 0: its own group's finding
            assert "emb.weight / head.weight differ between pipeline ranks [0, 1]" in err
        else:
            assert "disagree on another tp or dp rank's shard" in err


@pytest.mark.parametrize("case", ["frozen on one", "values differ", "frozen on both"])
def test_a_tied_weight_whose_copies_disagree_is_refused_on_every_holder(case):
    for got in run_ranks(_tie_that_is_no_longer_one_parameter, 2, case):
        if case == "frozen on both":
            assert got is None  # no gradient made for a frozen weight
        elif case == "frozen on one":
            assert "emb.weight / head.weight is trainable on pipeline rank(s) [1] and " in got
            assert "frozen on [0]" in got
            assert "if n.endswith(('emb.weight', 'head.weight')): p.requires_grad_(False)" in got
        else:
            assert "emb.weight / head.weight differ between pipeline ranks [0, 1]" in got
            assert "model.clip_grad_norm_" in got


def _sums_of_an_accumulating_step():
    """pp=2 x tp=2: a tied weight and a tp partial-sum weight start the step
    with the gradient an earlier step left (equal on every rank, as its sums
    made it); this step adds rank + 1 to each."""
    from annot.core.mesh import Mesh
    from annot.runtime.grads.reduce import carried_grads, reduce_gradients

    ctx, model, w, plan = _tied_pair(Mesh(pp=2, tp=2), norm=nn.LayerNorm(2))
    model["norm"].weight.annot_grad_sum = "tp"
    summed = (w, model["norm"].weight)
    for p in summed:
        p.grad = torch.full_like(p, 10.0)  # the earlier step's, already whole
    carried = carried_grads(model, ctx, plan)
    for p in summed:
        p.grad += ctx.rank + 1  # this step's part
    model["norm"].bias.grad = torch.full((2,), float(ctx.rank))  # replicated, not summed
    reduce_gradients(model, ctx, plan, carried=carried)
    return [p.grad.unique().tolist() for p in (*summed, model["norm"].bias)]


def test_a_sum_over_ranks_adds_only_the_steps_own_parts():
    results = run_ranks(_sums_of_an_accumulating_step, 4)
    # ranks (pp, tp): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1); parts rank + 1
    for rank, (tie, norm, bias) in enumerate(results):
        pp_rank, tp_rank = divmod(rank, 2)
        assert tie == [10.0 + (1 + tp_rank) + (3 + tp_rank)]  # over the pp pair at this tp rank
        assert norm == [10.0 + (2 * pp_rank + 1) + (2 * pp_rank + 2)]  # over the tp pair
        assert bias == [float(rank)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipped, and left as it is
def test_clip_grad_norm_in_one_process_is_torchs(norm_type, max_norm):
    """Without a mesh, ``clip_grad_norm_`` is ``torch.nn.utils.clip_grad_norm_``:
    the same norm, every gradient scaled alike; a frozen parameter and one without
    a gradient count for nothing."""
    from annot.runtime.grads.reduce import clip_grad_norm_

    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    ours[2].weight.requires_grad_(False)
    ours(torch.randn(5, 4)).square().sum().backward()
    ours[2].weight.grad = torch.ones_like(ours[2].weight)  # frozen: not counted, not scaled
    ours[2].bias.grad = None
    mine = [p for p in ours.parameters() if p.requires_grad and p.grad is not None]
    theirs = [nn.Parameter(p.detach().clone()) for p in mine]
    for a, b in zip(mine, theirs):
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, None, None, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert torch.equal(ours[2].weight.grad, torch.ones_like(ours[2].weight))
    assert ours[2].bias.grad is None
