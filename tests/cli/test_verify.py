"""``annot verify``: tp=2 on real gloo ranks against the single-device model,
from the command line. Good hints: every output and gradient equal. A head
count left global where forward reshapes with ``-1`` crashes nothing and
would be wrong: the pre-flight refuses it, and verify says so."""

from __future__ import annotations

from annot import Col, Local, Row, Vocab
from annot.cli.main import main

GOOD = {
    "embed": Vocab(),
    "blocks.*.attn.proj.*": Col(),
    "blocks.*.attn.out": Row(),
    "blocks.*.mlp.fc1": Col(),
    "blocks.*.mlp.fc2": Row(),
    "blocks.*.attn": Local("heads"),
}
HEADS_GLOBAL = {k: v for k, v in GOOD.items() if k != "blocks.*.attn"}

ARGS = [
    "verify",
    "tests/layer_styles_models.py:StyledLM",
    "--tp",
    "2",
    "--input",
    "ids=int64[2,6]:32",
    "--input",
    "targets=int64[2,6]:32",
    "--hints",
]


def test_verify_passes_good_hints_and_reports_a_refusal(capsys):
    assert main([*ARGS, f"{__file__}:GOOD"]) == 0
    out = capsys.readouterr().out
    assert "grad blocks.1.attn.proj.q.weight" in out
    assert out.rstrip().endswith(
        "all 39 checks equal the single-device run (rtol 0.0001, atol 1e-05)"
    )
    assert main([*ARGS, f"{__file__}:HEADS_GLOBAL"]) == 1
    out = capsys.readouterr().out
    assert "annot verify: refused: HintError: tp pre-flight: at tp=2, blocks.0.attn" in out
    assert "splits a tp shard into heads with .view(...)" in out


def test_verify_refuses_command_line_mistakes_before_any_rank(capsys):
    assert main(["verify", "tests/layer_styles_models.py:Nope", "--tp", "2"]) == 2
    assert "defines no class 'Nope'" in capsys.readouterr().err
    assert main([*ARGS[:2], "--tp", "1"]) == 2
    assert "--tp 1: verify compares tp >= 2" in capsys.readouterr().err
    assert main([*ARGS, f"{__file__}:ARGS"]) == 2
    assert "ARGS is not a dict of path patterns to specs" in capsys.readouterr().err
