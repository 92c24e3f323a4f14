"""Reading ``@shard`` / ``@stage`` hints from source (annot.rewriters.analysis.hint_reader),
never running it."""

from __future__ import annotations

import re

import pytest

from annot.core.errors import RewriteError
from annot.core.hints import ShardSpec, StageSpec
from annot.core.specs import Col, P, Replicate, Row, Vocab
from annot.rewriters.analysis.hint_reader import read_shard_hints, read_stage_hints
from tests.rewriters.tp.cases import dedent


def test_read_shard_hints_builds_specs():
    hints = read_shard_hints(
        dedent(
            """
            import annot as a
            from annot import shard, P

            @a.shard(c_attn=a.Col(chunks=3), c_proj=a.Row(), local=("n_head", "n_embd"))
            class Attn: pass

            @shard(wte=a.Vocab(), bias=a.Replicate(), w=P("tp", None), h=a.Col(gather=True), local="C")
            class GPT: pass

            class Plain: pass
            """
        )
    )
    assert hints == {
        "Attn": ShardSpec({"c_attn": Col(chunks=3), "c_proj": Row()}, ("n_head", "n_embd")),
        "GPT": ShardSpec(
            {"wte": Vocab(), "bias": Replicate(), "w": P("tp", None), "h": Col(gather=True)},
            ("C",),
        ),
    }


def test_read_stage_hints():
    hints = read_stage_hints(
        dedent(
            """
            import annot
            from annot import stage
            from annot.core.hints import stage as st

            @stage(split=["h.4", "h.8"], recompute=True)
            class A: pass

            @annot.stage(auto=True, cost="flops", memory="1KiB")
            class B: pass

            @st()
            class C: pass
            """
        )
    )
    assert hints == {
        "A": StageSpec(split=("h.4", "h.8"), recompute=True),
        "B": StageSpec(auto=True, cost="flops", memory=1024),
        "C": StageSpec(),
    }
    for bad, reason in [
        ('@stage(split=["h.4"], auto=True)', "either split=[...] or auto=True, not both"),
        ('@stage(cost="speed")', "expected 'time', 'flops' or 'params'"),
        ('@stage(memory="lots")', "expected bytes as an int or a string like '16GiB'"),
        ("@stage(splits=[])", "unknown argument splits=; @stage takes split=, auto=,"),
        ("@stage(split=SPLITS)", "SPLITS is not a literal"),
    ]:
        with pytest.raises(RewriteError, match=re.escape(reason)) as info:
            read_stage_hints(f"from annot import stage\n{bad}\nclass A: pass\n", "s.py")
        assert info.value.line == 2


def test_read_hints_refuses_duplicate_class_names():
    with pytest.raises(RewriteError, match="two classes named A carry @shard") as info:
        read_shard_hints(
            "from annot import shard\n@shard()\nclass A: pass\n@shard()\nclass A: pass\n"
        )
    assert (info.value.line, info.value.col) == (5, 7)
