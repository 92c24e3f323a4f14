"""``annot.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on the
single-device model (the total norm, and every gradient after clipping), at
tp=2, pp=2 (with the embedding tied to the head across stages) and tp2 x pp2.
``_clip(..., how="torch")`` calls torch's own on the model's parameters
instead (tests/training/test_clip_grad.py)."""

import pytest

from annot.testing import run_ranks


def _clip(cache: str, mesh_kw: dict, microbatches: int, how: str = "annot"):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig
    from tests.parity import assert_close, compare_grads

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(**mesh_kw), seed=3)
    torch.manual_seed(3)
    ref = GPT(cfg)

    @annot.jit(model, microbatches=microbatches)
    def step(x, y):
        _, loss = model(x, y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (4, 8), generator=g)
    norms = []
    for max_norm, norm_type in ((0.05, 2.0), (1e3, 2.0), (0.01, float("inf"))):
        step(x, x)
        _, ref_loss = ref(x, x)
        ref_loss.backward()
        if how == "annot":
            got = annot.clip_grad_norm_(model, max_norm, norm_type)
        else:  # torch's own, on this rank's parameters: the whole model's norm
            if max_norm == 0.05:  # a part of them is refused, before any gradient changes
                part = [p for n, p in model.named_parameters() if ".ln_" not in n]
                with pytest.raises(annot.AnnotError, match="leaves out .* parameters with a"):
                    torch.nn.utils.clip_grad_norm_(part, max_norm, norm_type)
            got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        assert_close(got, want, f"{mesh_kw} norm ({max_norm}, {norm_type})")
        compare_grads(model, ref, f"{mesh_kw} clipped grads ({max_norm}, {norm_type})")
        norms.append(got.item())
        model.zero_grad()
        ref.zero_grad()
    return norms


@pytest.mark.parametrize(
    "world, mesh_kw, microbatches, how",
    [
        (2, {"tp": 2}, 1, "annot"),
        (2, {"pp": 2}, 2, "annot"),
        pytest.param(4, {"tp": 2, "pp": 2}, 2, "annot", marks=pytest.mark.slow),
    ],
    ids=["tp2", "pp2", "tp2xpp2"],
)
def test_clip_grad_norm_equals_single_device(tmp_path, world, mesh_kw, microbatches, how):
    norms = run_ranks(_clip, world, str(tmp_path), mesh_kw, microbatches, how, timeout=400)
    assert all(n == norms[0] for n in norms)  # the same norm on every rank


def test_clip_grad_norm_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("ANNOT_CACHE_DIR", str(tmp_path))
    assert _clip(str(tmp_path), {}, 1)
