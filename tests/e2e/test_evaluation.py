"""Evaluation of a parallel model between training steps: a step called under
``torch.no_grad()`` (or ``@annot.jit(..., forward_only=True)``) runs the
forward of every microbatch only. Its loss equals the single-device eval
loss; the gradients of the training step before it are left as they were
(no backward, no second reduction of tied weights' sums); training goes on
exactly. A training step called under ``torch.no_grad()`` by mistake is
refused, as ``loss.backward()`` is there: skipping its ``model.backward``
would train nothing, silently. ``forward_only=True`` skips it (Megatron's
convention: one step function for training and evaluation)."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks
from tests.requires import fsdp_unused_params


def _evaluate(cache: str, mesh_kw: dict, explicit: bool, fsdp: bool = False):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import assert_close, compare_grads, compare_state
    from tests.tiny_hf import tiny_gpt2

    GPT2LMHeadModel, cfg, pp_split = tiny_gpt2()
    mesh = annot.Mesh(**mesh_kw)
    split = pp_split if mesh.pp > 1 else None
    model = annot.parallelize(GPT2LMHeadModel, cfg, mesh=mesh, seed=0, split=split, fsdp=fsdp)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)

    @annot.jit(model, microbatches=2)
    def train_step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    @annot.jit(model, microbatches=2, forward_only=explicit)
    def eval_step(ids):
        loss = model(ids, labels=ids).loss
        if explicit:  # forward_only=True skips it: one step function for both
            model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(4)
    ids, held_out = (torch.randint(1, 128, (4 * mesh.dp, 8), generator=g) for _ in range(2))
    train_step(ids.chunk(mesh.dp)[model.ctx.dp_rank])
    for part in ids.chunk(2 * mesh.dp):
        (ref(part, labels=part).loss / (2 * mesh.dp)).backward()
    compare_grads(model, ref, "after the training step")

    model.eval()
    ref.eval()
    if explicit:  # forward_only=True: no backward though gradients are on, or off
        val = eval_step(held_out[:4]).reduce_mean()
        with torch.no_grad():
            assert_close(eval_step(held_out[:4]).reduce_mean(), val, "forward_only under no_grad")
    else:
        with torch.no_grad():
            val = eval_step(held_out[:4]).reduce_mean()
    with torch.no_grad():
        ref_val = sum(ref(p, labels=p).loss for p in held_out[:4].chunk(2)) / 2
    assert_close(val, ref_val, "eval loss")
    compare_grads(model, ref, "the training step's gradients, after the evaluation")
    model.train()
    ref.train()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    compare_state(model, ref, "after the optimizer step")

    with torch.no_grad():  # a training step called where gradients are off
        try:
            train_step(ids[:4])
        except annot.AnnotError as err:
            return str(err)
    return "ran"


@pytest.mark.parametrize(
    "mesh_kw, explicit",
    [
        ({"pp": 2}, False),  # a tied weight across the stages: summed once
        pytest.param({"pp": 2}, True, marks=pytest.mark.slow),
        pytest.param({"tp": 2}, False, marks=pytest.mark.slow),  # no pipeline
        pytest.param(  # FSDP2 in a pipeline: its units gathered for the evaluation too
            {"pp": 2, "dp": 2}, False, marks=[pytest.mark.slow, fsdp_unused_params]
        ),
    ],
)
def test_evaluation_between_training_steps(tmp_path, mesh_kw, explicit):
    world = mesh_kw.get("pp", 1) * mesh_kw.get("tp", 1) * mesh_kw.get("dp", 1)
    fsdp = mesh_kw.get("dp", 1) > 1
    errors = run_ranks(_evaluate, world, str(tmp_path), mesh_kw, explicit, fsdp, timeout=300)
    for err in errors:
        assert "model.backward(loss) in a step called under torch.no_grad()" in err or (
            mesh_kw.get("pp") and "rank 1 (stage 1) failed" in err  # the last stage refused
        ), err
