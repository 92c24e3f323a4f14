"""Tensor-parallel GPT equals the single-device GPT: logits, loss, every
gradient and every parameter after 3 AdamW steps (real gloo ranks).

Hypothesis draws model configurations divisible by construction (the per-rank
size is drawn, then multiplied by tp), derandomized so every rank draws the
same examples; shrinking is off so the ranks stay in lockstep.
"""

import pytest

from annot.testing import run_ranks


def _parity_examples(tp: int, max_examples: int, cache: str) -> int:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    import annot
    from examples.gpt.model import GPT, GPTConfig
    from tests.parity import assert_close, compare_grads, compare_state, gather_last_dim

    ran = []

    @settings(
        derandomize=True,
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )
    @given(
        heads_per_rank=st.integers(1, 2),
        head_dim=st.sampled_from([4, 8]),
        n_layer=st.integers(1, 2),
        vocab_per_rank=st.integers(4, 24),
        batch=st.integers(1, 3),
        seq=st.integers(1, 8),
        bias=st.booleans(),
    )
    def check(heads_per_rank, head_dim, n_layer, vocab_per_rank, batch, seq, bias):
        n_head = heads_per_rank * tp
        cfg = GPTConfig(
            block_size=8,
            vocab_size=vocab_per_rank * tp,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_head * head_dim,
            dropout=0.0,
            bias=bias,
        )
        model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(tp=tp), seed=1)
        torch.manual_seed(1)
        ref = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(batch * 100 + seq)
        for step in range(3):
            x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
            y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
            if y.numel() > 1:
                y[0, 0] = -1  # ignore_index (never every target: the mean would be nan)
            logits, loss = model(x, y)
            model.backward(loss)
            ref_logits, ref_loss = ref(x, y)
            ref_loss.backward()
            what = f"tp={tp} {cfg} step {step}"
            assert_close(loss, ref_loss, f"{what}: loss")
            assert_close(gather_last_dim(logits, model.ctx.tp_group), ref_logits, f"{what}: logits")
            compare_grads(model, ref, what)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        compare_state(model, ref, f"tp={tp} {cfg} after 3 steps")
        ran.append(1)

    check()
    return len(ran)


def _non_divisible(cache: str) -> str:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=3, n_embd=48)
    try:
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(tp=2), seed=0)
    except annot.HintError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_tp_parity(tp, tmp_path):
    counts = run_ranks(_parity_examples, tp, tp, 6, str(tmp_path), timeout=400)
    assert counts == [6] * tp


@pytest.mark.slow
def test_gpt_tp4_parity(tmp_path):
    counts = run_ranks(_parity_examples, 4, 4, 3, str(tmp_path), timeout=500)
    assert counts == [3] * 4


def test_non_divisible_heads_refused(tmp_path):
    msgs = run_ranks(_non_divisible, 2, str(tmp_path))
    for m in msgs:
        assert m == (
            "@shard on CausalSelfAttention (at h.0.attn): local=('n_head', 'n_embd', 'C'): "
            "CausalSelfAttention.n_head=3 is not divisible by tp (2)"
        ), m


def test_seed_leaves_the_random_state_of_the_reference(tmp_path, monkeypatch):
    """parallelize(seed=) leaves torch's random state where
    ``torch.manual_seed(seed); GPT(cfg)`` leaves it, so dropout in replicated
    regions draws what the single-device run draws."""
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    monkeypatch.setenv("ANNOT_CACHE_DIR", str(tmp_path))
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
    torch.manual_seed(123)  # whatever came before
    annot.parallelize(GPT, cfg, seed=3)
    after = torch.random.get_rng_state()
    torch.manual_seed(3)
    GPT(cfg)
    assert torch.equal(after, torch.random.get_rng_state())


def _dropout_step(cache: str) -> float:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.2)
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # ranks start from different states
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(tp=2), seed=3, verify=True)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    _, loss = model(x, x)
    model.backward(loss)  # verify: replicated gradients agree over tp
    return loss.item()


def test_dropout_keeps_replicated_gradients_equal_over_tp(tmp_path):
    losses = run_ranks(_dropout_step, 2, str(tmp_path))
    assert losses[0] == losses[1]


def _dp2(cache: str) -> float:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig
    from tests.parity import compare_grads, compare_state

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(dp=2), seed=3)
    torch.manual_seed(3)
    ref = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        x = torch.randint(0, 32, (4, 8), generator=g)
        mine = x.chunk(2)[model.ctx.dp_rank]  # this replica's half of the batch
        _, loss = model(mine, mine)
        model.backward(loss)  # gradients averaged over dp
        _, ref_loss = ref(x, x)
        ref_loss.backward()
        compare_grads(model, ref, f"dp=2 step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, "dp=2 after 2 steps")
    return loss.item()


def test_dp2_averages_gradients(tmp_path):
    losses = run_ranks(_dp2, 2, str(tmp_path))
    assert losses[0] != losses[1]  # each replica saw its own half of the batch
