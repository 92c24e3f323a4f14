"""``precision="bf16"``: bf16 autocast with float32 master weights, against the
single-device model run under the same autocast (real gloo ranks).

bf16 keeps 8 bits of mantissa, so a tp or pp run cannot equal the reference
bit for bit (row-parallel partial sums are rounded before they are summed).
The tolerance, written down once here, is relative to the error bf16 itself
makes: against the float32 model, annot's loss, every gradient and every
parameter after 3 SGD steps are no further off than ``SLACK`` times the
single-device bf16 run is (plus bf16 epsilon, 0.4%, of the tensor's norm); and at the first
step every gradient is within 3% of the single-device bf16 one. On one rank
the run equals autocast bit for bit.
"""

import pytest

from annot.testing import run_ranks

REL = 3e-2  # first step, per tensor: ||annot - bf16 reference|| <= REL * ||reference||
SLACK = 2.0  # ||annot - fp32|| <= SLACK * ||bf16 reference - fp32|| + FLOOR * ||fp32||
FLOOR = 4e-3  # bf16 epsilon (2**-8) of the tensor norm


def test_precision_names_are_checked():
    from annot import HintError
    from annot.runtime.precision import parse_precision

    assert parse_precision(None) is None
    assert parse_precision("fp32") is None
    import torch

    assert parse_precision("bf16") is torch.bfloat16
    with pytest.raises(HintError, match=r"precision='fp16' \(fp16 needs loss scaling; use bf16\)"):
        parse_precision("fp16")


def _close(a, b, what, rel=REL):
    err = (a.float() - b.float()).norm().item()
    scale = b.float().norm().item()
    assert err <= rel * max(scale, 1e-6), f"{what}: |diff| {err:.3e} > {rel} * |ref| {scale:.3e}"


def _as_close_as_bf16(annot_t, bf16_t, fp32_t, what):
    """annot in bf16 is no further from the fp32 run than plain bf16 is."""
    mine = (annot_t.float() - fp32_t).norm().item()
    theirs = (bf16_t.float() - fp32_t).norm().item()
    bound = SLACK * theirs + FLOOR * fp32_t.norm().item()
    assert mine <= bound, (
        f"{what}: |annot - fp32| {mine:.3e} > bound {bound:.3e} (bf16 {theirs:.3e})"
    )


def _bf16_parity(cache, mesh_kw, microbatches):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=4, n_head=4, n_embd=32, dropout=0.0)
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(GPT, cfg, mesh=mesh, seed=7, precision="bf16")
    torch.manual_seed(7)
    ref = GPT(cfg)  # single-device, bf16 autocast
    torch.manual_seed(7)
    exact = GPT(cfg)  # single-device, float32
    seen = set()
    for m in model.modules():
        if type(m).__name__.endswith("Linear"):  # nn.Linear and annot's tp layers
            m.register_forward_hook(lambda mod, i, o: seen.add(o.dtype))

    @annot.jit(model, microbatches=microbatches)
    def step(x, y):
        _, loss = model(x, y)
        model.backward(loss)
        return loss

    # SGD: its update is linear in the gradient. Adam's divides by sqrt(v), which turns
    # bf16 noise on near-zero gradients into full-size steps of either sign.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref, exact)]
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
        y = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
        loss = step(x, y).reduce_mean()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, ref_loss = ref(x, y)
        ref_loss.backward()
        _, exact_loss = exact(x, y)
        exact_loss.backward()
        _as_close_as_bf16(loss, ref_loss, exact_loss.detach(), f"step {i} loss")
        grads = model.full_grads()
        bf16_grads = dict(ref.named_parameters())
        for k, p in exact.named_parameters():
            _as_close_as_bf16(grads[k], bf16_grads[k].grad, p.grad, f"step {i} grad {k}")
            if i == 0:
                _close(grads[k], bf16_grads[k].grad, f"step 0 grad {k} vs bf16")
        assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights"
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        for o in opts:
            o.step()
            o.zero_grad()
    full = model.full_state_dict()
    bf16_state = ref.state_dict()
    for k, v in exact.state_dict().items():
        _as_close_as_bf16(full[k], bf16_state[k], v, f"after 3 steps: {k}")
    return sorted(str(d) for d in seen)


@pytest.mark.parametrize(
    "mesh_kw, microbatches", [({"tp": 2}, 1), ({"pp": 2}, 2)], ids=["tp2", "pp2"]
)
def test_bf16_parity(tmp_path, mesh_kw, microbatches):
    seen = run_ranks(_bf16_parity, 2, str(tmp_path), mesh_kw, microbatches, timeout=300)
    assert seen == [["torch.bfloat16"]] * 2  # every rank's linear layers ran in bf16


def _bf16_one_rank_is_exact(cache):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(), seed=7, precision="bf16")
    torch.manual_seed(7)
    ref = GPT(cfg)
    x = torch.randint(0, 64, (4, 8))
    _, loss = model(x, x)
    model.backward(loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref_loss = ref(x, x)
    ref_loss.backward()
    assert loss.item() == ref_loss.item()
    grads = model.full_grads()
    for k, p in ref.named_parameters():
        assert torch.equal(grads[k], p.grad), k


def test_bf16_on_one_rank_equals_autocast_exactly(tmp_path):
    _bf16_one_rank_is_exact(str(tmp_path))
