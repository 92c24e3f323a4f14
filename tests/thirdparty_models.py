"""A model as a third-party package would ship it: no annot decorators, its
own names (``num_heads``, ``dim``), an nn.ModuleDict, a tied head."""

import torch.nn as nn
from torch.nn import functional as F


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.num_heads = num_heads
        self.dim = dim

    def forward(self, h):
        B, T, _ = h.shape
        q, k, v = self.qkv(h).split(self.dim, dim=-1)
        q, k, v = (t.reshape(B, T, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.out(y.transpose(1, 2).reshape(B, T, self.dim))


class Layer(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.ModuleDict({"up": nn.Linear(dim, 2 * dim), "down": nn.Linear(2 * dim, dim)})

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.ff["down"](F.silu(self.ff["up"](self.norm2(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=16, num_heads=4, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Layer(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, labels=None):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return logits, loss
