"""Unit costs of the automatic pipeline split (annot.module_plan): forward and
backward are measured where they happen, not guessed as forward x 3."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from annot.module_plan import plan_module_boundaries

NAP = 0.03  # seconds; far above this machine's timer noise


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(NAP)
        return g


class Glue(nn.Module):
    """Forward-only work (a mask, a table) before its weights' op: no backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(NAP)
        return self.lin(x)


class BackwardHeavy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _SlowBackward.apply(self.lin(x))


def test_forward_only_glue_and_backward_heavy_units_are_measured_where_they_run():
    model = nn.Sequential(Glue(), BackwardHeavy(), nn.Linear(4, 4))
    plan = plan_module_boundaries(model, 2, sample=torch.randn(2, 4), cost="time", repeats=3)
    costs = dict(zip((u.path for u in plan.units), plan.costs))
    # forward x 3 would make the glue 3 naps and the backward-heavy unit ~0
    assert costs["1"] >= NAP * 0.9
    assert costs["0"] < NAP * 2
    assert plan.boundaries == ["1"]
