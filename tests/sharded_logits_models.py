"""Models for ``tests/e2e/test_sharded_logits.py``: the vocab-sharded head in a
submodule and the loss in its parent (Hugging Face's layout).

``annot.parallelize`` rewrites a class from its source file, so these live in
a module of their own. Single-device they are plain PyTorch models.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from annot import Col, shard

__all__ = ["Head", "Top"]


@shard(decoder=Col())
class Head(nn.Module):
    """An LM head: the decoder's output is sharded over the vocab at tp > 1."""

    def __init__(self, d, v):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.decoder = nn.Linear(d, v)

    def forward(self, x):
        return self.decoder(torch.tanh(self.dense(x)))


class Top(nn.Module):
    """No hints: its cross_entropy is fed by ``self.cls``, a :class:`Head`."""

    def __init__(self, d, v):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.cls = Head(d, v)

    def forward(self, x, labels):
        logits = self.cls(self.body(x))  # (B, T, v), or (B, T, v / tp) per rank
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return logits, loss
