"""Models as third-party packages ship them: no annot decorators, their own
names (``num_heads``, ``dim``).

- ``TinyLM``: an nn.ModuleDict, a tied head.
- ``XLM``: x-transformers' attention, whose output projection is assigned in
  each branch of an ``if`` on constructor flags, with a different call in each
  (``nn.Linear(..., bias=True)``, ``LinearNoBias(...)``, or a gated
  ``nn.Sequential``): a hint on it follows the branch taken.
"""

from functools import partial

import torch.nn as nn
from torch.nn import functional as F

LinearNoBias = partial(nn.Linear, bias=False)


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


class XAttention(nn.Module):
    def __init__(self, dim, heads, dim_head=4, gate_out=False, out_bias=False):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = LinearNoBias(dim, inner)
        self.to_kv = LinearNoBias(dim, 2 * inner)
        if gate_out:
            self.to_out = nn.Sequential(nn.Linear(inner, dim * 2, bias=False), nn.GLU())
        elif out_bias:
            self.to_out = nn.Linear(inner, dim)
        else:
            self.to_out = LinearNoBias(inner, dim)

    def forward(self, x):
        B, T, _ = x.shape
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (self.to_q(x), k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, dh)
        return self.to_out(y.transpose(1, 2).reshape(B, T, -1))


class XBlock(nn.Module):
    def __init__(self, dim, heads, **attn_kwargs):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = XAttention(dim, heads, **attn_kwargs)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class XLM(nn.Module):
    """One block's output projection has a bias, the other's has none
    (``gate_out=True``: every block's is gated)."""

    def __init__(self, vocab=32, dim=16, heads=4, gate_out=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [
                XBlock(dim, heads, gate_out=gate_out, out_bias=True),
                XBlock(dim, heads, gate_out=gate_out, out_bias=False),
            ]
        )
        self.head = LinearNoBias(dim, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MixedHeads(nn.Module):
    """An attention whose heads are averaged into each other before the output
    projection: read as any attention, its shapes hold at tp, its values do not."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.mean(dim=1, keepdim=True).expand_as(y)  # every head the mean of all
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class MixedHeadsNet(nn.Module):
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": MixedHeads(dim, heads)})])

    def forward(self, x):
        for block in self.blocks:
            x = x + block["attn"](x)
        return x
