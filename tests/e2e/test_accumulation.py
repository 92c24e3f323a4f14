"""Gradient accumulation over steps (several ``step(batch)`` calls, or several
``model.backward`` calls, then one ``opt.step()`` and ``zero_grad()``)
against the single device accumulating over the same batches: every
gradient after the accumulation, every parameter after the optimizer step.

The gradients a step sums over ranks (a weight tied across pipeline stages,
a norm weight under sequence parallelism, partial on each tp rank) must add
only that step's parts: summing what earlier steps left there too counted
it once per rank (the tied GPT-2 embedding's gradient was off by its whole
first step)."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks
from tests.requires import fsdp_unused_params


def _model(arch: str):
    from tests.tiny_hf import tiny_gpt2, tiny_llama

    return tiny_gpt2() if arch == "gpt2" else tiny_llama(tied=True)


def _accumulate(cache: str, arch: str, mesh_kw: dict, options: dict, jit: bool):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import compare_grads, compare_state

    cls, cfg, split = _model(arch)
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(
        cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None, **options
    )
    torch.manual_seed(0)
    ref = cls(cfg)

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):  # three steps' gradients, one optimizer step
        ids = torch.randint(1, cfg.vocab_size, (4 * mesh.dp, 8), generator=g)
        mine = ids.chunk(mesh.dp)[model.ctx.dp_rank]
        if jit:
            step(mine)
        else:  # no pipeline: a backward per microbatch, as a plain loop does
            for part in mine.chunk(2):
                model.backward(model(part, labels=part).loss, scale=0.5)
        for part in ids.chunk(2 * mesh.dp):
            (ref(part, labels=part).loss / (2 * mesh.dp)).backward()
    compare_grads(model, ref, f"{arch} {mesh_kw} {options}: accumulated over 3 steps")
    opt.step()
    ref_opt.step()
    compare_state(model, ref, f"{arch} {mesh_kw} {options}: after the optimizer step")
    return True


@pytest.mark.parametrize(
    "arch, mesh_kw, options, jit",
    [
        ("gpt2", {"pp": 2}, {}, True),  # the tied weight summed over its stages
        pytest.param(  # norms summed over tp
            "llama", {"tp": 2}, {"sequence_parallel": True}, True, marks=pytest.mark.slow
        ),
        ("llama", {"tp": 2}, {"sequence_parallel": True}, False),  # model.backward each time
        pytest.param(
            "llama", {"pp": 2, "tp": 2}, {"sequence_parallel": True}, True,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "gpt2", {"pp": 2, "dp": 2}, {"fsdp": True}, True,
            marks=[pytest.mark.slow, fsdp_unused_params],
        ),
        pytest.param(
            "gpt2", {"pp": 2, "dp": 2}, {"overlap_grad_reduce": True}, True,
            marks=pytest.mark.slow,
        ),
    ],
)  # fmt: skip
def test_gradients_accumulated_over_steps_equal_one_device(tmp_path, arch, mesh_kw, options, jit):
    world = mesh_kw.get("pp", 1) * mesh_kw.get("tp", 1) * mesh_kw.get("dp", 1)
    args = (str(tmp_path), arch, mesh_kw, options, jit)
    assert all(run_ranks(_accumulate, world, *args, timeout=300))
