"""Expert parallelism on models annot does not know: a hand-written routed MoE
hinted ``Experts()`` and torch's own MoE test Transformer (every expert on every
token), on real gloo ranks, each against the single-device model on the whole
batch: the loss, every gradient, the clipped norm, and every parameter after
AdamW steps. One case routes no token to any expert of rank 1: that rank
receives nothing, computes nothing, and its experts' gradients are zero."""

from __future__ import annotations

import os

import torch
from torch import nn

from annot.testing import run_ranks


class Experts(nn.Module):
    """Stacked experts as transformers and torchtitan hold them, called as
    ``forward(tokens (N, d), index (N, k), weights (N, k))``."""

    def __init__(self, n: int, d: int, h: int):
        super().__init__()
        self.num_experts = n
        self.w_in = nn.Parameter(torch.randn(n, h, d) * 0.2)
        self.b_in = nn.Parameter(torch.randn(n, h) * 0.1)
        self.w_out = nn.Parameter(torch.randn(n, d, h) * 0.2)

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            y = torch.relu(x[token] @ self.w_in[e].T + self.b_in[e]) @ self.w_out[e].T
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, d: int = 8, n: int = 4, k: int = 2, avoid: tuple = ()):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, n)
        self.experts = Experts(n, d, 12)
        self.register_buffer("ban", torch.zeros(n))
        for e in avoid:
            self.ban[e] = -1e4  # never chosen

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = (self.router(flat) + self.ban).softmax(-1)
        weights, index = scores.topk(self.k, dim=-1)
        return self.experts(flat, index, weights / weights.sum(-1, keepdim=True)).view_as(x)


class Net(nn.Module):
    def __init__(self, avoid: tuple = ()):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.moe = MoE(avoid=avoid)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h)
        return nn.functional.mse_loss(self.out(h), y)


def _dp_step(model, ref, batch, what):
    """This replica's part of the batch on the model, the whole batch on the
    reference in the same parts; the dp-mean loss compared."""
    import torch.distributed as dist

    from tests.parity import assert_close

    dp, rank = model.ctx.mesh.dp, model.ctx.dp_rank
    parts = list(zip(*(t.chunk(dp) for t in batch)))
    loss = model(*parts[rank])
    model.backward(loss)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=model.ctx.dp_group)
    expected = 0.0
    for part in parts:
        r = ref(*part)
        (r / dp).backward()
        expected += r.detach() / dp
    assert_close(mean / dp, expected, f"{what}: loss")


def _train(model, ref, make_batch, what, steps=2):
    from tests.parity import assert_close, compare_grads, compare_state, step_both

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        _dp_step(model, ref, make_batch(g), f"{what} step {step}")
        compare_grads(model, ref, f"{what} step {step}")
        norm = model.clip_grad_norm_(0.05)
        assert_close(norm, nn.utils.clip_grad_norm_(ref.parameters(), 0.05), f"{what}: norm")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what} after {steps} AdamW steps")


def _hand_written(cache: str, dp: int, avoid: tuple) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    hints = {"moe.experts": annot.Experts()}
    model = annot.parallelize(Net, avoid, mesh=annot.Mesh(dp=dp, ep=2), seed=0, hints=hints)
    torch.manual_seed(0)
    ref = Net(avoid)
    held = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}

    def batch(g):
        return torch.randn(4 * dp, 5, 6, generator=g), torch.randn(4 * dp, 5, 3, generator=g)

    what = f"hand-written MoE dp={dp} ep=2 avoiding {avoid}"
    _train(model, ref, batch, what)
    _dp_step(model, ref, batch(torch.Generator().manual_seed(9)), f"{what}, one more")
    zero = {n: bool((p.grad == 0).all()) for n, p in model.named_parameters() if ".experts." in n}

    @annot.jit(model)
    def step(x, y):
        return model(x, y)

    return {
        "plan": step.explain(*batch(torch.Generator().manual_seed(1))),
        "held": held,
        "experts": model.report.experts,
        "num": model.module.moe.experts.num_experts,
        "zero": zero,
    }


def test_hand_written_moe_at_ep2_holds_half_the_experts(tmp_path):
    out = run_ranks(_hand_written, 2, str(tmp_path), 2, (), timeout=240)
    for rank, r in enumerate(out):
        assert (
            f"moe.experts: experts {2 * rank}-{2 * rank + 1} of 4 held here; its last call"
            in (r["plan"])
        )
        assert r["experts"] == ["moe.experts"]
        assert r["num"] == 2  # the count its forward loops over: this rank's
        assert r["held"] == {
            "module.moe.experts.w_in": (2, 12, 8),
            "module.moe.experts.b_in": (2, 12),
            "module.moe.experts.w_out": (2, 8, 12),
        }


def test_a_rank_whose_experts_no_token_chooses(tmp_path):
    # experts 2 and 3 (rank 1's) are never chosen: rank 1 receives no rows at all
    out = run_ranks(_hand_written, 2, str(tmp_path), 2, (2, 3), timeout=240)
    assert not any(out[0]["zero"].values())
    assert all(out[1]["zero"].values())


def _torch_moe(cache: str) -> None:
    os.environ["ANNOT_CACHE_DIR"] = cache
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import annot

    args = ModelArgs(
        n_layers=2, vocab_size=32, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0, num_experts=4
    )
    hints = {"layers.*.expert_layer.experts": annot.Experts()}  # every expert on every token
    model = annot.parallelize(Transformer, args, mesh=annot.Mesh(dp=2, ep=2), seed=0, hints=hints)
    torch.manual_seed(0)
    ref = Transformer(args)

    class Loss(nn.Module):  # the LM loss around the model and its reference alike
        def __init__(self, m):
            super().__init__()
            self.m = m

    def lm(m):
        def run(ids):
            logits = m(ids)
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        return run

    import torch.distributed as dist

    from tests.parity import assert_close, compare_grads, compare_state, step_both

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        loss = lm(model)(ids.chunk(2)[model.ctx.dp_rank])
        model.backward(loss)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        expected = sum(lm(ref)(part) / 2 for part in ids.chunk(2))
        expected.backward()
        assert_close(mean / 2, expected, f"torch MoE step {step}: loss")
        compare_grads(model, ref, f"torch MoE step {step}")
        step_both(opt, ref_opt)
    compare_state(model, ref, "torch MoE after 2 AdamW steps")


def test_torch_moe_transformer_dense_experts_at_ep2(tmp_path):
    run_ranks(_torch_moe, 2, str(tmp_path), timeout=240)
