"""Helpers of the tensor-parallel rewriter's tests (test_tensor_parallel.py and
the test_tp_*.py, test_hint_*.py files): a before/after check that also compiles
the output and checks it is a fixed point, and a refusal with its position."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from annot.core.errors import RewriteError
from annot.rewriters.source.diagnostics import unified_diff
from annot.rewriters.tp.rewrite import rewrite_tensor_parallel

FIXTURE = Path(__file__).parents[2] / "fixtures" / "gpt_model.py"


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def assert_rewrite(before: str, after: str, tp: int = 2, **kwargs) -> str:
    before, after = dedent(before), dedent(after)
    out = rewrite_tensor_parallel(before, tp, path="model.py", **kwargs)
    assert out == after, "\n" + unified_diff(after, out, "expected", "got")
    compile(out, "model.py", "exec")
    assert rewrite_tensor_parallel(out, tp, path="model.py", **kwargs) == out  # idempotent
    return out


def refusal(source: str, tp: int = 2, **kwargs) -> RewriteError:
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel(dedent(source), tp, path="model.py", **kwargs)
    err = info.value
    assert str(err) == f"model.py:{err.line}:{err.col}: {err.reason}"
    return err


HEAD = """import torch.nn as nn
from torch import nn as tnn
from annot import shard, Col, Row, Vocab, P


"""
