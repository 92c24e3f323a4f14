"""annot.grad_scaler: loss scaling decides for every rank of a parallel model.
An overflow in one pipeline stage's gradients makes every stage skip the
step (torch's own GradScaler would skip it on that rank only, and the stages
would drift apart silently: shown here too); without one, every stage steps
exactly as the single-device model with its own scaler."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks


def _scaled_steps(cache: str, which: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import compare_state
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(pp=2), seed=0, split=split)
    torch.manual_seed(0)
    ref = cls(cfg)
    if which == "annot":
        scaler = annot.grad_scaler(model)
    else:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.zeros(()))  # its scale, on the ranks whose body stops early too
    ref_scaler = torch.amp.GradScaler("cpu")
    ref_scaler.scale(torch.zeros(()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(scaler.scale(loss))
        return loss

    g = torch.Generator().manual_seed(4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(torch.randint(1, 128, (4, 8), generator=g))
    if model.ctx.pp_rank == 1:  # an overflow in the last stage's gradients only
        next(p for p in model.parameters() if p.grad is not None).grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    stepped = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    if which != "annot":
        return stepped
    assert not stepped, "a stage stepped although another overflowed"
    ref_scaler.update(new_scale=scaler.get_scale())  # the reference skipped it too
    ids = torch.randint(1, 128, (4, 8), generator=g)
    step(ids)
    scaler.step(opt)
    scaler.update()
    for part in ids.chunk(2):
        ref_scaler.scale(ref(part, labels=part).loss / 2).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    compare_state(model, ref, "after an overflow skipped everywhere, then a step")
    return scaler.get_scale()


@pytest.mark.parametrize("which", ["annot", "torch"])
def test_an_overflow_in_one_stage_skips_the_step_on_every_stage(tmp_path, which):
    got = run_ranks(_scaled_steps, 2, str(tmp_path), which)
    if which == "torch":  # per rank: the stage without the overflow stepped alone
        assert got == [True, False]
    else:
        assert got[0] == got[1] == 2.0**15  # backed off once, on both
