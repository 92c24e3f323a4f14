"""The automatic pipeline split (``sample=``) on the models users bring: an
instance with real weights (as ``from_pretrained`` gives), a model that
checkpoints activations in its own forward (``torch.utils.checkpoint``), a
block registered under two names; each trains as on one device (loss, every
gradient, parameters after two AdamW steps)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as activation_checkpoint

from annot.testing import run_ranks
from tests.e2e.test_module_hooks import Block, Net


class CheckpointedNet(Net):
    """Checkpoints every block's activations in its own forward."""

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = activation_checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


class SharedNet(nn.Module):
    """A block registered under two names, called under the second (the
    first is the one ``named_modules()`` keeps), with P hints on its
    parameters."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        middle = Block(d)
        self.middle = middle  # the same module as blocks.1
        self.blocks = nn.ModuleList([Block(d), middle, Block(d)])
        self.out = nn.Linear(d, d)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train(cache: str, which: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import train_mse_against_reference

    sample = (torch.randn(2, 5, 16),)
    torch.manual_seed(0)
    ref = {"instance": Net, "checkpointed": CheckpointedNet, "shared": SharedNet}[which]()
    mesh = annot.Mesh(pp=2)
    if which == "instance":
        torch.manual_seed(0)
        model = annot.parallelize(Net(), mesh=mesh, sample=sample)
    elif which == "shared":
        from annot import P

        hints = {"middle.fc1.weight": P(None, None), "blocks.1.fc2.bias": P(None)}
        model = annot.parallelize(SharedNet, mesh=mesh, seed=0, sample=sample, hints=hints)
    else:
        model = annot.parallelize(CheckpointedNet, mesh=mesh, seed=0, sample=sample)
    assert model.pipeline.num_stages == 2

    train_mse_against_reference(model, ref, which)
    return model.pipeline.boundaries


@pytest.mark.parametrize("which", ["instance", "checkpointed", "shared"])
def test_automatic_split_with_sample(tmp_path, which):
    boundaries = run_ranks(_train, 2, str(tmp_path), which)
    assert boundaries[0] == boundaries[1]
    if which == "shared":  # a stage begins where forward calls it, under that name
        assert "middle" not in boundaries[0], boundaries[0]


def _hf_checkpointed(cache: str):
    """A transformers model loaded as an instance with its own activation
    checkpointing on, split automatically from a sample."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import assert_close, compare_grads
    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    torch.manual_seed(0)
    ref = cls(cfg)
    ref.gradient_checkpointing_enable()
    torch.manual_seed(0)
    inst = cls(cfg)
    inst.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 8))
    model = annot.parallelize(inst, mesh=annot.Mesh(pp=2), sample={"input_ids": ids, "labels": ids})

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(2))
    loss = step(ids).reduce_mean()
    ref_loss = sum(ref(input_ids=p, labels=p).loss / 2 for p in ids.chunk(2))
    ref_loss.backward()
    assert_close(loss, ref_loss, "gradient-checkpointed Llama: loss")
    compare_grads(model, ref, "gradient-checkpointed Llama")
    return True


def test_automatic_split_of_a_checkpointing_transformers_instance(tmp_path):
    assert all(run_ranks(_hf_checkpointed, 2, str(tmp_path)))
