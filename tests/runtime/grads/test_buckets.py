"""annot.runtime.grads.buckets: the dp average overlapped with the backward.

Bucket assignment without processes; on real gloo ranks, the buckets called
directly (arming, explicit readiness, a gradient after its bucket launched,
buckets ready on one rank and not on the other) against a flat all-reduce of
the same gradients, bit for bit; and through ``annot.parallelize`` against the
single-device model (loss, every gradient, every parameter after 2 AdamW
steps) at dp=2 with a parameter unused in the last microbatch, and at
dp2 x tp2 / dp2 x pp2 on the GPT whose LM head is tied to its embedding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from annot.testing import run_ranks

KIB = 1 / 1024  # in MiB: bucket_cap_mb=KIB is a 1 KiB bucket


def _meta(*shapes_dtypes) -> list[torch.Tensor]:
    return [torch.empty(s, dtype=d, device="meta") for s, d in shapes_dtypes]


def test_buckets_fill_in_reverse_order_by_size_one_dtype_each():
    from annot.runtime.grads.buckets import assign_buckets

    f32, f64 = torch.float32, torch.float64
    # bytes: 0: 400, 1: 400, 2: 800 (f64), 3: 400, 4: 2000, 5: 400, 6: 400
    params = _meta(
        ((100,), f32), ((100,), f32), ((100,), f64), ((10, 10), f32), ((500,), f32),
        ((100,), f32), ((100,), f32),
    )  # fmt: skip
    # walked from the last: a bucket closes once it holds >= 1000 bytes (first: 600)
    assert assign_buckets(params, 1000, 600) == [[6, 5], [4], [3, 1, 0], [2]]
    # one huge bucket: everything of a dtype together, still in reverse order
    assert assign_buckets(params, 10**9, 10**9) == [[6, 5, 4, 3, 1, 0], [2]]
    # a cap below every parameter: one bucket each, in reverse registration order
    assert assign_buckets(params, 1, 1) == [[i] for i in reversed(range(7))]
    # the default first bucket is DDP's 1 MiB (or the cap, if smaller)
    big = _meta(*[((256, 1024), f32)] * 4)  # 1 MiB each
    assert assign_buckets(big, 3 * 1024 * 1024) == [[3], [2, 1, 0]]
    assert assign_buckets(big, 512 * 1024) == [[3], [2], [1], [0]]


@pytest.mark.parametrize("overlap,cap", [("yes", 25.0), (True, 0), (True, -1.0), (True, "25")])
def test_bad_options_are_refused_before_anything_runs(overlap, cap):
    import annot

    with pytest.raises(annot.HintError, match="overlap_grad_reduce|bucket_cap_mb"):
        annot.parallelize(nn.Linear, 2, 2, overlap_grad_reduce=overlap, bucket_cap_mb=cap)


# -- the buckets alone, on 2 ranks ---------------------------------------------------------


class _Chain(nn.Module):
    """Registration order = forward order, so backward fills the buckets from
    ``out`` back to ``inp``; ``branch`` runs only where asked. With 256-byte
    buckets: [out + upper.1], [upper.0], [branch], [lower.1], [lower.0], [inp]."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.lower = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.branch = nn.Linear(d, d)
        self.upper = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.out = nn.Linear(d, 1)

    def forward(self, x, branch: bool = True):
        h = torch.tanh(self.inp(x))
        for b in self.lower:
            h = torch.tanh(b(h))
        if branch:
            h = h + self.branch(h)
        for b in self.upper:
            h = torch.tanh(b(h))
        return self.out(h).square().mean()


def _direct() -> dict:
    import torch.distributed as dist

    from annot.core.mesh import Mesh
    from annot.runtime.grads.buckets import GradBuckets
    from annot.runtime.process_groups import init

    ctx = init(Mesh(dp=2))
    rank = ctx.dp_rank
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(3, 4, generator=g) for _ in range(2)]
    out: dict = {}

    def expected(run) -> list[torch.Tensor]:
        """The same run without buckets, then one flat all-reduce (grads.py's)."""
        torch.manual_seed(0)
        plain = _Chain()
        run(plain, None)
        params = list(plain.parameters())
        grads = torch.cat([(p.grad if p.grad is not None else 0 * p).reshape(-1) for p in params])
        dist.all_reduce(grads)
        return list(grads.mul_(0.5).split([p.numel() for p in params]))

    def check(name: str, run) -> None:
        torch.manual_seed(0)
        model = _Chain()
        params = list(model.parameters())
        buckets = GradBuckets(params, ctx.dp_group, 0.5, bucket_cap_mb=KIB / 4)
        seen: list[int] = []  # buckets launched when inp's gradient lands (backward's end)
        model.inp.weight.register_post_accumulate_grad_hook(lambda p: seen.append(buckets.launched))
        run(model, buckets)
        buckets.finish()
        want = expected(run)
        out[name] = {
            "equal": all(torch.equal(p.grad.reshape(-1), w) for p, w in zip(params, want)),
            "buckets": len(buckets.buckets),
            "seen": seen,
            "last": buckets.last_step,
            "launched after finish": buckets.launched,
        }
        buckets.close()

    def armed(model, buckets):  # model.backward outside a step
        if buckets:
            buckets.arm()
        model(xs[0]).backward()

    def accumulate(model, buckets):  # a jit step: armed before the last microbatch only
        model(xs[0]).backward()
        if buckets:
            buckets.arm()
        model(xs[1]).backward()

    def twice(model, buckets):  # two backwards in the last microbatch: the first launched
        if buckets:
            buckets.arm()
        model(xs[0]).backward()
        model(xs[1]).backward()

    def never(model, buckets):  # nothing armed: every bucket at finish
        model(xs[0]).backward()

    def uneven(model, buckets):  # branch: used on rank 0, no gradient at all on rank 1
        if buckets:
            buckets.arm()
        model(xs[0], branch=rank == 0).backward()

    def by_hand(model, buckets):  # a stage armed twice; a .grad assigned, then made ready
        head = [*model.out.parameters(), *model.upper[1].parameters()]
        if buckets:
            buckets.arm(head)
            buckets.arm(head)
        model(xs[0]).backward()
        model.upper[0].weight.grad = torch.full_like(model.upper[0].weight, float(rank + 1))
        if buckets:
            buckets.ready(model.upper[0].parameters())

    for name, run in [
        ("armed", armed),
        ("accumulate", accumulate),
        ("twice", twice),
        ("never", never),
        ("uneven", uneven),
        ("by_hand", by_hand),
    ]:
        check(name, run)
    return out


def test_buckets_reduce_each_gradient_exactly_once_whatever_happened():
    ranks = run_ranks(_direct, 2)
    for res in ranks:
        for name, got in res.items():
            assert got["equal"], name  # bit for bit the flat all-reduce's average
            assert got["buckets"] == 6, name
            assert got["last"].order == list(range(6)), name  # in order, on both ranks
            assert got["launched after finish"] == 0, name  # reset for the next step
        last = {name: got["last"] for name, got in res.items()}
        # overlapped: 5 buckets launched from the hooks, some before inp's gradient
        # (near the end of the backward) landed; the last always waits for finish
        assert res["armed"]["seen"][0] >= 1
        assert (last["armed"].before_finish, last["armed"].at_finish) == (5, 1)
        assert last["armed"].again == 0
        # a jit step: the first (unarmed) microbatch launched none, the last all it could
        assert res["accumulate"]["seen"][0] == 0
        assert res["accumulate"]["seen"][1] >= 1
        assert last["accumulate"].before_finish == 5
        assert last["twice"].again == 5  # each early launch missed the second gradient
        assert (last["never"].before_finish, last["never"].at_finish) == (0, 6)
        # out + upper.1 armed; upper.0 made ready by hand; the branch was never armed
        assert last["by_hand"].before_finish == 2
        assert last["by_hand"].again == 0
    # the branch's bucket (2) was ready in rank 0's backward, never in rank 1's
    assert ranks[0]["uneven"]["last"].before_finish == 5
    assert ranks[1]["uneven"]["last"].before_finish == 2


# -- through annot.parallelize, against the single-device model ----------------------------


class _Net(nn.Module):
    """Several buckets at 1 KiB; ``gain`` a dtype (its bucket) of its own;
    ``branch`` runs where the microbatch's flag says; ``dead`` never runs."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.gain = nn.Parameter(torch.ones(d, dtype=torch.float64))
        self.dead = nn.Linear(d, d)
        self.lower = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.branch = nn.Linear(d, d)
        self.upper = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.out = nn.Linear(d, 1)

    def forward(self, x, flag):
        h = torch.tanh(self.inp(x)) * self.gain.float()
        for b in self.lower:
            h = torch.tanh(b(h))
        if bool(flag[0]):
            h = h + self.branch(h)
        for b in self.upper:
            h = torch.tanh(b(h))
        return self.out(h).square().mean()


def _dp2_parity(cache: str) -> dict:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import assert_close, compare_state

    mesh = annot.Mesh(dp=2)
    model = annot.parallelize(_Net, mesh=mesh, seed=0, bucket_cap_mb=KIB)
    flat = annot.parallelize(_Net, mesh=mesh, seed=0, overlap_grad_reduce=False)
    torch.manual_seed(0)
    ref = _Net()
    assert flat.grad_buckets is None
    buckets = model.grad_buckets
    seen: list[int] = []  # buckets launched when inp's gradient lands (backward's end)
    model.module.inp.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(buckets.launched)
    )
    # weight_decay=0: a parameter no rank used gets a zero gradient (as grads.py's flat
    # path gives it), which decoupled weight decay would move; the reference skips it
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0) for m in (model, flat, ref)
    ]

    def body(m):
        def step(x, flag):
            loss = m(x, flag)
            m.backward(loss)
            return loss

        return step

    steps = {id(m): annot.jit(m, microbatches=2)(body(m)) for m in (model, flat)}
    g = torch.Generator().manual_seed(0)
    rank = model.ctx.dp_rank
    # rows = (dp rank, microbatch): step 0 by jit (2 microbatches; rank 1's last one
    # skips the branch), step 1 by model.backward (rank 0 skips the branch)
    flags = [torch.tensor([1, 1, 1, 1, 1, 1, 0, 0]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])]
    stats = []
    for i, flag in enumerate(flags):
        x = torch.randn(8, 4, generator=g)
        mine, my_flag = x.chunk(2)[rank], flag.chunk(2)[rank]
        for m in (model, flat):
            if i == 0:
                loss = steps[id(m)](mine, my_flag).reduce_mean()
            else:
                loss = m(mine, my_flag)
                m.backward(loss)
        parts = 4 if i == 0 else 2
        ref_loss = sum(ref(a, f) / parts for a, f in zip(x.chunk(parts), flag.chunk(parts)))
        ref_loss.backward()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=model.ctx.dp_group)
        assert_close(mean / 2, ref_loss, f"step {i}: loss")
        for (k, p), q, r in zip(
            model.module.named_parameters(), flat.module.parameters(), ref.parameters()
        ):
            want = r.grad if r.grad is not None else torch.zeros_like(r)  # dead: zeros
            assert_close(p.grad, want, f"step {i}: grad {k}", dtype=torch.float32)
            assert torch.equal(p.grad, q.grad), f"step {i}: {k} differs from the flat all-reduce"
        stats.append(buckets.last_step)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    compare_state(model, ref, "dp=2 overlapped, after 2 AdamW steps")
    return {"buckets": len(buckets.buckets), "seen": seen, "stats": stats}


@pytest.mark.slow  # about 4 s: two models built on each rank
def test_overlapped_dp2_equals_single_device_with_unused_parameters(tmp_path):
    ranks = run_ranks(_dp2_parity, 2, str(tmp_path))
    for res in ranks:
        n = res["buckets"]
        assert n >= 5, n
        jit, direct = res["stats"]
        assert jit.order == direct.order == list(range(n))
        # the jit step armed its last microbatch only: inp's first gradient landed with
        # nothing launched, its second after some bucket's all-reduce had started
        assert res["seen"][0] == 0
        assert res["seen"][1] >= 1
        assert res["seen"][2] >= 1
        assert jit.before_finish >= 1
        assert direct.before_finish >= 1
    # the branch's bucket: ready in the last backward where the branch ran
    assert ranks[0]["stats"][0].before_finish > ranks[1]["stats"][0].before_finish
    assert ranks[1]["stats"][1].before_finish > ranks[0]["stats"][1].before_finish


def _gpt_tied(cache: str, tp: int, pp: int, schedule: str) -> dict:
    """dp2 x tp2: the tie is one parameter (vocab-parallel wte = lm_head); dp2 x pp2:
    a copy on each end stage, summed over its tie group after the dp average."""
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from examples.gpt.model import GPT, GPTConfig
    from tests.parity import compare_grads, compare_state, gpt_dp_step, gpt_step

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model = annot.parallelize(
        GPT, cfg, mesh=annot.Mesh(dp=2, tp=tp, pp=pp), seed=3, bucket_cap_mb=KIB
    )
    torch.manual_seed(3)
    ref = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = gpt_step(model, schedule)

    g = torch.Generator().manual_seed(0)
    stats = []
    for i in range(2):
        x = torch.randint(0, 32, (8, 8), generator=g)
        gpt_dp_step(model, ref, step, x, 2, f"step {i}")
        compare_grads(model, ref, f"dp=2 tp={tp} pp={pp} {schedule} overlapped, step {i}")
        stats.append(model.grad_buckets.last_step)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    compare_state(model, ref, f"dp=2 tp={tp} pp={pp} overlapped, after 2 AdamW steps")
    return {"buckets": len(model.grad_buckets.buckets), "stats": stats}


@pytest.mark.slow  # 4 ranks
@pytest.mark.parametrize(
    "tp,pp,schedule", [(2, 1, "1f1b"), (1, 2, "1f1b"), (1, 2, "zbh1"), (1, 2, "gpipe")]
)
def test_overlapped_reduction_keeps_tied_weights_and_dp_exact(tmp_path, tp, pp, schedule):
    for res in run_ranks(_gpt_tied, 4, str(tmp_path), tp, pp, schedule, timeout=300):
        assert res["buckets"] >= 4
        for s in res["stats"]:
            assert s.order == list(range(res["buckets"]))
            # pipelines arm a stage before its last B (ZB-H1: its last W, whose
            # directly written gradients are marked ready)
            assert s.before_finish >= 1
