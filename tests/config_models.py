"""A model in the style of a third-party library that reads its sizes from the
config object it holds, shared by every block and the root (transformers'
``self.config.num_attention_heads``): the attention's forward reshapes q, k, v
with ``self.config.n_head``; the root reads ``self.config.n_embd`` and
``self.config.n_head`` too, which must stay the full sizes at any tp.

``HintedAttention`` is the same attention as a user would annotate it in
their own file (``@shard(..., local=("config.n_head", "config.n_embd"))``).
"""

from dataclasses import dataclass

import torch.nn as nn
from torch.nn import functional as F

from annot import Col, Row, shard


@dataclass
class Config:
    vocab_size: int = 32
    n_embd: int = 16
    n_head: int = 4
    n_layer: int = 2


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, _ = x.size()
        n_head = self.config.n_head
        q, k, v = self.c_attn(x).split(self.config.n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.config.n_embd))


@shard(c_attn=Col(chunks=3), c_proj=Row(), local=("config.n_head", "config.n_embd"))
class HintedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        B, T, _ = x.size()
        n_head = self.config.n_head
        q, k, v = self.c_attn(x).split(self.config.n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.config.n_embd))


class Block(nn.Module):
    def __init__(self, config, hinted: bool):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd)
        self.attn = (HintedAttention if hinted else Attention)(config)
        self.fc = nn.Linear(config.n_embd, 2 * config.n_embd)
        self.proj = nn.Linear(2 * config.n_embd, config.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.proj(F.gelu(self.fc(x)))


class ConfigLM(nn.Module):
    def __init__(self, config, hinted: bool = False):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, hinted) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) * self.config.n_embd**0.5  # the full width, at any tp
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)) / self.config.n_head  # the full head count
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
