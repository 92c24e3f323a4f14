"""Models for benchmarks/pp.py: one class each, run by annot and by
torch.distributed.pipelining on the same split."""

import time

import torch
import torch.nn as nn
from torch.nn import functional as F


class ResidualMLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class MLPStack(nn.Module):
    """A residual MLP stack with a regression loss (tensor in, tensor out)."""

    def __init__(self, width=256, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualMLP(width) for _ in range(depth)])
        self.head = nn.Linear(width, width)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out, F.mse_loss(out, y)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepBlock(nn.Module):
    """A stage of fixed cost: sleeps ``fwd_ms`` forward and ``bwd_ms`` backward
    (so the measurement is of the schedule, not of 2 shared CPU cores), of
    which ``w_ms`` on the path to its weight only (a zero-bubble schedule's
    W; the rest is on the input's path, its I)."""

    def __init__(self, fwd_ms=20.0, bwd_ms=40.0, w_ms=0.0):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.fwd_s, self.bwd_s, self.w_s = fwd_ms / 1000, bwd_ms / 1000, w_ms / 1000

    def forward(self, x):
        scale = _Sleep.apply(self.scale, 0.0, self.w_s) if self.w_s else self.scale
        return _Sleep.apply(x * scale, self.fwd_s, self.bwd_s - self.w_s)


class SleepStack(nn.Module):
    def __init__(self, depth=4, fwd_ms=20.0, bwd_ms=40.0, w_ms=0.0):
        super().__init__()
        self.blocks = nn.ModuleList([SleepBlock(fwd_ms, bwd_ms, w_ms) for _ in range(depth)])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return x, F.mse_loss(x, y)
