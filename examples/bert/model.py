"""A BERT-style encoder for masked-language-model pretraining, annotated for annot.

The layout is BERT's (Devlin et al. 2019; module names close to Hugging
Face's ``BertForMaskedLM``): token + position + segment embeddings and a
LayerNorm, post-LayerNorm encoder layers of bidirectional self-attention
(separate query / key / value projections, a padding mask) and a GELU MLP,
then the MLM head: a transform (dense, GELU, LayerNorm) and a decoder to the
vocabulary whose weight is tied to the word embeddings. The loss is the
cross-entropy over the masked positions only (labels are -100 elsewhere).
Only the decorators are annot's:

- attention: query, key and value column-parallel (each rank gets its own
  heads), the output projection row-parallel; the head count and the
  all-heads width become per-rank sizes (``local=``);
- MLP: column then row parallel (Megatron's layout: one all-reduce forward);
- embeddings: the word embedding table is vocabulary-parallel (``Vocab()``);
- the decoder is column-parallel (``Col()``) with the same row blocks as the
  word embeddings it is tied to, so its logits stay sharded over the
  vocabulary and the masked-LM loss becomes a vocab-parallel cross-entropy;
- ``@stage(auto=True)`` lets annot place the pipeline boundaries among the
  encoder layers.

The decoder lives on the top model next to the loss (as nanoGPT's
``lm_head``): annot turns ``F.cross_entropy`` into its vocab-parallel form
only where the logits visibly come from a ``Col()`` layer of the same class.

Single-device it is a plain PyTorch model.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from annot import Col, Row, Vocab, shard, stage


@dataclass
class BertConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    max_position: int = 64
    type_vocab_size: int = 2
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02


@shard(word_embeddings=Vocab())
class BertEmbeddings(nn.Module):
    """Word + position + segment (token type) embeddings, then LayerNorm."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids=None):
        B, T = input_ids.size()
        pos = torch.arange(T, dtype=torch.long, device=input_ids.device)  # (T,)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)  # every token in sentence A
        x = self.word_embeddings(input_ids)  # (B, T, H)
        x = x + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))


@shard(query=Col(), key=Col(), value=Col(), out=Row(), local=("num_heads", "all_head_size"))
class BertSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention with a key padding mask."""

    def __init__(self, config):
        super().__init__()
        assert config.hidden_size % config.num_heads == 0
        self.num_heads = config.num_heads
        self.head_size = config.hidden_size // config.num_heads
        self.all_head_size = self.num_heads * self.head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.out = nn.Linear(self.all_head_size, config.hidden_size)
        self.dropout = config.dropout
        self.out_dropout = nn.Dropout(config.dropout)

    def forward(self, x, mask=None):
        B, T, _ = x.size()
        nh, hs = self.num_heads, self.head_size
        q = self.query(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.value(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)

        # mask: (B, 1, 1, T), True where the key is a real token; (B, nh, T, T) scores inside
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.all_head_size)  # (B, T, nh * hs)
        return self.out_dropout(self.out(y))


@shard(fc_in=Col(), fc_out=Row())
class BertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.fc_out(self.gelu(self.fc_in(x))))


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer (BERT's original order)."""

    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = BertMLP(config)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, mask=None):
        x = self.attention_norm(x + self.attention(x, mask))
        x = self.output_norm(x + self.mlp(x))
        return x


class MLMTransform(nn.Module):
    """The MLM head's transform before the decoder: dense, GELU, LayerNorm."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.gelu = nn.GELU()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.norm(self.gelu(self.dense(x)))


@stage(auto=True)
@shard(decoder=Col())
class BertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList([BertLayer(config) for _ in range(config.num_layers)])
        self.transform = MLMTransform(config)
        # Its bias is BERT's per-token output bias; sharded with the weight.
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.apply(self._init_weights)
        # weight tying: the decoder reads the word embedding table
        self.decoder.weight = self.embeddings.word_embeddings.weight

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        _, t = input_ids.size()
        assert t <= self.config.max_position, (
            f"Cannot forward sequence of length {t}, max_position is {self.config.max_position}"
        )
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, H)
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): keys to attend to
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.decoder(self.transform(x))  # (B, T, V)

        loss = None
        if labels is not None:
            # the masked positions only: every other label is -100
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
            )
        return logits, loss
