"""Hint arguments as literals (annot.rewriters.source.hint_literals): read without running
the code, refused where they are not literals, written back as one line."""

from __future__ import annotations

import pytest

from annot.core.errors import RewriteError
from annot.core.hints import ShardSpec, StageSpec
from annot.core.specs import Col, P, Replicate, Vocab
from annot.rewriters.analysis.hint_reader import read_shard_hints, read_stage_hints
from annot.rewriters.source.hint_literals import format_hint
from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from tests.rewriters.tp.cases import HEAD, refusal


@pytest.mark.parametrize(
    "decorator, col, reason",
    [
        (
            "@shard(c=Col(chunks=N))",
            21,
            "@shard on M: argument c: N is not a literal; annot reads hints without running "
            "your code, so write the value itself (a number, a string, True/False/None, or a "
            "tuple of those)",
        ),
        (
            "@shard(c=make_spec())",
            10,
            "@shard on M: c=make_spec() is not a spec; write one of Col(), Row(), Vocab(), "
            "Replicate(), P(...), Partial(), Heads() or Experts() (imported from annot), e.g. c=Col()",
        ),
        (
            "@shard(c=Col)",
            10,
            "@shard on M: c=Col is a spec class, not a spec; write one of Col(), Row(), Vocab(), "
            "Replicate(), P(...), Partial(), Heads() or Experts() (imported from annot), e.g. c=Col()",
        ),
        (
            "@shard(c=Col(chunks=0))",
            10,
            "@shard on M: c=: Col(chunks=0): chunks must be an int >= 1",
        ),
        (
            "@shard(c=Col(chunk=3))",
            10,
            "@shard on M: c=Col(chunk=3): Col.__init__() got an unexpected keyword argument 'chunk'",
        ),
        (
            "@shard(c=P('tp', 'tp'))",
            10,
            "@shard on M: c=: P('tp', 'tp'): at most one dim may be split over 'tp'",
        ),
        (
            '@shard(local=("n_head", 3))',
            25,
            '@shard on M: local=("n_head", 3); expected a tuple of attribute or variable names, '
            'e.g. local=("n_head", "n_embd")',
        ),
        (
            '@shard(local=("config..n",))',
            15,
            "@shard on M: local=(\"config..n\",): 'config..n' has an empty part; a per-rank size "
            "is an attribute of the module or a local variable of its forward ('n_head'), or a "
            "dotted path of attributes from the module ('config.n_head': the module's "
            "self.config.n_head)",
        ),
        (
            "@shard(Col())",
            8,
            "@shard on M: positional argument 'Col()'; @shard takes keyword arguments only, "
            "e.g. @shard(c_fc=Col())",
        ),
        (
            "@shard(**HINTS)",
            8,
            "@shard on M: **-unpacking is not read; annot reads hints without running your "
            "code, so write each hint out as name=Spec(...)",
        ),
        (
            "@shard(c=Col(), c=Row())",
            17,
            "@shard on M: argument c= given twice",
        ),
        (
            "@shard",
            1,
            "@shard must be called with its hints, e.g. @shard(c_fc=Col(), c_proj=Row())",
        ),
    ],
)
def test_refuses_decorator_arguments_that_are_not_literals(decorator, col, reason):
    err = refusal(
        HEAD
        + decorator
        + "\nclass M(nn.Module):\n    def __init__(self):\n        self.c = nn.Linear(2, 2)\n"
    )
    assert (err.line, err.col) == (6, col)
    assert err.reason == reason


def test_a_call_in_a_hint_is_refused_and_never_run(tmp_path):
    sentinel = tmp_path / "ran"
    source = (
        HEAD
        + f"@shard(c=Col(chunks=open({str(sentinel)!r}, 'w').write('x')))\n"
        + "class M(nn.Module):\n    def __init__(self):\n        self.c = nn.Linear(2, 2)\n"
    )
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel(source, 2, path="model.py")
    assert (info.value.line, info.value.col) == (6, 21)
    assert "is not a literal; annot reads hints without running your code" in info.value.reason
    with pytest.raises(RewriteError):
        read_shard_hints(source, "model.py")
    assert not sentinel.exists()


def test_format_hint_round_trips():
    for spec in [
        ShardSpec({"c_attn": Col(chunks=3, gather=True), "w": P(None, "tp")}, ("n_head",)),
        ShardSpec({"wte": Vocab(), "x": Replicate()}, ("a", "b")),
        ShardSpec(),
    ]:
        source = f"from annot import shard, Col, Row, Vocab, Replicate, P\n{format_hint(spec)}\nclass M: pass\n"
        assert read_shard_hints(source) == {"M": spec}
    stage = StageSpec(split=("h.2",), cost="time", memory=100, recompute=True)
    assert read_stage_hints(f"import annot\n@annot.{format_hint(stage)[1:]}\nclass M: pass\n") == {
        "M": stage
    }
