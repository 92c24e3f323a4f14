"""Neural Collaborative Filtering: NeuMF (He et al., WWW 2017), annotated for annot.

NeuMF fuses two branches over (user, item) pairs of implicit feedback:

- GMF: user and item embeddings multiplied elementwise (a generalised
  matrix factorisation);
- MLP: separate user and item embeddings, concatenated, through a tower of
  ReLU layers;

their outputs are concatenated and a prediction layer gives one logit per
pair, trained with binary cross-entropy (interacted or not).

Only the decorators are annot's:

- the four embedding tables (the bulk of the parameters in a recommender)
  are split row-wise over tp with ``Vocab()``: each rank holds a contiguous
  block of the users and of the items, looks up the ids in its block and the
  lookups are all-reduced;
- each block of the MLP tower is a column- then row-parallel pair (one
  all-reduce forward per block);
- ``@stage(auto=True)`` lets annot place the pipeline boundaries among the
  tower's blocks.

Single-device it is a plain PyTorch model.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from annot import Col, Row, Vocab, shard, stage


@dataclass
class NCFConfig:
    num_users: int = 256
    num_items: int = 512
    gmf_dim: int = 16  # predictive factors of the GMF branch
    mlp_dim: int = 32  # embedding size per side in the MLP branch (tower input: 2 * mlp_dim)
    mlp_layers: tuple = (64, 32, 16)  # output width of each tower block
    mlp_expand: int = 2  # hidden width of a block: mlp_expand * its output width


@shard(fc1=Col(), fc2=Row())
class TowerBlock(nn.Module):
    """One step of the MLP tower: Linear, ReLU, Linear, ReLU (a Megatron pair)."""

    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        x = F.relu(self.fc1(x))  # (B, d_hidden), sharded over tp
        return F.relu(self.fc2(x))  # (B, d_out)


@stage(auto=True)
@shard(gmf_user=Vocab(), gmf_item=Vocab(), mlp_user=Vocab(), mlp_item=Vocab())
class NeuMF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gmf_user = nn.Embedding(config.num_users, config.gmf_dim)
        self.gmf_item = nn.Embedding(config.num_items, config.gmf_dim)
        self.mlp_user = nn.Embedding(config.num_users, config.mlp_dim)
        self.mlp_item = nn.Embedding(config.num_items, config.mlp_dim)
        widths = [2 * config.mlp_dim, *config.mlp_layers]
        self.tower = nn.ModuleList(
            [
                TowerBlock(d_in, config.mlp_expand * d_out, d_out)
                for d_in, d_out in zip(widths[:-1], widths[1:])
            ]
        )
        self.predict = nn.Linear(config.gmf_dim + widths[-1], 1)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # as in the paper's code: N(0, 0.01) embeddings, Xavier-uniform layers
        if isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.01)
        elif isinstance(module, nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
            torch.nn.init.zeros_(module.bias)

    def forward(self, users, items, labels=None):
        gmf = self.gmf_user(users) * self.gmf_item(items)  # (B, gmf_dim)
        x = torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=-1)  # (B, 2 * mlp_dim)
        for block in self.tower:
            x = block(x)  # (B, mlp_layers[i])
        logits = self.predict(torch.cat([gmf, x], dim=-1)).squeeze(-1)  # (B,)

        loss = None
        if labels is not None:
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        return logits, loss
