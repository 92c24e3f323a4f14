"""Which modules a pipeline stage holds (annot.runtime.pipeline.layout)."""

from __future__ import annotations

import torch
import torch.nn as nn

from annot.runtime.runners.stage_modules import (
    call_order_stage_modules,
    expand_module_paths,
    record_calls,
    stage_calls,
    with_aliases,
)
from tests.hf.test_models_gpt2 import LLAMA_KW


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**{**LLAMA_KW, "num_hidden_layers": 4}))


def test_a_block_of_another_stage_is_held_whole_by_that_stage():
    """A block's activation (no weights) goes with the stage that calls it, so on
    the other stage the whole block is one meta shadow, not a shell of
    placeholders around an activation the replay would run op by op."""
    model = _llama()
    boundaries = ("model.layers.2",)
    calls = stage_calls(
        record_calls(model, {"input_ids": torch.zeros(1, 5, dtype=torch.long)}), boundaries
    )
    held = call_order_stage_modules(model, boundaries, calls)
    for stage, other in ((0, 1), (1, 0)):
        mine = [f"model.layers.{i}" for i in ((0, 1), (2, 3))[stage]]
        for block in mine:
            assert f"{block}.mlp.act_fn" in held[stage]
            assert not any(p == block or p.startswith(block + ".") for p in held[other])
    assert "model.rotary_emb" in held[0]
    assert "model.rotary_emb" not in held[1]
    # without a probe: a block's activation goes with its block, a module
    # without weights that the shared forward calls (rotary table) everywhere
    blind = call_order_stage_modules(model, boundaries)
    assert "model.layers.0.mlp.act_fn" in blind[0]
    assert "model.layers.0.mlp.act_fn" not in blind[1]
    assert "model.layers.3.mlp.act_fn" in blind[1]
    assert "model.layers.3.mlp.act_fn" not in blind[0]
    assert all("model.rotary_emb" in blind[s] for s in (0, 1))
    # a boundary inside a block: the activation goes with its MLP's weights
    cut = call_order_stage_modules(model, ("model.layers.1.mlp",))
    assert [s for s in cut if "model.layers.1.mlp.act_fn" in cut[s]] == [1]
    assert [s for s in cut if "model.layers.1.mlp.down_proj" in cut[s]] == [1]


def test_the_call_order_probe_sees_weights_read_directly():
    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.table = nn.Embedding(4, 4)  # registered last, read first, never called

        def forward(self, x):
            x = x + self.table.weight.sum(0)
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta"):
        model = Reader()
    calls = record_calls(model, (torch.zeros(2, 4),))
    order = [c[0] for c in calls]
    assert order.index("table") < order.index("layers.0"), order
    held = call_order_stage_modules(model, ("layers.1",), stage_calls(calls, ("layers.1",)))
    assert "table" in held[0]
    assert "table" not in held[1]


def test_a_nested_splits_uses_are_read_relative_to_their_callee():
    """``model/layers[1:3]`` (a nested split's use) names ``model.layers.1-2``;
    ``model/config`` names no state, where ``model.config`` would keep the whole
    ``model`` (its longest prefix that names a module)."""
    m = _llama()
    assert expand_module_paths(m, ("model/layers[1:3]", "model/config")) == {
        "model.layers.1",
        "model.layers.2",
    }
    assert expand_module_paths(m, ("model.config",)) == {"model"}


def test_every_name_of_a_held_module_or_tied_weight_is_held():
    """T5-style: ``shared`` is never called, its weight is the embedding's; a
    module registered twice is held under both paths."""
    emb = nn.Embedding(4, 2)
    root = nn.Module()
    root.shared = emb
    root.enc = nn.Module()
    root.enc.embed = emb  # the same module under two paths
    root.dec = nn.Module()
    root.dec.embed = nn.Embedding(4, 2)
    root.dec.embed.weight = emb.weight  # a weight tied by the parameter
    root.head = nn.Linear(2, 2)
    held = with_aliases(root, {0: {"enc"}, 1: {"head"}})
    assert held == {0: {"enc", "enc.embed", "shared", "dec.embed"}, 1: {"head"}}
    # a module a stage holds keeps its own place, tied or not
    held = with_aliases(root, {0: {"enc"}, 1: {"dec", "head"}})
    assert held == {0: {"enc", "enc.embed", "shared"}, 1: {"dec", "dec.embed", "head"}}
