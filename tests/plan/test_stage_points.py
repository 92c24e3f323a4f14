"""annot.plan.stage_points: the one answer to where a pipeline stage may begin, which
runner cuts there, and ``annot plan`` printing the boundaries and runner that
``parallelize`` builds with the same options (a nested Hugging Face model, an
``@stage(auto=True)`` class)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from annot.cli.main import main
from annot.core.errors import HintError
from annot.plan.stage_points import StagePoints, choose_runner
from annot.testing import run_ranks
from tests.nested_models import TimmStyleViT, XStyleSubclass
from tests.pipeline_models import Branchy, Marked

LLAMA = {
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


class Gated(nn.Module):
    """LlamaMLP's shape: ``up`` is called while ``gate``'s result waits on Python's stack."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.up = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])

    def forward(self, x):
        x = torch.relu(self.gate(x)) * self.up(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_the_places_a_stage_may_begin_and_why_not_elsewhere():
    points = StagePoints(Gated(), Gated, (torch.zeros(2, 4),))
    assert points.paths() == ["gate", "blocks.0", "blocks.1"]
    assert "no local variable holds it" in points.replay_refusal("up")
    assert points.replay_refusal("blocks") == "'blocks' is an nn.ModuleList, which is never called"
    assert points.replay_refusal("nope") == "'nope' names no submodule of Gated"
    with pytest.raises(HintError, match="pipeline boundary 'up': a stage cannot begin at that"):
        points.check(("up",), "replay")
    with pytest.raises(HintError, match="names an nn.ModuleList, which is never called"):
        points.check(("blocks",), "replay")
    with pytest.raises(HintError, match="'blocks.9' names no submodule of Gated"):
        points.check(("blocks.9",), "source")


class Layered(nn.Module):
    """x-transformers' layout: each layer a ModuleList of (norms, block), the
    norms a ModuleList too, called norm first."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleList([nn.LayerNorm(width)]), nn.Linear(width, width)])
            for _ in range(3)
        )
        self.empty = nn.ModuleList()

    def forward(self, x):
        for (norm,), block in self.layers:
            x = x + block(norm(x))
        return x


@pytest.mark.parametrize("probed", [True, False], ids=["call order", "registration order"])
def test_a_stage_given_at_a_container_begins_at_its_first_call(probed):
    points = StagePoints(Layered(), Layered, (torch.zeros(2, 4),) if probed else None)
    assert points.first_call("layers.1") == "layers.1.0.0"  # the norm, called first
    assert points.first_call("layers") == "layers.0.0.0"
    assert points.first_call("layers.1.1") == "layers.1.1"  # a call: itself
    assert points.first_call("empty") == "empty"  # nothing inside: refused as before
    with pytest.raises(HintError, match="'empty' names an nn.ModuleList, which is never called"):
        points.check(("empty",), "replay")


def test_the_source_runner_answers_with_its_reason_not_an_exception():
    branchy = StagePoints(Branchy(), Branchy)
    assert branchy.source_refusal(("blocks.2",)) is None
    assert branchy.source_paths(Branchy()) == ["shared", *(f"blocks.{i}" for i in range(4)), "head"]
    vit = StagePoints(TimmStyleViT(), TimmStyleViT)
    refusal = vit.source_refusal(("blocks.2",))
    assert refusal is not None
    assert "nested_models.py:" in refusal
    assert vit.source_refusal(("blocks.2",), nested=True) is None
    choice = choose_runner(vit, ("blocks.2",))  # the nested split cuts it
    assert choice.name == "source"
    assert choice.reason.startswith("the rewriter cuts TimmStyleViT.forward")
    sub = StagePoints(XStyleSubclass(), XStyleSubclass)
    refusal = sub.source_refusal(("layers.1.0",), nested=True)
    assert refusal is not None
    choice = choose_runner(sub, ("layers.1.0",))
    assert choice.name == "replay"
    assert choice.reason == f"the source split cannot cut there: {refusal}"
    assert choose_runner(branchy, ("blocks.2",)).name == "source"
    assert StagePoints(Marked(), Marked).markers() == 1
    assert choose_runner(StagePoints(Marked(), Marked), ()).name == "source"


@pytest.mark.parametrize(
    "flag, asked",
    [
        ({}, None),
        (
            {"output_hidden_states": True},
            "output_hidden_states=True (for @capture_outputs on LlamaModel.forward)",
        ),
        (
            {"return_dict": False},
            "return_dict=False (for @can_return_tuple on LlamaForCausalLM.forward)",
        ),
    ],
)
def test_auto_leaves_to_the_replay_what_the_config_asks_of_the_whole_call(flag, asked):
    """HF Llama cut between its blocks: the nested source split runs, unless
    the config asks a decorator that wraps a split forward's whole call for
    its outputs (every call would ask it): then the replay, which runs the
    model's own forward, and the reason names the flag and the decorator."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        ref = LlamaForCausalLM(LlamaConfig(**LLAMA, **flag))
    choice = choose_runner(StagePoints(ref, LlamaForCausalLM), ("model.layers.2",))
    if asked is None:
        assert choice.name == "source"
        assert "LlamaForCausalLM.forward, LlamaModel.forward" in choice.reason
    else:
        assert choice.name == "replay"
        assert choice.reason.startswith(f"the model's config asks {asked}: "), choice.reason


def _parallelize_boundaries(kind: str, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = annot.parallelize(
            LlamaForCausalLM, LlamaConfig(**LLAMA), mesh=annot.Mesh(pp=2), seed=0
        )
    else:
        from examples.gpt.model import GPT, GPTConfig

        model = annot.parallelize(GPT, GPTConfig(n_layer=4), mesh=annot.Mesh(pp=2), seed=0)
    return list(model.report.boundaries), model.report.runner, model.report.runner_reason


@pytest.mark.slow  # the table test below checks the boundaries line in the fast set
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_annot_plan_prints_the_plan_parallelize_builds(kind, capsys, tmp_path):
    if kind == "llama":
        argv = ["plan", "transformers.models.llama.modeling_llama:LlamaForCausalLM"]
        argv += ["--config-json", json.dumps(LLAMA)]
    else:
        argv = ["plan", "examples/gpt/model.py:GPT", "--init", "GPTConfig(n_layer=4)"]
    assert main([*argv, "--pp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    boundaries, runner, reason = run_ranks(_parallelize_boundaries, 2, kind, str(tmp_path))[0]
    assert doc["boundaries"] == boundaries
    assert doc["runner"] == {"name": runner, "reason": reason}
    assert runner == "source"  # llama: the nested split


def _parallelize_tables(kind: str, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        sample = {"input_ids": ids[:1]}  # as annot plan --input input_ids=int64[1,8]:64
        model = annot.parallelize(
            LlamaForCausalLM, LlamaConfig(**LLAMA), mesh=annot.Mesh(pp=2), seed=0, sample=sample
        )

        def loss_of(ids):
            return model(input_ids=ids, labels=ids).loss
    else:
        from examples.gpt.model import GPT, GPTConfig

        model = annot.parallelize(GPT, GPTConfig(n_layer=4), mesh=annot.Mesh(pp=2), seed=0)

        def loss_of(ids):
            return model(ids, ids)[1]

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = loss_of(ids)
        model.backward(loss)
        return loss

    return model.report.plan_table, step.explain(ids)


@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.slow), "gpt"])
def test_annot_plan_prints_the_table_parallelize_reports_and_explain_shows(kind, capsys, tmp_path):
    # one planner (annot.plan.planner.plan), one table: module units for the nested
    # Hugging Face model (replay), source segments for the @stage(auto=True) class
    if kind == "llama":
        argv = ["plan", "transformers.models.llama.modeling_llama:LlamaForCausalLM"]
        argv += ["--config-json", json.dumps(LLAMA), "--input", "input_ids=int64[1,8]:64"]
        argv += ["--cost", "params"]  # parallelize balances module units by parameters
    else:
        argv = ["plan", "examples/gpt/model.py:GPT", "--init", "GPTConfig(n_layer=4)"]
    assert main([*argv, "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert main([*argv, "--pp", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    table, explained = run_ranks(_parallelize_tables, 2, kind, str(tmp_path))[0]
    assert table is not None
    printed = out.splitlines()[1 : 1 + len(table.splitlines())]
    assert "\n".join(printed) == table
    assert "boundaries chosen by the planner:\n" + table in explained
    assert table.splitlines()[-1] == "boundaries: " + ", ".join(doc["boundaries"])
    what = "units" if kind == "llama" else "segments"
    assert f"in 2 stages over {len(doc['units'])} {what}" in table


class Reordered(nn.Module):
    """Registers ``late`` before ``early``, calls ``early`` first."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.late = nn.Linear(width, width)
        self.early = nn.Linear(width, width)
        self.last = nn.Linear(width, width)

    def forward(self, x):
        return self.last(self.late(self.early(x)))


@pytest.mark.parametrize(
    "boundary, refused", [("last", False), ("early", True)], ids=["agrees", "differs"]
)
def test_a_placement_in_registration_order_is_checked_on_the_first_call(boundary, refused):
    from annot.plan.stage_points import verify_call_order
    from annot.runtime.runners.stage_modules import call_order_stage_modules

    model = Reordered()
    held = call_order_stage_modules(model, (boundary,), None)  # no probe: registration order
    if not refused:
        verify_call_order(model, (boundary,), held, (torch.zeros(2, 4),), {})
        return
    # by registration, 'late' is on stage 0, but forward calls it after 'early' (stage 1)
    with pytest.raises(HintError, match=r"stage 1 \(from boundary 'early'\) calls or reads 'late'"):
        verify_call_order(model, (boundary,), held, (torch.zeros(2, 4),), {})
