"""Which modules a replayed pipeline stage holds (annot.runtime.stages)."""

from __future__ import annotations

import torch
import torch.nn as nn

from annot.runtime.stages import call_order_stage_modules, record_calls, stage_calls
from tests.test_hf_gpt2 import LLAMA_KW


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
