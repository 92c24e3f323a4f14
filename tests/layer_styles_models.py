"""A model whose layers are built the ways third-party code builds them, none a
plain ``nn.Linear(...)`` call in its owner's ``__init__``:

- a subclass with its own (equivalent) forward, as HF Falcon's ``FalconLinear``;
- a factory passed in, as timm's ``Mlp(..., linear_layer=nn.Linear)``;
- ``partial(nn.Linear, bias=False)``, as x-transformers' ``LinearNoBias``;
- an ``nn.Embedding`` subclass that scales ``super().forward``, as Gemma's;
- an ``nn.ModuleDict`` built by a comprehension;
- ``nn.Sequential`` feed-forwards whose linear layers sit at different
  indexes in different blocks (x-transformers' GLU and plain variants);
- a module-level registry of attention classes, as HF's ``*_ATTENTION_CLASSES``.
"""

from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F

LinearNoBias = partial(nn.Linear, bias=False)


class FusedLinear(nn.Linear):
    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class ScaledEmbedding(nn.Embedding):
    def __init__(self, num, dim, scale):
        super().__init__(num, dim)
        self.embed_scale = nn.Buffer(torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.proj = nn.ModuleDict({k: LinearNoBias(dim, dim) for k in ("q", "k", "v")})
        self.out = FusedLinear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            self.proj[n](x).view(B, T, self.heads, -1).transpose(1, 2) for n in ("q", "k", "v")
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


ATTENTION_CLASSES = {"eager": Attention}


class Mlp(nn.Module):
    def __init__(self, dim, hidden, linear_layer=nn.Linear):
        super().__init__()
        self.fc1 = linear_layer(dim, hidden)
        self.fc2 = linear_layer(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def feed_forward(dim, hidden, glu):
    """x-transformers' layout: the projection in is its own Sequential for GLU."""
    if glu:
        project_in = nn.Sequential(nn.Linear(dim, hidden), nn.GELU())
    else:
        project_in = nn.Linear(dim, hidden)
    return nn.Sequential(
        project_in, nn.GELU() if not glu else nn.Identity(), nn.Linear(hidden, dim)
    )


class Block(nn.Module):
    def __init__(self, dim, heads, glu, attn_implementation="eager"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ATTENTION_CLASSES[attn_implementation](dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = feed_forward(dim, 2 * dim, glu)
        self.mlp = Mlp(dim, 2 * dim, linear_layer=FusedLinear)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.ff(self.norm2(x))
        return x + self.mlp(x)


class StyledLM(nn.Module):
    def __init__(self, vocab=32, dim=16, heads=4):
        super().__init__()
        self.embed = ScaledEmbedding(vocab, dim, dim**0.5)
        self.blocks = nn.ModuleList([Block(dim, heads, glu=False), Block(dim, heads, glu=True)])
        self.norm = nn.LayerNorm(dim)
        self.head = LinearNoBias(dim, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
