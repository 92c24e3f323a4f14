"""The hints annot reads off a whole model's sources (:mod:`annot.plan.inferred_hints`),
on the meta device: per module, across modules (BERT: the attention's columns
in one module, its row in another), by structure (an ``nn.Sequential`` MLP),
written as the patterns a user writes, and the modules the first-call check runs."""

import pytest
import torch
import torch.nn as nn

from annot import Col, Local, Row
from annot.plan.inferred_hints import infer_hints


def test_bert_pairs_columns_and_rows_across_modules():
    pytest.importorskip("transformers")
    from tests.e2e.test_hf_tp_models import _build

    cls, cfg = _build("bert")
    with torch.device("meta"):
        found = infer_hints(cls(cfg))
    layer = "bert.encoder.layer.*"
    assert found.hints == {
        f"{layer}.intermediate.dense": Col(),
        f"{layer}.output.dense": Row(),
        f"{layer}.attention.self.key": Col(),
        f"{layer}.attention.self.query": Col(),
        f"{layer}.attention.self.value": Col(),
        f"{layer}.attention.output.dense": Row(),
    }
    assert found.splits[:2] == ["bert.encoder.layer.0", "bert.encoder.layer.0.attention"]


def test_x_transformers_style_gated_output_and_patterns():
    from tests.thirdparty_models import XLM

    found = infer_hints(XLM(gate_out=True))
    assert found.hints == {
        "blocks.*.attn.to_kv": Col(chunks=2),
        "blocks.*.attn.to_q": Col(),
        # the gated output's Linear, row-parallel at its first step (blocks differ in
        # the rest of the Sequential, so exact paths, not a pattern that would match it)
        "blocks.0.attn.to_out.0": Row(),
        "blocks.1.attn.to_out.0": Row(),
        "blocks.*.attn": Local("heads"),
    }


def test_an_mlp_by_its_structure():
    found = infer_hints(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4)))
    assert found.hints == {"0": Col(), "3": Row()}
    assert found.splits == [""]
    # a softmax between them mixes the sharded width: nothing split
    assert not infer_hints(nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 4))).hints
