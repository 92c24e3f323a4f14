"""ZeRO-1 over dp (annot.zero_optimizer): optimizer state sharded over the dp
replicas, composed with tp and with pp. Against the single-device run: every
gradient each step and every parameter after AdamW steps, on every rank; and
each rank's optimizer state is its share, with nothing held twice."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks


def _zero(cache: str, tp: int, pp: int) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist

    import annot
    from examples.gpt.model import GPT, GPTConfig
    from tests.parity import compare_grads, compare_state, gpt_dp_step, gpt_step

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(dp=2, tp=tp, pp=pp), seed=3)
    torch.manual_seed(3)
    ref = GPT(cfg)
    opt = annot.zero_optimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert isinstance(opt, torch.distributed.optim.ZeroRedundancyOptimizer)
    step = gpt_step(model)

    g = torch.Generator().manual_seed(0)
    for i in range(3):
        x = torch.randint(0, 32, (8, 8), generator=g)
        gpt_dp_step(model, ref, step, x, 2, f"step {i}")
        compare_grads(model, ref, f"tp={tp} pp={pp} dp=2 step {i}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"tp={tp} pp={pp} dp=2 after 3 AdamW steps (ZeRO-1)")
    # memory: this rank's share of the state its parameters need, nothing twice
    mine = annot.state_bytes(opt)
    local = [p for p in model.parameters() if p.requires_grad]
    whole = sum(2 * p.numel() * 4 + 4 for p in local)  # AdamW: 2 fp32 moments + step
    both = torch.tensor(mine)
    dist.all_reduce(both, group=model.ctx.dp_group)
    assert both.item() == whole, (both.item(), whole)
    assert 0 < mine < whole
    return {"mine": mine, "whole": whole, "model": annot.state_bytes(ref_opt)}


@pytest.mark.slow  # 4 ranks
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_zero1_dp2_with_tp2_and_with_pp2(tmp_path, tp, pp):
    res = run_ranks(_zero, 4, str(tmp_path), tp, pp, timeout=300)
    total = res[0]["model"]  # the single-device optimizer state
    # each rank holds about total / (dp * tp * pp): at most twice that (tensors are whole)
    for r in res:
        assert r["mine"] <= 2 * total / 4, (r, total)
