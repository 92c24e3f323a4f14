"""Which assignments reach a read (annot.rewriters.tp.reaching), seen through the
sharded values the tensor-parallel rewrite follows to the loss."""

from __future__ import annotations

import textwrap

import pytest

from annot.rewriters.tp.rewrite import rewrite_tensor_parallel

_FLOW_HEAD = """import torch.nn as nn
import torch.nn.functional as F
from annot import shard, Col


@shard(lm_head=Col())
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8)

    def forward(self, x, y, t):
"""


@pytest.mark.parametrize(
    "body, rewritten",
    [
        # both branches sharded
        ("if t:\n    z = self.lm_head(x)\nelse:\n    z = self.lm_head(x[:, [-1]])", True),
        # the later assignment on the straight-line path decides
        ("z = post(x)\nz = self.lm_head(x)", True),
        ("z = self.lm_head(x)\nz = post(z)", False),
        # only one branch sharded: not provable, left alone
        ("z = post(x)\nif t:\n    z = self.lm_head(x)", False),
        # x = x.float() in a loop keeps it sharded
        ("z = self.lm_head(x)\nwhile t:\n    z = z.float()", True),
    ],
)
def test_names_follow_the_assignments_that_reach_the_loss(body, rewritten):
    lines = textwrap.indent(body + "\nreturn F.cross_entropy(z, y)\n", " " * 8)
    out = rewrite_tensor_parallel(_FLOW_HEAD + lines, 2, path="model.py")
    assert ("return vocab_parallel_cross_entropy(z, y)" in out) is rewritten
    compile(out, "model.py", "exec")


def test_an_assignment_later_in_a_loop_reaches_the_loss():
    body = "z = self.lm_head(x)\nfor i in t:\n    loss = F.cross_entropy(z, y)\n    z = post(z)\n"
    out = rewrite_tensor_parallel(
        _FLOW_HEAD + textwrap.indent(body + "return loss\n", " " * 8), 2, path="model.py"
    )
    assert "loss = F.cross_entropy(z, y)" in out
