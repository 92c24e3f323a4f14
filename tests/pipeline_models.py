"""Models for the pipeline tests, written the way people write PyTorch.

``Branchy`` has what torch.export-based pipelining cannot take: a branch on
data inside the split loop, a module called twice, an embedding tied to the
head across the first and last stage, kwargs and a None crossing a boundary,
an int and a float crossing, targets that only the last stage reads, and a
loop over a prefix of its block list (``self.blocks[: self.depth]``, as Hugging
Face writes it), cut in source. ``Regression`` reads its target only in the
last stage, and may change its input in place first.
"""

import torch
import torch.nn as nn
from torch.nn import functional as F

import annot


class Branchy(nn.Module):
    def __init__(self, vocab=16, width=8, depth=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.shared = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied across the first and last stage
        self.depth = depth

    def forward(self, idx, targets=None, mask=None, scale=1.0):
        x = self.emb(idx)
        x = self.shared(torch.relu(self.shared(x)))  # one module, called twice
        length = idx.shape[1]
        bonus = None
        for block in self.blocks[: self.depth]:
            x = block(x)
            if x.mean() > 0:  # a different path per microbatch
                x = x * scale
                bonus = x.sum(-1, keepdim=True) / length
        if bonus is not None:
            x = x + bonus
        if mask is not None:
            x = x * mask.unsqueeze(-1)
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class Marked(nn.Module):
    """Stage boundaries marked in forward with annot.boundary()."""

    def __init__(self, width=8):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 1)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        annot.boundary()
        h = torch.tanh(self.b(h)) + x  # x crosses the boundary too
        out = self.c(h).squeeze(-1)
        return out, F.mse_loss(out, y)


class Regression(nn.Module):
    """A target ``y`` that only the last stage reads (the last stage takes it
    from the model call); ``bump`` adds to ``x`` in place in the first stage,
    which a ``y`` sharing ``x``'s memory sees."""

    def __init__(self, width=8, depth=3, bump=0.0):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.bump = bump

    def forward(self, x, y, weight=None):
        if self.bump:
            x.add_(self.bump)
        h = x  # the first block saves it for backward: each microbatch its own
        for block in self.blocks:
            h = torch.tanh(block(h))
        err = (h - y) ** 2
        if weight is not None:
            err = err * weight
        return h, err.mean()


class ShardedBody(nn.Module):
    """A functional dropout in ``forward``'s own code on the tp shard between a
    column- and a row-parallel layer (hinted from outside), before a loop of
    blocks a pipeline cuts."""

    def __init__(self, width=8, depth=2):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        x = self.down(F.dropout(self.up(x), 0.1, self.training))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


class DropoutInBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = ShardedBody()

    def forward(self, x):
        return self.body(x)
