"""annot.build.stage_choice: the boundaries parallelize chooses, here under a memory
budget, without a sample: the same as ``annot plan --memory`` chooses (one
rule for the microbatch both assume, :func:`annot.plan.planner.assumed_sample`).

Single process: the planner runs before any rank starts.
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from annot.build.stage_choice import MemoryBudget, choose_boundaries
from annot.cli.main import main
from annot.plan.module_units import ModuleUnits
from annot.plan.planner import DEFAULT_SEQ_LEN, assumed_sample, plan
from annot.plan.stage_points import StagePoints

# a vocabulary large enough that the head's logits weigh on the stage holding it
LLAMA = {
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
TARGET = "transformers.models.llama.modeling_llama:LlamaForCausalLM"


def test_the_microbatch_assumed_without_a_sample():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    made, was_made = assumed_sample(model)
    assert was_made
    assert made["input_ids"].shape == (1, DEFAULT_SEQ_LEN)
    assert made["labels"] is made["input_ids"]  # the loss's saved tensors count
    assert assumed_sample(model, seq_len=16, microbatch_size=2)[0]["input_ids"].shape == (2, 16)
    given = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    assert assumed_sample(model, given) == (given, False)
    assert assumed_sample(torch.nn.Linear(2, 2)) == (None, False)  # no activations


def test_parallelize_and_annot_plan_fit_a_memory_budget_alike(capsys):
    argv = ["plan", TARGET, "--config-json", json.dumps(LLAMA), "--pp", "3"]
    assert main([*argv, "--memory", "36MiB", "--json"]) == 0
    printed = tuple(json.loads(capsys.readouterr().out)["boundaries"])
    with torch.device("meta"):
        ref = LlamaForCausalLM(LlamaConfig(**LLAMA))
    points = StagePoints(ref, LlamaForCausalLM, None)  # parallelize(memory=...) with no sample=
    budget = MemoryBudget.of("36MiB", None, False, 1)
    chosen = choose_boundaries(points, 3, budget=budget)
    assert chosen == printed == ("model.layers.2", "model.norm")  # 1 x 2048 tokens in flight
    # the weights alone fit the split balanced by parameters: not what fits the activations
    units = ModuleUnits.of(points)
    blind = plan(ref, 3, units=units, memory=budget.bytes, setup=budget.training)
    assert blind.boundaries == ("model.layers.2", "lm_head")
