"""The Hugging Face Trainer around an annot model (``annot.hf.Trainer``)
against the single-device ``transformers.Trainer`` on the same data: the
loss at every logged step and every parameter after the steps (AdamW, a
linear schedule with warm-up, ``max_grad_norm``, gradient accumulation).

Every example differs (and some labels are masked, so that the token counts
the Trainer divides by differ per batch): data split over the wrong ranks, a
tp shard overwritten, a gradient averaged over ranks holding other shards or
a loss scaled by the wrong count each fail the comparison. Plain
``transformers.Trainer`` (through accelerate's DDP) is refused before a
step."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks

STEPS = 4


def _data(n: int = 48, seq: int = 8):
    import torch

    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 128, (seq,), generator=g)
        labels = ids.clone()
        labels[torch.rand(seq, generator=g) < 0.25] = -100  # token counts differ per batch
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _args(out: str, batch: int, **kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir=out, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=1e-2,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", max_grad_norm=0.5,
        gradient_accumulation_steps=2, warmup_steps=1, lr_scheduler_type="linear", seed=3,
        disable_tqdm=True,
    )  # fmt: skip
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _reference(out: str, batch: int, args_kw: dict):
    import torch
    from transformers import Trainer

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    model = cls(cfg)
    trainer = Trainer(model=model, args=_args(out, batch, **args_kw), train_dataset=_data())
    trainer.train()
    return _losses(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _annot(cache: str, out: str, mesh_kw: dict, options: dict, batch: int, args_kw: dict):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    import annot.hf
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(
        cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None, **options
    )
    trainer = annot.hf.Trainer(
        model=model, args=_args(out, batch, **args_kw), train_dataset=_data()
    )
    trainer.train()
    state = model.full_state_dict()
    return _losses(trainer), state if model.ctx.rank == 0 else None


def _compare(got, ref, what: str) -> None:
    from tests.parity import assert_close

    losses, state = got
    ref_losses, ref_state = ref
    assert len(losses) == len(ref_losses) == STEPS, (losses, ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{what}: loss at step {i}: {a} != {b}"
    for k, v in ref_state.items():
        assert_close(state[k], v, f"{what}: {k} after {STEPS} steps")


CASES = [
    ({"tp": 2}, {}),
    ({"pp": 2}, {}),
    pytest.param({"dp": 2, "tp": 2}, {}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "tp": 2}, {}, marks=pytest.mark.slow),
    pytest.param({"dp": 2, "tp": 2}, {"fsdp": True}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_kw, options", CASES)
def test_trainer_equals_the_single_device_trainer(tmp_path, mesh_kw, options):
    import annot

    mesh = annot.Mesh(**mesh_kw)
    batch = 4
    ref = run_ranks(_reference, 1, str(tmp_path / "ref"), batch * mesh.dp, {})[0]
    results = run_ranks(
        _annot,
        mesh.size,
        str(tmp_path / "cache"),
        str(tmp_path / "out"),
        mesh_kw,
        options,
        batch,
        {},
    )
    _compare(results[0], ref, f"annot.hf.Trainer {mesh_kw} {options}")
    # every rank logs the same losses (each the full batch's)
    for r, (losses, _) in enumerate(results):
        assert losses == results[0][0], f"rank {r} logged {losses}, rank 0 {results[0][0]}"
