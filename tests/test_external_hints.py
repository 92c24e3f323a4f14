"""A model the user cannot edit: hints from outside by module-path pattern,
given the class and its arguments or an already built instance; parity with
the single-device model on tp=2 and on pp=2 x tp=2."""

import pytest

from annot.testing import run_ranks

HINTS = "layers.*.attn.qkv", "layers.*.attn.out", "layers.*.attn", "layers.*.up", "layers.*.down"


def _run(mode: str, pp: int, tp: int, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from annot import Col, Local, Row, Vocab
    from tests.parity import assert_close, compare_grads, compare_state
    from tests.thirdparty_models import TinyLM

    hints = {
        "embed": Vocab(),
        "head": Col(),
        "layers.*.attn.qkv": Col(chunks=3),
        "layers.*.attn.out": Row(),
        "layers.*.attn": Local("num_heads", "dim"),
        "layers.*.ff.up": Col(),
        "layers.*.ff.down": Row(),
    }
    split = ["layers.2"] if pp > 1 else None
    mesh = annot.Mesh(pp=pp, tp=tp)
    if mode == "instance":
        torch.manual_seed(0)
        model = annot.parallelize(TinyLM(), mesh=mesh, hints=hints, split=split)
    else:
        model = annot.parallelize(TinyLM, mesh=mesh, hints=hints, split=split, seed=0)
    torch.manual_seed(0)
    ref = TinyLM()
    # The key bias has a true gradient of zero (softmax ignores a constant added to
    # every key): Adam's m / sqrt(v) turns its float noise into updates of ~lr
    # unless eps dominates the noise.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)

    @annot.jit(model, microbatches=2)
    def step(tokens, labels):
        _, loss = model(tokens, labels)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(2)
    for i in range(2):
        x, y = torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)
        loss = step(x, y).reduce_mean()
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{mode} step {i} loss")
        compare_grads(model, ref, f"{mode} step {i}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"{mode} after 2 steps")
    return True


@pytest.mark.parametrize("mode", ["class", "instance"])
def test_external_hints_tp2(mode, tmp_path):
    assert run_ranks(_run, 2, mode, 1, 2, str(tmp_path)) == [True, True]


@pytest.mark.slow
def test_external_hints_instance_pp2_tp2(tmp_path):
    assert run_ranks(_run, 4, "instance", 2, 2, str(tmp_path), timeout=300) == [True] * 4
