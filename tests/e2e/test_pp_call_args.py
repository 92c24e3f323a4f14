"""An argument of the model call that only the last stage reads (a target) is
taken from the call on the last stage's rank, not handed through the pipeline
(annot.runtime.runners.stage_runner.SourceRunner), and is still sent where taking it
would differ from the single-device run: a target that requires grad, or one
sharing memory with an input the first stage changes in place. Real gloo ranks;
loss, every gradient and every parameter after AdamW steps against the single
device; what each stage sent is recorded."""

import pytest

from annot.testing import run_ranks


def _sent_names(calls: list) -> set:
    return {k for obj in calls if isinstance(obj, dict) for k in obj}


def _target_run(pp: int, case: str, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    import annot.runtime.pipeline.messages as messages
    from tests.parity import assert_close, compare_grads, compare_state
    from tests.pipeline_models import Regression

    sent: list = []
    real_send = messages.send_pytree

    def recording_send(obj, *args, **kwargs):
        if kwargs.get("what") == "activations":
            sent.append(obj)
        return real_send(obj, *args, **kwargs)

    messages.send_pytree = recording_send
    kw = {"width": 8, "depth": 3, "bump": 0.25 if case == "aliased" else 0.0}
    split = ["blocks.1", "blocks.2"][: pp - 1]
    model = annot.parallelize(
        Regression, mesh=annot.Mesh(pp=pp), seed=0, split=split, runner="source", **kw
    )
    torch.manual_seed(0)
    ref = Regression(**kw)

    @annot.jit(model, microbatches=4)
    def step(x, y, weight):
        _, loss = model(x, y, weight=weight)
        model.backward(loss)
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        x = torch.randn(8, 8, generator=g)
        y = x if case == "aliased" else torch.randn(8, 8, generator=g)
        weight = torch.rand(8, 1, generator=g)
        if case == "y requires grad":
            y.requires_grad_(True)
        ref_x, ref_y = x.clone(), y.detach().clone().requires_grad_(y.requires_grad)
        if case == "aliased":
            ref_y = ref_x
        ref_losses = []
        for mx, my, mw in zip(ref_x.chunk(4), ref_y.chunk(4), weight.chunk(4)):
            _, loss = ref(mx, my, weight=mw)
            (loss / 4).backward()
            ref_losses.append(loss.detach())
        loss = step(x, y, weight).reduce_mean()
        assert_close(loss, torch.stack(ref_losses).mean(), f"{case} step {i}: loss")
        compare_grads(model, ref, f"{case} step {i}")
        if case == "y requires grad" and torch.distributed.get_rank() == 0:
            assert_close(y.grad, ref_y.grad, f"step {i}: the target's gradient on rank 0")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"{case} after 2 steps")
    return _sent_names(sent)


@pytest.mark.parametrize("pp", [2, 3])
def test_a_target_only_the_last_stage_reads_is_taken_from_its_call(tmp_path, pp):
    sent = run_ranks(_target_run, pp, pp, "plain", str(tmp_path))
    assert sent[0] == {"h"} if pp == 2 else {"x"}, sent  # stage 0 hands on its first value only
    assert all("y" not in names for names in sent), sent
    assert all("weight" not in names for names in sent), sent


@pytest.mark.parametrize("case", ["y requires grad", "aliased"])
def test_a_target_that_would_differ_is_sent(tmp_path, case):
    sent = run_ranks(_target_run, 2, 2, case, str(tmp_path))
    assert "y" in sent[0], sent
