"""The pipeline executor on real gloo ranks, against the single-device model.

A hand-split model (8 Linear+Tanh blocks in an nn.Sequential; stage s runs a
slice of it) is run with each schedule; loss and every parameter gradient
must equal the single-device model built from the same seed. Stage 0 sends a
dict with a tensor, a None, an int and the target, which only the last stage
uses.
"""

import pytest
import torch
import torch.nn as nn

from annot.core.errors import PipelineError
from annot.runtime.pipeline.executor import LocalStage, PipelineExecutor
from annot.testing import run_ranks

RTOL, ATOL = 1e-5, 4e-5  # float32, written once
WIDTH, BLOCKS = 8, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )


def _data(sizes, seq):
    torch.manual_seed(1 + sum(sizes) + 7 * seq)
    n = sum(sizes)
    return torch.randn(n, seq, WIDTH), torch.randn(n, seq, WIDTH)


def _stage_fn(blocks: nn.Module, s: int, n: int):
    def check(mask, count, h):
        assert mask is None, (mask, count)
        assert isinstance(count, int), (mask, count)
        assert count == h.shape[0], (mask, count)

    def first(x, y):
        return {"h": blocks(x), "mask": None, "n": x.shape[0], "y": y}

    def middle(h, mask, n, y):
        check(mask, n, h)
        return {"h": blocks(h), "mask": None, "n": n, "y": y}

    def last(h, mask, n, y):
        check(mask, n, h)
        out = blocks(h)
        return out, ((out - y) ** 2).mean()

    def only(x, y):
        out = blocks(x)
        return out, ((out - y) ** 2).mean()

    if n == 1:
        return only
    return first if s == 0 else last if s == n - 1 else middle


def _local_stages(model, pp, pp_rank, chunks):
    n = pp * chunks
    per = BLOCKS // n
    out = []
    for c in range(chunks):
        s = pp_rank + c * pp
        blocks = model[s * per : (s + 1) * per]
        out.append(LocalStage(index=s, fn=_stage_fn(blocks, s, n), module=blocks))
    return out


def _grads(model, pp, pp_rank, chunks):
    """Gradients of this rank's parameters, keyed like the full model's."""
    per = BLOCKS // (pp * chunks)
    mine = {
        b
        for c in range(chunks)
        for b in range((pp_rank + c * pp) * per, (pp_rank + c * pp + 1) * per)
    }
    return {
        name: p.grad.clone()
        for name, p in model.named_parameters()
        if int(name.split(".")[0]) in mine and p.grad is not None
    }


def _run_case(ex, model, pp, pp_rank, chunks, sizes, seq, weighted=False, forward_only=False):
    """One step on this rank; returns (broadcast losses, local grads)."""
    model.zero_grad(set_to_none=True)  # no optimizer step: parameters stay the reference's
    x, y = _data(sizes, seq)
    xs, ys = x.split(list(sizes)), y.split(list(sizes))

    def body(i, call):
        out, loss = call(xs[i], ys[i])  # off the last stage the body stops here
        assert call.is_last
        call.backward(loss)
        return loss

    scale = [n / sum(sizes) for n in sizes] if weighted else None
    outs = ex.run(len(sizes), body, loss_scale=scale, forward_only=forward_only)
    if forward_only:  # evaluation builds no autograd graph
        assert all(v.grad_fn is None and not v.requires_grad for v in outs), outs
    losses = [float(v) for v in outs]
    return losses, _grads(model, pp, pp_rank, chunks)


def _reference(sizes, seq):
    model = _model()
    x, y = _data(sizes, seq)
    losses = []
    for xi, yi in zip(x.split(list(sizes)), y.split(list(sizes))):
        losses.append(float(((model(xi) - yi) ** 2).mean().detach()))
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(case, got_losses, got_grads, forward_only=False):
    ref_losses, ref_grads = _reference(case["sizes"], case["seq"])
    torch.testing.assert_close(
        torch.tensor(got_losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL
    )
    if forward_only:
        assert got_grads == {}
        return
    assert sorted(got_grads) == sorted(ref_grads), "every parameter has a gradient"
    for name, g in got_grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)


CASES = [
    # one executor per (schedule, chunks) runs every case of it, in order:
    # several microbatch counts and sequence lengths on the same executor
    {"schedule": "gpipe", "chunks": 1, "sizes": (2,), "seq": 3},
    {"schedule": "gpipe", "chunks": 1, "sizes": (2, 2, 2), "seq": 5},
    {"schedule": "gpipe", "chunks": 1, "sizes": (1, 2, 1, 2), "seq": 2, "weighted": True},
    {"schedule": "1f1b", "chunks": 1, "sizes": (3,), "seq": 4},
    {"schedule": "1f1b", "chunks": 1, "sizes": (2, 2, 2), "seq": 3},
    {"schedule": "1f1b", "chunks": 1, "sizes": (2, 2, 2, 2), "seq": 6},
    {"schedule": "1f1b", "chunks": 1, "sizes": (3, 2, 2), "seq": 1, "weighted": True},
    {"schedule": "1f1b", "chunks": 1, "sizes": (2, 1, 2), "seq": 2, "forward_only": True},
    {"schedule": "1f1b", "chunks": 1, "sizes": (1,) * 8, "seq": 2},
    {"schedule": "interleaved", "chunks": 2, "sizes": (2, 2, 2, 2), "seq": 3},
    {"schedule": "interleaved", "chunks": 2, "sizes": (1, 2), "seq": 4, "weighted": True},
    {"schedule": "zbh1", "chunks": 1, "sizes": (2, 2, 2, 2), "seq": 3},
    {"schedule": "zbh1", "chunks": 1, "sizes": (1, 2, 2), "seq": 2, "weighted": True},
]


def _executors(pp, pp_rank, ctx, trace=False, post_receives=False):
    """One (executor, model) per (schedule, chunks), reused by every case of it."""
    ex = {}
    for case in CASES:
        key = (case["schedule"], case["chunks"])
        if key not in ex:
            model = _model()
            stages = _local_stages(model, pp, pp_rank, case["chunks"])
            ex[key] = (
                model,
                PipelineExecutor(
                    stages,
                    num_stages=pp * case["chunks"],
                    ctx=ctx,
                    schedule=case["schedule"],
                    chunks=case["chunks"],
                    timeout_s=60,
                    trace=trace,
                    output_arity=2,
                    post_receives=post_receives,
                ),
            )
    return ex


def _parity_rank(pp, cases, tp=1, post_receives=False):
    from annot.core.mesh import Mesh
    from annot.runtime.process_groups import init, use

    ctx = init(Mesh(pp=pp, tp=tp))  # tp > 1: replicas, so pp peers are tp ranks apart
    out = []
    with use(ctx):
        executors = _executors(pp, ctx.pp_rank, ctx, trace=True, post_receives=post_receives)
        assert all(ex.post_early == post_receives for _, ex in executors.values())
        for case in cases:
            model, ex = executors[(case["schedule"], case["chunks"])]
            losses, grads = _run(ex, model, pp, ctx.pp_rank, case)
            # tensors do not survive the harness's queue once the rank exits: numpy does
            out.append((losses, {k: v.numpy() for k, v in grads.items()}))
        names = sorted({e["name"] for _, ex in executors.values() for e in ex.trace_events()})
    return out, names


def _run(ex, model, pp, pp_rank, case):
    return _run_case(
        ex,
        model,
        pp,
        pp_rank,
        case["chunks"],
        case["sizes"],
        case["seq"],
        case.get("weighted", False),
        case.get("forward_only", False),
    )


def _check_ranks(pp, cases, per_rank, tp=1):
    if tp > 1:  # each tp index runs its own pipeline over ranks t, t + tp, ...
        for t in range(tp):
            _check_ranks(pp, cases, per_rank[t::tp])
        return
    for k, case in enumerate(cases):
        losses = [r[0][k][0] for r in per_rank]
        assert all(v == losses[-1] for v in losses), "every rank gets the same step outputs"
        grads = {}
        for r in per_rank:
            assert not set(grads) & set(r[0][k][1]), "each parameter lives on one rank"
            grads.update({n: torch.from_numpy(g) for n, g in r[0][k][1].items()})
        try:
            _check(case, losses[-1], grads, case.get("forward_only", False))
        except AssertionError as e:
            raise AssertionError(f"pp={pp} {case}: {e}") from None


def test_parity_pp2_every_schedule():
    per_rank = run_ranks(_parity_rank, 2, 2, CASES, timeout=240)
    _check_ranks(2, CASES, per_rank)
    names0, names1 = per_rank[0][1], per_rank[1][1]
    assert {"0F0", "0SEND_F0", "0RECV_B0", "0B0", "2F0", "wait sends"} <= set(names0)
    assert {"1RECV_F0", "1F0", "1B0", "1SEND_B0", "3B0"} <= set(names1)
    assert {"0I0", "0W0", "1I0", "1W0"} <= set(names0) | set(names1)


def test_parity_pp2_receives_posted_ahead():
    """With each RECV's receive posted one action early (``post_receives``,
    gloo only): the same parity, one case per schedule kind. (The default
    receives at the RECV, as NCCL must.)"""
    cases = [CASES[1], CASES[4], CASES[9], CASES[11]]
    per_rank = run_ranks(_parity_rank, 2, 2, cases, 1, True, timeout=240)
    _check_ranks(2, cases, per_rank)


SLOW_CASES = [
    {"schedule": "gpipe", "chunks": 1, "sizes": (2, 1, 2), "seq": 3, "weighted": True},
    {"schedule": "1f1b", "chunks": 1, "sizes": (1, 1, 2, 1, 2), "seq": 2, "weighted": True},
    {"schedule": "1f1b", "chunks": 1, "sizes": (2, 2), "seq": 3},
    {"schedule": "interleaved", "chunks": 2, "sizes": (1, 1, 1, 1), "seq": 2},
]


PEER_CASES = [CASES[4], CASES[-2]]  # 1f1b M=3, interleaved M=4


def _four_ranks():
    pp4 = _parity_rank(4, SLOW_CASES)
    tp2 = _parity_rank(2, PEER_CASES, tp=2)  # same processes, a second mesh
    return pp4, tp2


@pytest.mark.slow
@pytest.mark.slow  # 4 ranks
def test_parity_pp4_and_non_adjacent_peers():
    """pp=4; then Mesh(pp=2, tp=2), where the pipeline of tp index t runs over
    global ranks t and t + 2 (one spawn for both)."""
    per_rank = run_ranks(_four_ranks, 4, timeout=300)
    _check_ranks(4, SLOW_CASES, [r[0] for r in per_rank])
    _check_ranks(2, PEER_CASES, [r[1] for r in per_rank], tp=2)


def _fault_rank(schedule, bad_return=False):
    from annot.core.mesh import Mesh
    from annot.runtime.process_groups import init

    ctx = init(Mesh(pp=2))
    stages = _local_stages(_model(), 2, ctx.pp_rank, 1)
    if ctx.pp_rank == 1 and not bad_return:
        inner, calls = stages[0].fn, []

        def failing(h, mask, n, y):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("boom in the last stage")
            return inner(h, mask, n, y)

        stages[0].fn = failing
    ex = PipelineExecutor(
        stages, num_stages=2, ctx=ctx, schedule=schedule, timeout_s=30, output_arity=2
    )
    x, y = _data((1, 1, 1), 2)

    def body(i, call):
        out, loss = call(x[i : i + 1], y[i : i + 1])
        call.backward(loss)
        return {"loss": loss, "seen": {i}} if bad_return and i == 1 else loss

    try:
        ex.run(3, body)
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank saw
        return type(e).__name__, getattr(e, "rank", None), getattr(e, "stage", None), str(e)
    return "no error"


def test_failing_stage_names_rank_stage_and_microbatch():
    """Rank 1 raises in its forward of microbatch 1; rank 0, waiting for it,
    stops with a RankFailure that names rank 1, its stage and the microbatch."""
    first, last = run_ranks(_fault_rank, 2, "1f1b", timeout=120)
    assert last[:2] == ("ValueError", None)
    assert "boom in the last stage" in last[3]
    kind, rank, stage, message = first
    assert (kind, rank, stage) == ("RankFailure", 1, 1), first
    assert "rank 1 (stage 1) failed during forward of microbatch 1" in message
    assert "ValueError: boom in the last stage" in message


def test_unsendable_step_result_is_named_before_it_is_sent():
    """The body's results go to every rank at the end of the step: one that
    cannot cross is refused on the last rank where it is made, naming the
    microbatch and the value, and the first rank names the last as the rank
    that failed (not a timeout at the step's end)."""
    first, last = run_ranks(_fault_rank, 2, "1f1b", True, timeout=120)
    assert last[0] == "PipelineError", last
    assert "return value of microbatch 1: cannot send result['seen'] of type set" in last[3]
    assert "return tensors and plain values" in last[3]
    kind, rank, stage, message = first
    assert (kind, rank, stage) == ("RankFailure", 1, 1), first


# -- one process (pp = 1): the executor's local paths --------------------------


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_parity_one_process(schedule, chunks):
    model, ex = _executors(1, 0, None)[(schedule, chunks)]
    for case in [c for c in CASES if c["schedule"] == schedule]:
        losses, grads = _run(ex, model, 1, 0, case)
        _check(case, losses, grads, case.get("forward_only", False))


def test_body_must_call_model_and_backward():
    model = _model()
    ex = PipelineExecutor(_local_stages(model, 1, 0, 1), num_stages=1, ctx=None)
    x, y = _data((2,), 3)
    with pytest.raises(PipelineError, match="did not call the model for microbatch 0"):
        ex.run(1, lambda i, call: None)
    with pytest.raises(
        PipelineError, match=r"did not call model.backward\(loss\) for microbatch 0"
    ):
        ex.run(1, lambda i, call: call(x, y))

    def twice(i, call):
        call(x, y)
        call(x, y)

    with pytest.raises(PipelineError, match="called twice for microbatch 0"):
        ex.run(1, twice)
    with torch.no_grad(), pytest.raises(PipelineError, match="does not require grad"):
        ex.run(1, lambda i, call: call.backward(call(x, y)[1]))
    with pytest.raises(PipelineError, match="3 weights for 2 microbatches"):
        ex.run(2, lambda i, call: None, loss_scale=[1, 2, 3])


def test_executor_checks_its_stages():
    model = _model()
    with pytest.raises(PipelineError, match=r"pp\(1\) \* chunks\(1\) = 1"):
        PipelineExecutor(_local_stages(model, 1, 0, 1), num_stages=2, ctx=None)
    with pytest.raises(PipelineError, match=r"must hold stages \[0, 1\].*given stages \[0\]"):
        PipelineExecutor(_local_stages(model, 1, 0, 1), num_stages=2, ctx=None, chunks=2)
    with pytest.raises(PipelineError, match="unknown pipeline schedule 'zb'"):
        PipelineExecutor(_local_stages(model, 1, 0, 1), num_stages=1, ctx=None, schedule="zb")
