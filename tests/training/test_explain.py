"""``train_step.explain(...)`` shows every pipeline: the runner that cuts it,
each stage's owner, modules and what it sends, the tied weights, the schedule
table and this rank's code, for a source-split model (the example GPT) and
transformers' Llama cut inside ``LlamaModel.forward`` (by the nested source
split and by the replay), on real gloo ranks, before and after a step."""

from __future__ import annotations

import re

import pytest

from annot.testing import run_ranks
from annot.training.explain import held_units, runs_of_blocks


def _rows(text: str) -> dict[str, list[str]]:
    """The stage table's rows by stage index, columns split on runs of 2+ spaces."""
    head = text.index("stage  rank  modules")
    lines = text[head:].splitlines()[2:]
    rows = {}
    for line in lines:
        if not re.match(r"^\d+\s+pp\d", line):
            break
        cells = re.split(r"\s{2,}", line)
        rows[cells[0]] = cells
    return rows


def _llama_explain(runner: str = "replay") -> tuple[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import annot

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = annot.parallelize(
        LlamaForCausalLM,
        cfg,
        mesh=annot.Mesh(pp=2),
        seed=0,
        split=["model.layers.1"],
        runner=runner,  # "auto": the nested source split
    )

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    before = step.explain(ids)
    step(ids)
    return before, step.explain(ids)


def test_explain_a_replayed_pipeline():
    for rank, (before, after) in enumerate(run_ranks(_llama_explain, 2)):
        for text in (before, after):
            assert "pipeline: 2 stages, boundaries ['model.layers.1'], schedule 1f1b" in text
            assert "runner: replay (" in text
            rows = _rows(text)
            assert rows["0"][1:3] == [
                "pp0",
                "model.embed_tokens, model.layers.0, model.rotary_emb, lm_head",
            ]
            assert rows["1"][1:4] == ["pp1", "model.layers[1:4], model.norm, lm_head", "(returns)"]
            assert rows["0"][3].startswith("tensors live at model.layers.1's call")
            held = rows[str(rank)][-2]
            assert held != "-"
            assert int(held.replace(",", "")) > 0
            assert rows[str(1 - rank)][-2:] == ["-", "-"]
            # fp32 with AdamW: weights = gradients, and the state twice that (+ steps)
            weights, grads, state = rows[str(rank)][-1].split(" + ")
            assert weights == grads
            assert weights.endswith("KiB")
            assert float(state.split()[0]) >= 2 * float(weights.split()[0])
            assert (
                "tied weight model.embed_tokens.weight = lm_head.weight held by stages [0, 1]"
                in text
            )
            assert "rank 0 | F0 F1 .  B0 .  B1" in text  # the schedule table
            assert (
                f"--- stage {rank} (this rank) ---\nLlamaForCausalLM.forward runs unchanged" in text
            )
        if rank == 0:  # the hidden state of a microbatch (2 rows of 8 tokens) crossed
            assert "(shapes after the first step)" in before
            assert "model.layers.1's call: float32[2, 8, 32]" in after


def test_explain_a_nested_source_split_pipeline():
    """The same model and boundary with runner= left out: the build runs the
    nested source split (LlamaForCausalLM's and LlamaModel's stage methods)
    and explain says so, with the modules each stage holds."""
    for rank, (before, after) in enumerate(run_ranks(_llama_explain, 2, "auto")):
        for text in (before, after):
            assert (
                "runner: source split (the root forward cut into stage methods by the rewriter, "
                "and LlamaModel.forward with it; the code below is what runs)"
            ) in text
            assert (
                "runner chosen at build: the rewriter cuts LlamaForCausalLM.forward, "
                "LlamaModel.forward at these boundaries (the nested split"
            ) in text
            rows = _rows(text)
            assert rows["0"][1:4] == [
                "pp0",
                "model.embed_tokens, model.layers.0, model.rotary_emb",
                "_annot_model, logits_to_keep, labels, kwargs",
            ]
            assert rows["1"][1:4] == ["pp1", "model.layers[1:4], model.norm, lm_head", "(returns)"]
            # this rank's stage method, with the forward's decorators (transformers' own)
            section = text.split(f"--- stage {rank} (this rank) ---\n", 1)[1]
            assert f"def _annot_stage_{rank}(" in section.split("\n\n", 1)[0], section[:400]
            assert f"self.model._annot_stage_{rank}(" in text
            assert "# (the stage methods of LlamaModel.forward it calls" in text


def _gpt_explain(cache: str) -> str:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    model = annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=2), seed=3)

    @annot.jit(model, microbatches=2)
    def step(x, y):
        _, loss = model(x, y)
        model.backward(loss)
        return loss

    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    return step.explain(x, x)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_explain_a_source_split_pipeline(tmp_path):
    for rank, text in enumerate(run_ranks(_gpt_explain, 2, str(tmp_path))):
        assert "runner: source split (" in text
        rows = _rows(text)
        assert rows["0"][1:4] == ["pp0", "config.block_size, wte, wpe, drop, h[0:2]", "x, targets"]
        assert rows["1"][1:4] == ["pp1", "h[2:], ln_f, lm_head", "(returns)"]
        assert "tied weight wte.weight = lm_head.weight held by stages [0, 1]" in text
        assert "boundaries chosen by the planner:" in text
        assert f"--- stage {rank} (this rank) ---\ndef _annot_stage_{rank}(self" in text


def test_stage_modules_shown_as_the_outermost_modules_a_stage_holds():
    mine = {"m.layers.0.attn.q", "m.layers.0.mlp.fc", "m.layers.1.norm", "m.emb", "m.rope"}
    others = {"m.layers.2.attn.q", "m.norm", "m.rope"}
    assert held_units(mine, others) == {"m.layers.0", "m.layers.1", "m.emb", "m.rope"}
    order = ["m.emb", "m.layers.0", "m.layers.1", "m.layers.3", "m.rope"]
    assert runs_of_blocks(order) == ["m.emb", "m.layers[0:2]", "m.layers.3", "m.rope"]
