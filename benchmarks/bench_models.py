"""The model the side-by-side benchmarks run: a GPT block stack with separate
q, k, v projections, so torch's DTensor plan (ColwiseParallel on q/k/v and the
MLP up projection, RowwiseParallel on the output projections — torchtitan's
plan) applies to the very same module tree as annot's hints."""

from dataclasses import dataclass

import torch.nn as nn
from torch.nn import functional as F

from annot import Col, Row, shard


@dataclass
class BenchConfig:
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    vocab: int = 512


@shard(wq=Col(), wk=Col(), wv=Col(), wo=Row(), local=("n_head",))
class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.n_head = cfg.n_head

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


@shard(up=Col(), down=Row())
class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.ffn = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BenchGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
