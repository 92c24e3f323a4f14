"""``annot hints``: the tp hints read off a model's sources, printed as the
dict a user writes (and that dict, run, is what the reading found)."""

from __future__ import annotations

import runpy

from annot.cli.main import main


def test_prints_the_hints_as_python(capsys, tmp_path):
    assert main(["hints", "tests/nested_models.py:TimmStyleViT"]) == 0
    out = capsys.readouterr().out
    assert "'blocks.*.attn.qkv': Col(chunks=3)," in out
    assert "'blocks.*.attn': Local('heads', 'C')," in out
    path = tmp_path / "hints.py"
    assert main(["hints", "tests/nested_models.py:TimmStyleViT", "-o", str(path)]) == 0
    hints = runpy.run_path(str(path))["HINTS"]  # the file runs: the dict to keep
    from annot import Col, Row

    assert hints["blocks.*.mlp.fc1"] == Col()
    assert hints["blocks.*.mlp.fc2"] == Row()


def test_says_what_stays_whole_and_why(capsys):
    assert main(["hints", "tests/nested_models.py:TorchvisionStyleResNet"]) == 1
    out = capsys.readouterr().out
    assert "# left whole:" in out
    # (forward calls _forward_impl, read where called: the classifier's logits are returned)
    assert "self.fc: left whole: its output is returned, and no caller gives it to a Linear" in out


def test_a_command_line_mistake(capsys):
    assert main(["hints", "tests/nested_models.py:NoSuchModel"]) == 2
    assert "defines no class 'NoSuchModel'" in capsys.readouterr().err
