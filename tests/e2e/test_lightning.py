"""PyTorch Lightning around an annot model (``AnnotStrategy``) against the
same training on one device: loss at every step, every parameter after the
steps (AdamW, ``gradient_clip_val``); without the strategy, Lightning's DDP
around the model is refused before a step."""

from __future__ import annotations

import os

import pytest
import torch

from annot.testing import run_ranks

STEPS = 4


def _data(n: int = 32, seq: int = 8):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def _module(model, pipelined: bool):
    import lightning.pytorch as pl

    import annot

    class LitLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.losses: list[float] = []
            if pipelined:  # the step runs on annot's schedule
                self.automatic_optimization = False

                @annot.jit(model, microbatches=2)
                def step(batch):
                    loss = model(**batch).loss
                    model.backward(loss)
                    return loss

                self.step = step

        def training_step(self, batch, batch_idx):
            if not pipelined:
                loss = self.model(**batch).loss
                self.losses.append(loss.item())
                return loss
            loss = self.step(batch).reduce_mean()
            opt = self.optimizers()
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return LitLM()


def _fit(cache: str, mesh_kw: dict, strategy: bool):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import annot
    from annot.integrations.lightning import AnnotStrategy
    from tests.tiny_hf import tiny_llama

    cls, cfg, split = tiny_llama()
    mesh = annot.Mesh(**mesh_kw)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split if mesh.pp > 1 else None)
    lit = _module(model, mesh.pp > 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=mesh.size, strategy=AnnotStrategy() if strategy else "ddp",
        max_steps=STEPS, logger=False, enable_checkpointing=strategy, enable_progress_bar=False,
        default_root_dir=os.path.join(cache, "lightning"),
        enable_model_summary=False, gradient_clip_val=None if mesh.pp > 1 else 0.5,
    )  # fmt: skip
    if not strategy:
        with pytest.raises(annot.IntegrationError) as e:
            trainer.fit(lit, DataLoader(_data(), batch_size=4))
        return str(e.value)
    trainer.fit(lit, DataLoader(_data(), batch_size=4))
    state = model.full_state_dict()
    # the checkpoint Lightning saved holds the model in the single-device names
    saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    for k, v in state.items():
        assert torch.equal(saved["state_dict"][f"model.{k}"], v), k
    return lit.losses, state if model.ctx.rank == 0 else None


@pytest.mark.parametrize("mesh_kw", [{"tp": 2}, pytest.param({"pp": 2}, marks=pytest.mark.slow)])
def test_lightning_with_annot_strategy_equals_one_device(tmp_path, mesh_kw):
    from tests.e2e.test_hf_trainer import one_device_loop
    from tests.parity import assert_close

    # every label counts: the microbatches' means average to the batch's
    ref_losses, ref_state = one_device_loop(1, True, _data())
    losses, state = run_ranks(_fit, 2, str(tmp_path), mesh_kw, True)[0]
    assert len(losses) == STEPS
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * b, f"step {i}: {a} != {b}"
    for k, v in ref_state.items():
        assert_close(state[k], v, f"Lightning {mesh_kw}: {k}")


def test_lightning_ddp_around_an_annot_model_is_refused(tmp_path):
    said = run_ranks(_fit, 2, str(tmp_path), {"tp": 2}, False)[0]
    assert "DistributedDataParallel around an annot model" in said
    assert "AnnotStrategy" in said
