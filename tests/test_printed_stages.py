"""What ``annot rewrite --pp`` prints runs, and computes what the model does.

The printed source is imported as a model and its stage methods are chained
in one process (stage k's returned dict is stage k + 1's keyword
arguments, as the pipeline passes them); the loss and every gradient equal
the unchanged model's. Two shapes of split: the root's forward (the repo's
GPT, ``--split h.2``, which ``parallelize`` runs by this source) and a
boundary in a nested forward (HF Llama, ``--split model.layers.2``: the
root's stage methods call the base model's), which ``parallelize`` runs by
replay instead; the printed form must still compute the same thing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from annot.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _printed(target: str, split: str, out: Path, package: str | None):
    """Run ``annot rewrite TARGET --pp 2 --split SPLIT -o OUT`` and import the
    file it wrote (inside ``package`` when its imports are relative)."""
    assert main(["rewrite", target, "--pp", "2", "--split", split, "-o", str(out)]) == 0
    (path,) = out.glob("*.py")
    name = f"{package}._annot_printed" if package else "_annot_printed_gpt"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _chain(model, **inputs):
    """Run the printed stage methods in order, each one's dict into the next."""
    carried = model._annot_stage_0(**inputs)
    return model._annot_stage_1(**carried)


def _compare(staged, ref, staged_loss, ref_loss):
    torch.testing.assert_close(staged_loss, ref_loss, rtol=1e-6, atol=1e-6)
    staged_loss.backward()
    ref_loss.backward()
    grads = dict(staged.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_printed_root_split_computes_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ANNOT_CACHE_DIR", str(tmp_path / "cache"))
    from examples.gpt.model import GPT, GPTConfig

    printed = _printed("examples/gpt/model.py", "h.2", tmp_path / "out", None)
    cfg = GPTConfig(n_layer=4, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    staged = printed.GPT(printed.GPTConfig(**vars(cfg)))
    staged.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (2, 16), generator=g)
    y = torch.randint(0, 64, (2, 16), generator=g)
    _, staged_loss = _chain(staged, idx=idx, targets=y)
    _, ref_loss = ref(idx, y)
    _compare(staged, ref, staged_loss, ref_loss)


def test_printed_nested_split_computes_the_model(tmp_path, monkeypatch):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.hf.test_models_gpt2 import LLAMA_KW

    monkeypatch.setenv("ANNOT_CACHE_DIR", str(tmp_path / "cache"))
    printed = _printed(
        "transformers.models.llama.modeling_llama:LlamaForCausalLM",
        "model.layers.2",
        tmp_path / "out",
        "transformers.models.llama",
    )
    cfg = LlamaConfig(**{**LLAMA_KW, "num_hidden_layers": 4})
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    staged = printed.LlamaForCausalLM(cfg)
    staged.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    staged_loss = _chain(staged, input_ids=ids, labels=ids, use_cache=False).loss
    ref_loss = ref(ids, labels=ids, use_cache=False).loss
    _compare(staged, ref, staged_loss, ref_loss)
