"""The tensor-parallel rewriter: before/after source pairs, refusals, hint reading.

Each case is an inline (before, after) pair in the spirit of LibCST's
``CodemodTest.assertCodemod``; every output must compile and be a fixed point
of the rewriter (rewriting it again changes nothing).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from annot.core.errors import HintError, MeshError, RewriteError
from annot.core.hints import ShardSpec, StageSpec
from annot.core.specs import Col, P, Replicate, Row, Vocab
from annot.rewriters.diagnostics import unified_diff
from annot.rewriters.hint_literals import format_hint
from annot.rewriters.hint_reader import read_shard_hints, read_stage_hints
from annot.rewriters.tensor_parallel import rewrite_tensor_parallel

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gpt_model.py"


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def assert_rewrite(before: str, after: str, tp: int = 2, **kwargs) -> str:
    before, after = dedent(before), dedent(after)
    out = rewrite_tensor_parallel(before, tp, path="model.py", **kwargs)
    assert out == after, "\n" + unified_diff(after, out, "expected", "got")
    compile(out, "model.py", "exec")
    assert rewrite_tensor_parallel(out, tp, path="model.py", **kwargs) == out  # idempotent
    return out


def refusal(source: str, tp: int = 2, **kwargs) -> RewriteError:
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel(dedent(source), tp, path="model.py", **kwargs)
    err = info.value
    assert str(err) == f"model.py:{err.line}:{err.col}: {err.reason}"
    return err


# ---- the transform -------------------------------------------------------------


def test_attention_fused_qkv_local_sizes():
    assert_rewrite(
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Row

        @shard(c_attn=Col(chunks=3), c_proj=Row(), local=("n_head", "n_embd", "C"))
        class CausalSelfAttention(nn.Module):
            def __init__(self, config):
                super().__init__()
                # fused q, k, v
                self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
                self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

                self.n_head = config.n_head
                self.n_embd = config.n_embd

            def forward(self, x):
                B, T, C = x.size()  # batch, seq, width
                q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
                k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
                return self.c_proj(y)
        """,
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Row
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear

        # annot: @shard(c_attn=Col(chunks=3), c_proj=Row(), local=("n_head", "n_embd", "C")) applied for tp=2
        class CausalSelfAttention(nn.Module):
            def __init__(self, config):
                super().__init__()
                # fused q, k, v
                self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, bias=config.bias, chunks=3, tp=2)
                self.c_proj = RowParallelLinear(config.n_embd, config.n_embd, bias=config.bias, tp=2)

                self.n_head = config.n_head
                self.n_embd = config.n_embd

            def forward(self, x):
                B, T, C = x.size()  # batch, seq, width
                q, k, v = self.c_attn(x).split(self.n_embd // 2, dim=2)
                k = k.view(B, T, self.n_head // 2, C // 2 // (self.n_head // 2)).transpose(1, 2)  # (B, nh, T, hs)
                q = q.view(B, T, self.n_head // 2, C // 2 // (self.n_head // 2)).transpose(1, 2)  # (B, nh, T, hs)
                v = v.view(B, T, self.n_head // 2, C // 2 // (self.n_head // 2)).transpose(1, 2)  # (B, nh, T, hs)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y = y.transpose(1, 2).contiguous().view(B, T, C // 2)  # (B, T, C)
                return self.c_proj(y)
        """,
    )


def test_mlp_column_then_row():
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Col, Row


        @shard(c_fc=Col(), c_proj=Row())
        class MLP(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
                self.gelu = nn.GELU()
                self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

            def forward(self, x):
                return self.c_proj(self.gelu(self.c_fc(x)))
        """,
        """
        import torch.nn as nn
        from annot import shard, Col, Row
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear


        # annot: @shard(c_fc=Col(), c_proj=Row()) applied for tp=4
        class MLP(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, bias=config.bias, tp=4)
                self.gelu = nn.GELU()
                self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, bias=config.bias, tp=4)

            def forward(self, x):
                return self.c_proj(self.gelu(self.c_fc(x)))
        """,
        tp=4,
    )


def test_gpt_vocab_embedding_col_head_and_vocab_parallel_loss():
    assert_rewrite(
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Vocab


        @shard(wte=Vocab(), lm_head=Col())
        class GPT(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.wte = nn.Embedding(config.vocab_size, config.n_embd)
                self.wpe = nn.Embedding(config.block_size, config.n_embd)
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
                self.wte.weight = self.lm_head.weight  # tied

            def forward(self, idx, targets=None):
                x = self.wte(idx)
                if targets is not None:
                    logits = self.lm_head(x)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
                else:
                    logits = self.lm_head(x[:, [-1], :])  # sharded output
                    loss = None
                return logits, loss

            def loss_of_floats(self, x, y):
                z = self.lm_head(x)
                z = z.float()
                return F.cross_entropy(z[:, :-1].contiguous().flatten(0, 1), y.flatten())

            def loss_of_something_else(self, x, y):
                z = self.lm_head(x)
                z = postprocess(z)
                return F.cross_entropy(z, y) + F.cross_entropy(self.wpe(x), y)
        """,
        """
        import torch.nn as nn
        from torch.nn import functional as F
        from annot import shard, Col, Vocab
        from annot.runtime.tp_layers import ColumnParallelLinear, VocabParallelEmbedding
        from annot.runtime.vocab_loss import vocab_parallel_cross_entropy


        # annot: @shard(wte=Vocab(), lm_head=Col()) applied for tp=2
        class GPT(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, tp=2)
                self.wpe = nn.Embedding(config.block_size, config.n_embd)
                self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, bias=False, tp=2)
                self.wte.weight = self.lm_head.weight  # tied

            def forward(self, idx, targets=None):
                x = self.wte(idx)
                if targets is not None:
                    logits = self.lm_head(x)
                    loss = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
                else:
                    logits = self.lm_head(x[:, [-1], :])  # sharded output
                    loss = None
                return logits, loss

            def loss_of_floats(self, x, y):
                z = self.lm_head(x)
                z = z.float()
                return vocab_parallel_cross_entropy(z[:, :-1].contiguous().flatten(0, 1), y.flatten())

            def loss_of_something_else(self, x, y):
                z = self.lm_head(x)
                z = postprocess(z)
                return F.cross_entropy(z, y) + F.cross_entropy(self.wpe(x), y)
        """,
    )


def test_gathered_col_keeps_plain_loss():
    assert_rewrite(
        """
        from torch import nn
        import torch.nn.functional as F
        from annot import shard, Col


        @shard(head=Col(gather=True))
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Linear(8, 16)

            def forward(self, x, y):
                return F.cross_entropy(self.head(x), y)
        """,
        """
        from torch import nn
        import torch.nn.functional as F
        from annot import shard, Col
        from annot.runtime.tp_layers import ColumnParallelLinear


        # annot: @shard(head=Col(gather=True)) applied for tp=2
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = ColumnParallelLinear(8, 16, gather=True, tp=2)

            def forward(self, x, y):
                return F.cross_entropy(self.head(x), y)
        """,
    )


def test_aliased_imports():
    assert_rewrite(
        """
        import annot as a
        import annot.core.hints
        import torch
        from torch import nn
        import torch.nn.functional as G
        from torch.nn import Linear
        from torch.nn.functional import cross_entropy


        @a.shard(c_fc=a.Col(), c_proj=a.Row())
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_fc = Linear(8, 32)
                self.c_proj = torch.nn.Linear(32, 8)


        @annot.core.hints.shard(emb=annot.Vocab(), out=annot.core.specs.Col())
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(100, 8)
                self.out = nn.Linear(8, 100)

            def forward(self, x, y):
                logits = self.out(self.emb(x))
                return G.cross_entropy(logits, y) + cross_entropy(logits, y) + nn.functional.cross_entropy(input=logits, target=y)
        """,
        """
        import annot as a
        import annot.core.hints
        import torch
        from torch import nn
        import torch.nn.functional as G
        from torch.nn import Linear
        from torch.nn.functional import cross_entropy
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        from annot.runtime.vocab_loss import vocab_parallel_cross_entropy


        # annot: @shard(c_fc=Col(), c_proj=Row()) applied for tp=2
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_fc = ColumnParallelLinear(8, 32, tp=2)
                self.c_proj = RowParallelLinear(32, 8, tp=2)


        # annot: @shard(emb=Vocab(), out=Col()) applied for tp=2
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = VocabParallelEmbedding(100, 8, tp=2)
                self.out = ColumnParallelLinear(8, 100, tp=2)

            def forward(self, x, y):
                logits = self.out(self.emb(x))
                return vocab_parallel_cross_entropy(logits, y) + vocab_parallel_cross_entropy(logits, y) + vocab_parallel_cross_entropy(input=logits, target=y)
        """,
    )


def test_local_shadowing_and_lookalikes_are_left_alone():
    # a user-defined `shard` and a user-defined `Linear` are not annot's / torch's
    source = dedent(
        """
        def shard(**kw):
            return lambda cls: cls


        class Linear:
            pass


        @shard(c_fc=Col())
        class MLP:
            def __init__(self):
                self.c_fc = Linear()
        """
    )
    assert rewrite_tensor_parallel(source, 2) is source


def test_parameter_partition_spec():
    assert_rewrite(
        """
        import torch
        import torch.nn as nn
        from annot import shard, P


        @shard(w=P("tp", None, chunks=2), b=P(None, "tp"), s=P(None))
        class Scale(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.w = nn.Parameter(torch.randn(n, 4))
                self.b = torch.nn.Parameter(torch.zeros(4, n), requires_grad=True)
                self.s = nn.Parameter(torch.ones(4))
        """,
        """
        import torch
        import torch.nn as nn
        from annot import shard, P
        from annot.runtime.tp_layers import shard_parameter


        # annot: @shard(w=P("tp", None, chunks=2), b=P(None, "tp"), s=P(None)) applied for tp=2
        class Scale(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.w = shard_parameter(nn.Parameter(torch.randn(n, 4)), dim=0, chunks=2, tp=2)
                self.b = shard_parameter(torch.nn.Parameter(torch.zeros(4, n), requires_grad=True), dim=1, tp=2)
                self.s = nn.Parameter(torch.ones(4))
        """,
    )


def test_replicate_and_module_dict_entries():
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Replicate, Vocab


        @shard(wte=Vocab(), wpe=Replicate(), ln=Replicate())
        class Emb(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.transformer = nn.ModuleDict({
                    "wte": nn.Embedding(config.vocab_size, config.n_embd),  # tokens
                    "wpe": nn.Embedding(config.block_size, config.n_embd),
                })
                self.ln = LayerNorm(config.n_embd)
        """,
        """
        import torch.nn as nn
        from annot import shard, Replicate, Vocab
        from annot.runtime.tp_layers import VocabParallelEmbedding


        # annot: @shard(wte=Vocab(), wpe=Replicate(), ln=Replicate()) applied for tp=2
        class Emb(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.transformer = nn.ModuleDict({
                    "wte": VocabParallelEmbedding(config.vocab_size, config.n_embd, tp=2),  # tokens
                    "wpe": nn.Embedding(config.block_size, config.n_embd),
                })
                self.ln = LayerNorm(config.n_embd)
        """,
    )


def test_layers_built_by_subclasses_factories_and_partials_are_converted():
    # What the call builds is decided at runtime (annot.runtime.tp_convert), so the call stays.
    assert_rewrite(
        """
        from functools import partial
        import torch.nn as nn
        from annot import shard, Col, Row, Vocab, Partial

        LinearNoBias = partial(nn.Linear, bias=False)

        class MyLinear(nn.Linear):
            pass

        @shard(a=Col(chunks=2), b=Row(split_input=True), c=Col(gather=True), e=Vocab(), f=Partial())
        class M(nn.Module):
            def __init__(self, d, linear_layer=nn.Linear):
                super().__init__()
                self.a = MyLinear(d, 4 * d)
                self.b = linear_layer(4 * d, d, bias=False)
                self.c = LinearNoBias(d, d)
                self.e = make_embedding(10, d)
                self.f = Experts(d)
        """,
        """
        from functools import partial
        import torch.nn as nn
        from annot import shard, Col, Row, Vocab, Partial
        from annot.runtime.tp_convert import column_parallel, partial_module, row_parallel, vocab_parallel

        LinearNoBias = partial(nn.Linear, bias=False)

        class MyLinear(nn.Linear):
            pass

        # annot: @shard(a=Col(chunks=2), b=Row(split_input=True), c=Col(gather=True), e=Vocab(), f=Partial()) applied for tp=2
        class M(nn.Module):
            def __init__(self, d, linear_layer=nn.Linear):
                super().__init__()
                self.a = column_parallel(MyLinear(d, 4 * d), chunks=2, tp=2)
                self.b = row_parallel(linear_layer(4 * d, d, bias=False), split_input=True, tp=2)
                self.c = column_parallel(LinearNoBias(d, d), gather=True, tp=2)
                self.e = vocab_parallel(make_embedding(10, d), tp=2)
                self.f = partial_module(Experts(d), tp=2)
        """,
    )


def test_a_local_assigned_from_divided_sizes_is_not_divided_again():
    # HF Falcon: num_kv_heads = self.num_heads if ... else self.num_kv_heads
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard

        @shard(local=("num_heads", "num_kv_heads"))
        class A(nn.Module):
            def forward(self, x, new):
                num_kv_heads = self.num_heads if new else self.num_kv_heads
                B, T, num_heads = x.shape
                return x.view(B, num_kv_heads, -1), num_heads
        """,
        """
        import torch.nn as nn
        from annot import shard

        # annot: @shard(local=("num_heads", "num_kv_heads")) applied for tp=2
        class A(nn.Module):
            def forward(self, x, new):
                num_kv_heads = self.num_heads // 2 if new else self.num_kv_heads // 2
                B, T, num_heads = x.shape
                return x.view(B, num_kv_heads, -1), num_heads // 2
        """,
    )
    err = refusal(
        """
        import torch.nn as nn
        from annot import shard

        @shard(local=("n",))
        class A(nn.Module):
            def forward(self, x):
                n = self.n
                if x.dim() > 2:
                    n = x.size(-1)
                return x.view(-1, n)
        """
    )
    assert err.reason.startswith(
        "n is a per-rank size (local=) that A.forward assigns both from per-rank sizes of "
        "self (here) and from other values"
    )
    assert (err.line, err.col) == (7, 9)


def test_a_size_read_from_a_config_object_is_divided_where_it_is_read():
    # transformers' style: forward reads its head count from the config it holds
    # (shared with every block and the root), so the read is divided, not the config
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Col

        @shard(c_attn=Col(chunks=3), local=("config.n_head", "config.n_embd"))
        class A(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config
                self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)

            def forward(self, x, config):
                n_head = self.config.n_head
                q, k, v = self.c_attn(x).split(self.config.n_embd, dim=2)
                scale = (self.config.n_embd / self.config.n_head) ** -0.5
                return q.view(*x.shape[:2], n_head, -1) * scale, self.config.vocab, config.n_head
        """,
        """
        import torch.nn as nn
        from annot import shard, Col
        from annot.runtime.tp_layers import ColumnParallelLinear

        # annot: @shard(c_attn=Col(chunks=3), local=("config.n_head", "config.n_embd")) applied for tp=2
        class A(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config
                self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, chunks=3, tp=2)

            def forward(self, x, config):
                n_head = self.config.n_head // 2
                q, k, v = self.c_attn(x).split(self.config.n_embd // 2, dim=2)
                scale = (self.config.n_embd // 2 / (self.config.n_head // 2)) ** -0.5
                return q.view(*x.shape[:2], n_head, -1) * scale, self.config.vocab, config.n_head
        """,
    )
    err = refusal(
        HEAD
        + '@shard(local=("config.n_head",))\nclass M(nn.Module):\n'
        + "    def forward(self, x):\n        self.config.n_head += 1\n        return x\n"
    )
    assert (err.line, err.col) == (9, 9)
    assert err.reason.startswith(
        "config.n_head is a per-rank size (local=) but M.forward updates it with "
        "'self.config.n_head += 1'"
    )


def test_per_head_table_and_per_head_argument():
    # T5: the relative-position table is (buckets, n_heads), split by columns
    # (heads); Bloom: Heads() names a forward argument, sliced at runtime.
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Col, Heads

        @shard(bias=Col(), alibi=Heads(dim=0, heads=4), local=("n_heads",))
        class Attention(nn.Module):
            def __init__(self, n_heads):
                super().__init__()
                self.n_heads = n_heads
                self.bias = nn.Embedding(32, self.n_heads)

            def forward(self, x, alibi):
                return x.view(-1, self.n_heads) + alibi
        """,
        """
        import torch.nn as nn
        from annot import shard, Col, Heads
        from annot.runtime.tp_layers import ColumnParallelEmbedding

        # annot: @shard(bias=Col(), alibi=Heads(dim=0, heads=4), local=("n_heads",)) applied for tp=2
        class Attention(nn.Module):
            def __init__(self, n_heads):
                super().__init__()
                self.n_heads = n_heads
                self.bias = ColumnParallelEmbedding(32, self.n_heads, tp=2)

            def forward(self, x, alibi):
                return x.view(-1, self.n_heads // 2) + alibi
        """,
    )


def test_multiline_calls_keep_their_layout():
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Col, Row


        @shard(a=Col(chunks=2, gather=True), b=Row(), c=Col())
        class M(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.a = nn.Linear(
                    d,
                    2 * d,
                )
                self.b = nn.Linear(d,
                                   d)
                self.c = nn.Linear(
                    d
                )
        """,
        """
        import torch.nn as nn
        from annot import shard, Col, Row
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear


        # annot: @shard(a=Col(chunks=2, gather=True), b=Row(), c=Col()) applied for tp=2
        class M(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.a = ColumnParallelLinear(
                    d,
                    2 * d,
                    chunks=2,
                    gather=True,
                    tp=2,
                )
                self.b = RowParallelLinear(d,
                                   d,
                                   tp=2)
                self.c = ColumnParallelLinear(
                    d, tp=2
                )
        """,
    )


def test_other_decorators_comments_and_blank_lines_are_kept():
    assert_rewrite(
        """
        # leading comment

        import torch.nn as nn
        import annot


        # about M
        @register("m")
        # between decorators
        @annot.shard(c=annot.Col())
        @other
        class M(nn.Module):  # trailing
            '''Docstring.'''

            def __init__(self):
                super().__init__()


                self.c = nn.Linear(2, 4)  # keep me


        @annot.shard(c=annot.Row())

        class N(nn.Module):
            def __init__(self):
                super().__init__()
                self.c = nn.Linear(4, 2)
        """,
        """
        # leading comment

        import torch.nn as nn
        import annot
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear


        # about M
        @register("m")
        # between decorators
        # annot: @shard(c=Col()) applied for tp=2
        @other
        class M(nn.Module):  # trailing
            '''Docstring.'''

            def __init__(self):
                super().__init__()


                self.c = ColumnParallelLinear(2, 4, tp=2)  # keep me


        # annot: @shard(c=Row()) applied for tp=2

        class N(nn.Module):
            def __init__(self):
                super().__init__()
                self.c = RowParallelLinear(4, 2, tp=2)
        """,
    )


def test_locals_everywhere_but_init():
    assert_rewrite(
        """
        import annot


        class Outer:
            @annot.shard(local=("n", "C", "width"))
            class Inner:
                def __init__(self, n):
                    self.n = n
                    C = n * 2
                    self.width = C

                def forward(self, x, width):
                    C = x.shape[-1]
                    sizes = [C for _ in range(self.n)]
                    def helper():
                        return C + self.n
                    self.n = self.n
                    return sizes, helper(), width, self.width, x.n, n

                @staticmethod
                def f(C):
                    return C

                @property
                def heads(me):
                    return me.n
        """,
        """
        import annot


        class Outer:
            # annot: @shard(local=("n", "C", "width")) applied for tp=2
            class Inner:
                def __init__(self, n):
                    self.n = n
                    C = n * 2
                    self.width = C

                def forward(self, x, width):
                    C = x.shape[-1]
                    sizes = [C // 2 for _ in range(self.n // 2)]
                    def helper():
                        return C // 2 + self.n // 2
                    self.n = self.n // 2
                    return sizes, helper(), width, self.width // 2, x.n, n

                @staticmethod
                def f(C):
                    return C

                @property
                def heads(me):
                    return me.n // 2
        """,
    )


EXPRESSIONS = [
    "C",
    "-C",
    "+C",
    "not C",
    "C + 1",
    "1 - C",
    "C * 3",
    "3 * C",
    "7 // C",
    "C // 2",
    "100 % C",
    "C % 5",
    "C ** 2",
    "2 ** C",
    "C << 1",
    "(C)",
    "C.bit_length()",
    "[C, C]",
    "(C,)",
    "{C: C}",
    "xs[C]",
    "xs[:C]",
    "xs[C - 1 : C]",
    "C if C > 3 else -1",
    "C > 3 and C",
    "f'{C}'",
    "abs(C)",
    "max(*[C, 1])",
    "(lambda: C)()",
    "C == 16",
]


@pytest.mark.parametrize("tp", [2, 4])
def test_divided_reads_mean_what_they_say(tp):
    """Each rewritten expression evaluates like the original with C := C // tp
    (parentheses exactly where precedence needs them)."""
    body = "\n".join(f"            out.append({e})" for e in EXPRESSIONS)
    source = (
        "import annot\n\n\n"
        '@annot.shard(local=("C", "n"))\n'
        "class M:\n"
        "    def __init__(self):\n"
        "        self.n = 16\n\n"
        "    def forward(self, C):\n"
        "        return [self.n, self.n + 1, -self.n, self.n ** 2]\n\n"
        "    def values(self, xs):\n"
        "        C = 16\n"
        "        out = []\n"
        "        if True:\n"
        f"{body}\n"
        "        return out\n"
    )
    out = rewrite_tensor_parallel(source, tp)
    namespace: dict = {}
    exec(compile(out, "<rewritten>", "exec"), namespace)
    m = namespace["M"]()
    xs = list(range(40))
    got = m.values(xs)
    expected = [eval(e, {"xs": xs, "C": 16 // tp}) for e in EXPRESSIONS]
    assert got == expected
    n = 16 // tp
    assert m.forward(16) == [n, n + 1, -n, n**2]
    # and no parentheses where none are needed
    assert f"out.append(C // {tp})" in out
    assert f"out.append(C // {tp} + 1)" in out
    assert f"out.append(-(C // {tp}))" in out
    assert f"out.append(7 // (C // {tp}))" in out


def test_extra_hints_apply_to_undecorated_classes_once():
    before = """
        import torch.nn as nn


        class MLP(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.c_fc = nn.Linear(d, 4 * d)
                self.c_proj = nn.Linear(4 * d, d)


        class Attention(nn.Module):
            def __init__(self, d, h):
                super().__init__()
                self.c_attn = nn.Linear(d, 3 * d)
                self.n_head = h

            def forward(self, x):
                return self.c_attn(x).split(self.n_head, dim=-1)
        """
    after = """
        import torch.nn as nn
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear


        # annot: @shard(c_fc=Col(), c_proj=Row()) applied for tp=2
        class MLP(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.c_fc = ColumnParallelLinear(d, 4 * d, tp=2)
                self.c_proj = RowParallelLinear(4 * d, d, tp=2)


        # annot: @shard(c_attn=Col(chunks=3), local=("n_head",)) applied for tp=2
        class Attention(nn.Module):
            def __init__(self, d, h):
                super().__init__()
                self.c_attn = ColumnParallelLinear(d, 3 * d, chunks=3, tp=2)
                self.n_head = h

            def forward(self, x):
                return self.c_attn(x).split(self.n_head // 2, dim=-1)
        """
    hints = {
        "MLP": ShardSpec({"c_fc": Col(), "c_proj": Row()}),
        "Attention": ShardSpec({"c_attn": Col(chunks=3)}, ("n_head",)),
        "NotInThisFile": ShardSpec({"x": Row()}),
    }
    # the second pass (inside assert_rewrite) sees the marker and applies nothing
    assert_rewrite(before, after, extra_hints=hints)


def test_extra_hints_replace_the_decorators_hints():
    # annot.parallelize merges decorator and external hints and passes the result
    assert_rewrite(
        """
        import torch.nn as nn
        from annot import shard, Col


        @shard(c=Col())
        class M(nn.Module):
            def __init__(self):
                self.c = nn.Linear(2, 2)
                self.d = nn.Linear(2, 2)
        """,
        """
        import torch.nn as nn
        from annot import shard, Col
        from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear


        # annot: @shard(c=Col(), d=Row()) applied for tp=2
        class M(nn.Module):
            def __init__(self):
                self.c = ColumnParallelLinear(2, 2, tp=2)
                self.d = RowParallelLinear(2, 2, tp=2)
        """,
        extra_hints={"M": ShardSpec({"c": Col(), "d": Row()})},
    )


def test_no_hints_is_byte_identical():
    source = "import annot  \r\n\n\n# nothing to do\nclass A:\n\tx = 1 ;\n"
    assert rewrite_tensor_parallel(source, 2) is source
    data = source.encode()
    assert rewrite_tensor_parallel(data, 2) is data


def test_crlf_bom_and_encoding_are_preserved():
    source = (
        "# -*- coding: latin-1 -*-\r\n"
        "import torch.nn as nn\r\n"
        "from annot import shard, Row\r\n"
        "\r\n"
        "NAME = 'café'\r\n"
        "\r\n"
        "@shard(p=Row())\r\n"
        "class M(nn.Module):\r\n"
        "    def __init__(self):\r\n"
        "        self.p = nn.Linear(4, 4)\r\n"
    )
    expected = (
        "# -*- coding: latin-1 -*-\r\n"
        "import torch.nn as nn\r\n"
        "from annot import shard, Row\r\n"
        "from annot.runtime.tp_layers import RowParallelLinear\r\n"
        "\r\n"
        "NAME = 'café'\r\n"
        "\r\n"
        "# annot: @shard(p=Row()) applied for tp=2\r\n"
        "class M(nn.Module):\r\n"
        "    def __init__(self):\r\n"
        "        self.p = RowParallelLinear(4, 4, tp=2)\r\n"
    )
    assert rewrite_tensor_parallel(source.encode("latin-1"), 2) == expected.encode("latin-1")
    bom = "\ufeff" + source.replace("latin-1", "utf-8")
    out = rewrite_tensor_parallel(bom.encode("utf-8"), 2)
    assert out == ("\ufeff" + expected.replace("latin-1", "utf-8")).encode("utf-8")
    assert out.startswith(b"\xef\xbb\xbf# -*- coding: utf-8")
    assert rewrite_tensor_parallel(bom, 2) == "\ufeff" + expected.replace("latin-1", "utf-8")


def test_fixture_gpt_model_golden_lines():
    source = FIXTURE.read_text()
    out = rewrite_tensor_parallel(source, 2, path=str(FIXTURE))
    compile(out, str(FIXTURE), "exec")
    assert rewrite_tensor_parallel(out, 2) == out
    lines = {line.strip() for line in out.splitlines()}
    golden = [
        "from annot.runtime.tp_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding",
        "from annot.runtime.vocab_loss import vocab_parallel_cross_entropy",
        '# annot: @shard(c_attn=Col(chunks=3), c_proj=Row(), local=("n_head", "n_embd", "C")) applied for tp=2',
        "self.c_attn = ColumnParallelLinear(config.n_embd, 3 * config.n_embd, bias=config.bias, chunks=3, tp=2)",
        "self.c_proj = RowParallelLinear(config.n_embd, config.n_embd, bias=config.bias, tp=2)",
        "q, k, v = self.c_attn(x).split(self.n_embd // 2, dim=2)",
        "k = k.view(B, T, self.n_head // 2, C // 2 // (self.n_head // 2)).transpose(1, 2)  # (B, nh, T, hs)",
        "y = y.transpose(1, 2).contiguous().view(B, T, C // 2)  # (B, T, C)",
        "# annot: @shard(c_fc=Col(), c_proj=Row()) applied for tp=2",
        "self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, bias=config.bias, tp=2)",
        "self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, bias=config.bias, tp=2)",
        "# annot: @shard(wte=Vocab(), lm_head=Col()) applied for tp=2",
        "wte=VocabParallelEmbedding(config.vocab_size, config.n_embd, tp=2),",
        "wpe=nn.Embedding(config.block_size, config.n_embd),",
        "self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, bias=False, tp=2)",
        "self.transformer.wte.weight = self.lm_head.weight",
        "loss = vocab_parallel_cross_entropy(",
        "logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1",
        "logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim",
        "self.register_buffer(",
        "att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))",
    ]
    missing = [g for g in golden if g not in lines]
    assert not missing, missing
    assert "@shard" not in out.replace("# annot: @shard", "")
    assert "nn.Linear(" not in out.replace("isinstance(module, nn.Linear)", "")
    # comments survive, and only the decorator lines and the two imports changed
    assert out.count("#") == source.count("#") + 3  # one "# annot: ..." per decorator
    diff = [
        ln
        for ln in unified_diff(source, out, "a").splitlines()
        if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))
    ]
    assert sum(ln.startswith("+") for ln in diff) == sum(ln.startswith("-") for ln in diff) + 2


# ---- refusals ------------------------------------------------------------------------


HEAD = """import torch.nn as nn
from torch import nn as tnn
from annot import shard, Col, Row, Vocab, P


"""


def test_refuses_a_name_init_never_assigns():
    err = refusal(
        HEAD
        + """
@shard(c_fc=Col(), c_proj=Row())
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(4, 8)
        self.proj = nn.Linear(8, 4)
        self.act = nn.GELU()
"""
    )
    assert (err.line, err.col) == (7, 20)
    assert err.reason == (
        "c_proj=Row(): MLP.__init__ never assigns self.c_proj (it assigns self.c_fc, "
        "self.proj, self.act); a hint names an attribute that __init__ sets, "
        "e.g. self.c_proj = nn.Linear(...)"
    )


def test_refuses_extra_hints_for_a_missing_attribute_at_the_class():
    err = refusal(
        """
        import torch.nn as nn
        class MLP(nn.Module):
            def __init__(self):
                self.fc = nn.Linear(4, 8)
        """,
        extra_hints={"MLP": ShardSpec({"c_fc": Col()})},
    )
    assert (err.line, err.col) == (2, 7)
    assert "MLP.__init__ never assigns self.c_fc (it assigns self.fc)" in err.reason


def test_refuses_hints_on_a_class_without_init():
    err = refusal(HEAD + "@shard(c=Col())\nclass M(nn.Module):\n    pass\n")
    assert (err.line, err.col) == (7, 7)
    assert err.reason == (
        "class M has hints for c but no __init__(self, ...) that assigns them; annot rewrites "
        "the constructors called in __init__"
    )


@pytest.mark.parametrize(
    "spec, ctor, reason",
    [
        (
            "Vocab()",
            "nn.Linear(4, 100)",
            "c=Vocab(): Vocab() splits the rows of an nn.Embedding, but self.c is an nn.Linear; "
            "use Col() (its output feeds vocab_parallel_cross_entropy) or Row()",
        ),
        (
            "Col(chunks=2)",
            "nn.Embedding(100, 4)",
            "c=Col(chunks=2): Col(chunks=2) splits an nn.Linear, but self.c is an nn.Embedding; "
            "use Vocab() to split its rows, or Col() (no chunks) its columns",
        ),
        (
            "Row()",
            "tnn.Embedding(100, 4)",
            "c=Row(): Row() splits an nn.Linear, but self.c is an nn.Embedding; use Vocab() to "
            "split its rows, or Col() (no chunks) its columns",
        ),
        (
            'P("tp", None)',
            "nn.Linear(4, 4)",
            "c=P('tp', None): P(...) splits a raw nn.Parameter, but self.c is an nn.Linear; "
            "use Col() or Row()",
        ),
        (
            "Col()",
            "nn.Parameter(w)",
            'c=Col(): self.c is an nn.Parameter; give it a partition spec such as P("tp", None) '
            '(split dim 0) or P(None, "tp") (split dim 1)',
        ),
    ],
)
def test_refuses_specs_that_do_not_fit_the_layer(spec, ctor, reason):
    err = refusal(
        HEAD
        + f"@shard(c={spec})\nclass M(nn.Module):\n    def __init__(self, w, linear):\n"
        + f"        self.c = {ctor}\n"
    )
    assert (err.line, err.col) == (9, 18)
    assert err.reason == reason


def test_attribute_built_by_a_different_call_in_each_branch_follows_the_branch_taken():
    """x-transformers' ``to_out``: each site is planned by its own call; one annot
    cannot swap for a row-parallel layer is kept and converted by the runtime
    type of what it builds (refused there only if that branch runs)."""
    assert_rewrite(
        """
        from functools import partial

        import torch.nn as nn
        from annot import shard, Row

        LinearNoBias = partial(nn.Linear, bias=False)


        @shard(to_out=Row(), local=("heads",))
        class Attention(nn.Module):
            def __init__(self, dim, heads, gate_out=False, out_bias=False):
                super().__init__()
                self.heads = heads
                if gate_out:
                    self.to_out = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GLU())
                elif out_bias:
                    self.to_out = nn.Linear(dim, dim)
                else:
                    self.to_out = LinearNoBias(dim, dim)

            def forward(self, x):
                return self.to_out(x.view(*x.shape[:-1], self.heads, -1).flatten(-2))
        """,
        """
        from functools import partial

        import torch.nn as nn
        from annot import shard, Row
        from annot.runtime.tp_convert import row_parallel
        from annot.runtime.tp_layers import RowParallelLinear

        LinearNoBias = partial(nn.Linear, bias=False)


        # annot: @shard(to_out=Row(), local=("heads",)) applied for tp=2
        class Attention(nn.Module):
            def __init__(self, dim, heads, gate_out=False, out_bias=False):
                super().__init__()
                self.heads = heads
                if gate_out:
                    self.to_out = row_parallel(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GLU()), tp=2)
                elif out_bias:
                    self.to_out = RowParallelLinear(dim, dim, tp=2)
                else:
                    self.to_out = row_parallel(LinearNoBias(dim, dim), tp=2)

            def forward(self, x):
                return self.to_out(x.view(*x.shape[:-1], self.heads // 2, -1).flatten(-2))
        """,
    )


def test_branches_of_which_none_can_be_sharded_are_refused():
    err = refusal(
        HEAD
        + """
@shard(c=Row())
class M(nn.Module):
    def __init__(self, w, tied):
        if tied:
            self.c = nn.Embedding(4, 4)
        else:
            self.c = nn.Parameter(w)
"""
    )
    assert (err.line, err.col) == (11, 22)
    assert err.reason == (
        "c=Row(): Row() splits an nn.Linear, but self.c is an nn.Embedding; use Vocab() to "
        "split its rows, or Col() (no chunks) its columns"
    )


def test_refuses_a_raw_parameter_assigned_with_different_calls():
    err = refusal(
        HEAD
        + """
@shard(w=P("tp", None))
class M(nn.Module):
    def __init__(self, w, big):
        if big:
            self.w = nn.Parameter(w)
        else:
            self.w = make_parameter(w)
"""
    )
    assert (err.line, err.col) == (13, 22)
    assert err.reason == (
        "w=P('tp', None): self.w is assigned twice in __init__ with different calls "
        "(nn.Parameter(...) on line 11, make_parameter(...) here); annot splits a raw "
        "parameter where nn.Parameter(...) builds it and cannot tell which call does, so "
        "assign it once"
    )


def test_same_constructor_in_both_branches_is_rewritten_in_both():
    out = rewrite_tensor_parallel(
        HEAD
        + dedent(
            """
            @shard(c=Col())
            class M(nn.Module):
                def __init__(self, bias):
                    if bias:
                        self.c = nn.Linear(4, 8)
                    else:
                        self.c = tnn.Linear(4, 8, bias=False)
            """
        ),
        2,
    )
    assert out.count("ColumnParallelLinear(4, 8") == 2


def test_refuses_chained_or_unpacked_assignment_of_a_hinted_name():
    err = refusal(
        HEAD
        + "@shard(c=Col())\nclass M(nn.Module):\n    def __init__(self):\n"
        + "        self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4)\n"
    )
    assert (err.line, err.col) == (9, 9)
    assert "self.c is assigned in a chained or unpacking assignment" in err.reason


@pytest.mark.parametrize(
    "stmt, col, reason",
    [
        (
            "self.n_head += 1",
            9,
            "n_head is a per-rank size (local=) but M.forward updates it with 'self.n_head += 1'; "
            "annot divides reads of n_head by tp and cannot keep an in-place update correct: "
            "assign the result to a new name instead (n_head2 = n_head + ...)",
        ),
        (
            "C *= 2",
            9,
            "C is a per-rank size (local=) but M.forward updates it with 'C *= 2'; annot divides "
            "reads of C by tp and cannot keep an in-place update correct: assign the result to a "
            "new name instead (C2 = C + ...)",
        ),
        (
            "global C",
            9,
            "C is a per-rank size (local=) but M.forward declares it global; annot divides reads "
            "of local names inside a method only, so keep it a plain local variable or an "
            "attribute of self",
        ),
    ],
)
def test_refuses_local_sizes_it_cannot_keep_correct(stmt, col, reason):
    err = refusal(
        HEAD
        + '@shard(local=("n_head", "C"))\nclass M(nn.Module):\n'
        + "    def forward(self, x):\n        C = x.size(-1)\n"
        + f"        {stmt}\n        return C\n"
    )
    assert (err.line, err.col) == (10, col)
    assert err.reason == reason


def test_refuses_a_local_size_that_is_both_parameter_and_reassigned():
    err = refusal(HEAD + '@shard(local=("C",))\nclass M:\n    def f(self, C):\n        C = C + 1\n')
    assert (err.line, err.col) == (8, 17)
    assert err.reason.startswith("C is a per-rank size (local=) and both a parameter of M.f")


def test_refuses_syntax_errors_at_their_position():
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel("x = 1\ndef f(:\n    pass\n", 2, path="m.py")
    assert str(info.value).startswith("m.py:2:7: syntax error: invalid syntax")


@pytest.mark.parametrize(
    "decorator, col, reason",
    [
        (
            "@shard(c=Col(chunks=N))",
            21,
            "@shard on M: argument c: N is not a literal; annot reads hints without running "
            "your code, so write the value itself (a number, a string, True/False/None, or a "
            "tuple of those)",
        ),
        (
            "@shard(c=make_spec())",
            10,
            "@shard on M: c=make_spec() is not a spec; write one of Col(), Row(), Vocab(), "
            "Replicate(), P(...), Partial() or Heads() (imported from annot), e.g. c=Col()",
        ),
        (
            "@shard(c=Col)",
            10,
            "@shard on M: c=Col is a spec class, not a spec; write one of Col(), Row(), Vocab(), "
            "Replicate(), P(...), Partial() or Heads() (imported from annot), e.g. c=Col()",
        ),
        (
            "@shard(c=Col(chunks=0))",
            10,
            "@shard on M: c=: Col(chunks=0): chunks must be an int >= 1",
        ),
        (
            "@shard(c=Col(chunk=3))",
            10,
            "@shard on M: c=Col(chunk=3): Col.__init__() got an unexpected keyword argument 'chunk'",
        ),
        (
            "@shard(c=P('tp', 'tp'))",
            10,
            "@shard on M: c=: P('tp', 'tp'): at most one dim may be split over 'tp'",
        ),
        (
            '@shard(local=("n_head", 3))',
            25,
            '@shard on M: local=("n_head", 3); expected a tuple of attribute or variable names, '
            'e.g. local=("n_head", "n_embd")',
        ),
        (
            '@shard(local=("config..n",))',
            15,
            "@shard on M: local=(\"config..n\",): 'config..n' has an empty part; a per-rank size "
            "is an attribute of the module or a local variable of its forward ('n_head'), or a "
            "dotted path of attributes from the module ('config.n_head': the module's "
            "self.config.n_head)",
        ),
        (
            "@shard(Col())",
            8,
            "@shard on M: positional argument 'Col()'; @shard takes keyword arguments only, "
            "e.g. @shard(c_fc=Col())",
        ),
        (
            "@shard(**HINTS)",
            8,
            "@shard on M: **-unpacking is not read; annot reads hints without running your "
            "code, so write each hint out as name=Spec(...)",
        ),
        (
            "@shard(c=Col(), c=Row())",
            17,
            "@shard on M: argument c= given twice",
        ),
        (
            "@shard",
            1,
            "@shard must be called with its hints, e.g. @shard(c_fc=Col(), c_proj=Row())",
        ),
    ],
)
def test_refuses_decorator_arguments_that_are_not_literals(decorator, col, reason):
    err = refusal(
        HEAD
        + decorator
        + "\nclass M(nn.Module):\n    def __init__(self):\n        self.c = nn.Linear(2, 2)\n"
    )
    assert (err.line, err.col) == (6, col)
    assert err.reason == reason


def test_a_call_in_a_hint_is_refused_and_never_run(tmp_path):
    sentinel = tmp_path / "ran"
    source = (
        HEAD
        + f"@shard(c=Col(chunks=open({str(sentinel)!r}, 'w').write('x')))\n"
        + "class M(nn.Module):\n    def __init__(self):\n        self.c = nn.Linear(2, 2)\n"
    )
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel(source, 2, path="model.py")
    assert (info.value.line, info.value.col) == (6, 21)
    assert "is not a literal; annot reads hints without running your code" in info.value.reason
    with pytest.raises(RewriteError):
        read_shard_hints(source, "model.py")
    assert not sentinel.exists()


def test_refuses_two_shard_decorators_and_bad_arguments():
    err = refusal(HEAD + "@shard(c=Col())\n@shard(d=Row())\nclass M:\n    pass\n")
    assert (err.line, err.col) == (7, 1)
    assert err.reason == "class M has two @shard decorators; merge them into one"
    with pytest.raises(MeshError, match="tp must be an int >= 1"):
        rewrite_tensor_parallel("x = 1\n", 0)
    with pytest.raises(HintError, match="extra_hints="):
        rewrite_tensor_parallel("x = 1\n", 2, extra_hints={"M": {"c": Col()}})


def test_nothing_partial_on_error():
    # the first class is fine, the second is refused: no output at all
    source = (
        HEAD
        + "@shard(c=Col())\nclass A(nn.Module):\n    def __init__(self):\n"
        + "        self.c = nn.Linear(2, 2)\n\n"
        + "@shard(c=Vocab())\nclass B(nn.Module):\n    def __init__(self):\n"
        + "        self.c = nn.Linear(2, 2)\n"
    )
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel(source, 2)
    assert info.value.line == 14


# ---- sharded outputs across classes: the loss in the parent (Hugging Face's layout) ----

HF_HEAD = """import torch
import torch.nn as nn
import torch.nn.functional as F
from annot import shard, Col


@shard(decoder=Col())
class Head(nn.Module):
    def __init__(self, d, v):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.decoder = nn.Linear(d, v)

    def forward(self, x):
        return self.decoder(torch.tanh(self.dense(x)))


class Top(nn.Module):
    def __init__(self, d, v):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.cls = Head(d, v)

    def forward(self, x, labels):
        logits = self.cls(self.body(x))
"""


def test_head_submodule_loss_in_parent_is_vocab_parallel():
    assert_rewrite(
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from annot import shard, Col


        @shard(decoder=Col())
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.dense = nn.Linear(d, d)
                self.decoder = nn.Linear(d, v)

            def forward(self, x):
                return self.decoder(torch.tanh(self.dense(x)))


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, d)
                self.cls = Head(d, v)

            def forward(self, x, labels):
                logits = self.cls(self.body(x))
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
                return logits, loss  # sharded logits may be returned


        class Plain(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, v)

            def forward(self, x, labels):
                return F.cross_entropy(self.body(x), labels)
        """,
        """
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from annot import shard, Col
        from annot.runtime.tp_layers import ColumnParallelLinear
        from annot.runtime.vocab_loss import vocab_parallel_cross_entropy


        # annot: @shard(decoder=Col()) applied for tp=2
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.dense = nn.Linear(d, d)
                self.decoder = ColumnParallelLinear(d, v, tp=2)

            def forward(self, x):
                return self.decoder(torch.tanh(self.dense(x)))


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, d)
                self.cls = Head(d, v)

            def forward(self, x, labels):
                logits = self.cls(self.body(x))
                loss = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
                return logits, loss  # sharded logits may be returned


        class Plain(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.body = nn.Linear(d, v)

            def forward(self, x, labels):
                return F.cross_entropy(self.body(x), labels)
        """,
    )


def test_nested_two_level_head_and_tuple_outputs():
    # BertForMaskedLM's shape: cls -> predictions -> decoder, the loss two levels up,
    # and a wrapper that takes the logits out of the parent's tuple output
    before = """
        import torch.nn as nn
        from torch.nn import functional as G
        import annot


        @annot.shard(decoder=annot.Col())
        class Predictions(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.transform = nn.Linear(d, d)
                self.decoder = nn.Linear(d, v)

            def forward(self, h):
                h = self.transform(h)
                h = self.decoder(h)
                return h


        class MLMHead(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.predictions = Predictions(d, v)

            def forward(self, h):
                scores = self.predictions(h)
                return scores


        class ForMaskedLM(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.bert = nn.Linear(d, d)
                self.cls = MLMHead(d, v)

            def forward(self, x, labels):
                outputs = (self.bert(x),)
                scores = self.cls(outputs[0])
                loss = G.cross_entropy(scores.flatten(0, -2), labels.flatten())
                direct = G.cross_entropy(self.cls.predictions(outputs[0]).float(), labels)
                return (loss + direct,) + (scores,)


        class Wrapper(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.model = ForMaskedLM(d, v)

            def forward(self, x, labels):
                loss, logits = self.model(x, labels)
                out = self.model(x, labels)
                return G.cross_entropy(logits[:, 1:], labels) + G.cross_entropy(out[-1], labels)
        """
    after = before.replace(
        "@annot.shard(decoder=annot.Col())",
        "# annot: @shard(decoder=Col()) applied for tp=2",
    ).replace("self.decoder = nn.Linear(d, v)", "self.decoder = ColumnParallelLinear(d, v, tp=2)")
    after = after.replace("G.cross_entropy(", "vocab_parallel_cross_entropy(").replace(
        "        import annot\n",
        "        import annot\n"
        "        from annot.runtime.tp_layers import ColumnParallelLinear\n"
        "        from annot.runtime.vocab_loss import vocab_parallel_cross_entropy\n",
    )
    assert after.count("vocab_parallel_cross_entropy(") == 4
    assert_rewrite(before, after)


def test_cross_entropy_loss_modules_are_rewritten_with_their_arguments():
    before = """
        import torch
        import torch.nn as nn
        from torch.nn import CrossEntropyLoss
        from annot import shard, Col


        @shard(decoder=Col())
        class Head(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.decoder = nn.Linear(d, v)

            def forward(self, x):
                return self.decoder(x)


        class Top(nn.Module):
            def __init__(self, d, v):
                super().__init__()
                self.cls = Head(d, v)
                self.loss_fct = nn.CrossEntropyLoss(ignore_index=-1, reduction="sum")

            def forward(self, x, labels):
                logits = self.cls(x)
                loss_fct = CrossEntropyLoss()  # -100 index = padding token
                a = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
                b = self.loss_fct(logits, labels)
                c = nn.CrossEntropyLoss(label_smoothing=self.smoothing)(input=logits, target=labels)
                d = torch.nn.CrossEntropyLoss(None, None, 0)(logits, labels)
                return a + b + c + d
        """
    after = (
        before.replace(
            "from annot import shard, Col\n",
            "from annot import shard, Col\n"
            "        from annot.runtime.tp_layers import ColumnParallelLinear\n"
            "        from annot.runtime.vocab_loss import vocab_parallel_cross_entropy\n",
        )
        .replace("@shard(decoder=Col())", "# annot: @shard(decoder=Col()) applied for tp=2")
        .replace(
            "self.decoder = nn.Linear(d, v)", "self.decoder = ColumnParallelLinear(d, v, tp=2)"
        )
        .replace(
            "a = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))",
            "a = vocab_parallel_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))",
        )
        .replace(
            "b = self.loss_fct(logits, labels)",
            'b = vocab_parallel_cross_entropy(logits, labels, ignore_index=-1, reduction="sum")',
        )
        .replace(
            "c = nn.CrossEntropyLoss(label_smoothing=self.smoothing)(input=logits, target=labels)",
            "c = vocab_parallel_cross_entropy(input=logits, target=labels, "
            "label_smoothing=self.smoothing)",
        )
        .replace(
            "d = torch.nn.CrossEntropyLoss(None, None, 0)(logits, labels)",
            "d = vocab_parallel_cross_entropy(logits, labels, weight=None, size_average=None, "
            "ignore_index=0)",
        )
    )
    assert after.count("vocab_parallel_cross_entropy(") == 4
    assert_rewrite(before, after)


def test_cross_entropy_loss_import_alias_is_matched():
    # the HF_HEAD source has no CrossEntropyLoss import: add one for this case
    source = (
        HF_HEAD.replace(
            "import torch.nn as nn\n",
            "import torch.nn as nn\nfrom torch.nn import CrossEntropyLoss as CE\n",
        )
        + "        return CE(reduction='none')(logits, labels)\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return vocab_parallel_cross_entropy(logits, labels, reduction='none')\n" in out
    compile(out, "model.py", "exec")


def test_a_gathered_head_keeps_the_parent_loss_plain():
    source = HF_HEAD.replace("@shard(decoder=Col())", "@shard(decoder=Col(gather=True))") + (
        "        return F.cross_entropy(logits, labels), logits.softmax(-1)\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return F.cross_entropy(logits, labels), logits.softmax(-1)\n" in out
    assert "vocab_parallel_cross_entropy" not in out


_FIX = (
    "compute the loss with F.cross_entropy on it (annot makes that "
    "vocab_parallel_cross_entropy), or hint decoder=Col(gather=True) on Head so that every "
    "rank has the full logits"
)
_SHARDED = (
    "is vocab-sharded (Col() without gather on Head.decoder: each rank holds 1/2 of its last dim)"
)


@pytest.mark.parametrize(
    "line, col, reason",
    [
        (
            "loss = self.loss_function(logits, labels, vocab_size=8)",
            16,
            f"logits {_SHARDED}, and annot cannot tell what self.loss_function(...) computes, "
            f"so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = F.nll_loss(logits.float(), labels)",
            16,
            f"logits.float() {_SHARDED}, and annot cannot tell what F.nll_loss(...) computes, "
            f"so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = nn.NLLLoss()(logits, labels)",
            16,
            f"logits {_SHARDED}, and annot cannot tell what nn.NLLLoss()(...) computes, so it "
            f"cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "loss = self.my_loss((logits, labels))",
            16,
            f"(logits, labels) {_SHARDED}, and annot cannot tell what self.my_loss(...) "
            f"computes, so it cannot make it correct on a sharded value; {_FIX}",
        ),
        (
            "probs = F.softmax(logits, dim=-1)",
            17,
            f"logits {_SHARDED}, and F.softmax(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "lp = torch.log_softmax(logits[:, 0], -1)",
            14,
            f"logits[:, 0] {_SHARDED}, and torch.log_softmax(...) over its last dim would see "
            f"only this rank's slice; {_FIX}",
        ),
        (
            "best = logits.argmax(-1)",
            16,
            f"logits {_SHARDED}, and .argmax(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "v, i = torch.topk(logits, 5)",
            16,
            f"logits {_SHARDED}, and torch.topk(...) over its last dim would see only this "
            f"rank's slice; {_FIX}",
        ),
        (
            "loss = F.cross_entropy(logits.view(-1, self.vocab_size), labels.view(-1))",
            32,
            "logits.view(-1, self.vocab_size) feeds a loss, but logits "
            f"{_SHARDED}, and annot cannot prove the result keeps that per-rank last dim; "
            "write the last dim as logits.size(-1) (logits.view(-1, logits.size(-1))), or hint "
            "decoder=Col(gather=True) on Head so that every rank has the full logits",
        ),
        (
            "loss = nn.CrossEntropyLoss()(logits.flatten(), labels)",
            38,
            "logits.flatten() feeds a loss, but logits "
            f"{_SHARDED}, and annot cannot prove the result keeps that per-rank last dim; "
            "flatten only the leading dims (logits.flatten(0, -2)), or hint "
            "decoder=Col(gather=True) on Head so that every rank has the full logits",
        ),
        (
            "loss = nn.CrossEntropyLoss()(logits, labels, 3)",
            16,
            "the input of nn.CrossEntropyLoss()(...) is vocab-sharded (Col() without gather "
            "on Head.decoder); annot rewrites the call to vocab_parallel_cross_entropy(input, "
            "target, ...) but cannot map its arguments; call it as loss(input, target), or "
            "call F.cross_entropy(input, target) directly (annot makes that vocab-parallel)",
        ),
    ],
)
def test_refuses_sharded_logits_where_it_cannot_prove_the_loss(line, col, reason):
    err = refusal(HF_HEAD + f"        {line}\n        return logits\n")
    assert (err.line, err.col) == (26, col)
    assert err.reason == reason


def test_refuses_a_loss_module_whose_arguments_cannot_move():
    err = refusal(
        HF_HEAD.replace(
            "self.cls = Head(d, v)\n",
            "self.cls = Head(d, v)\n        self.loss_fct = nn.CrossEntropyLoss(ignore_index=self.pad)\n",
        )
        + "        return self.loss_fct(logits, labels)\n"
    )
    assert (err.line, err.col) == (27, 16)
    assert err.reason == (
        "self.loss_fct is nn.CrossEntropyLoss(ignore_index=self.pad) and its input is "
        "vocab-sharded (Col() without gather on Head.decoder); annot rewrites the call to "
        "vocab_parallel_cross_entropy(input, target, <the constructor's arguments>) but its "
        "argument ignore_index=self.pad is not a literal, so annot cannot move it to the call; "
        "call F.cross_entropy(input, target, ignore_index=...) directly (annot makes that "
        "vocab-parallel), or hint decoder=Col(gather=True) on Head"
    )


def test_sharded_values_it_does_not_follow_are_left_alone():
    # helpers, arithmetic and names with other definitions are documented as not seen
    source = HF_HEAD + (
        "        scaled = logits / 2.0\n"
        "        probs = F.softmax(scaled, -1)\n"
        "        other = postprocess(logits)\n"
        "        return F.cross_entropy(other, labels), probs\n"
    )
    out = rewrite_tensor_parallel(source, 2, path="model.py")
    assert "return F.cross_entropy(other, labels), probs\n" in out
    assert "probs = F.softmax(scaled, -1)\n" in out


_FLOW_HEAD = """import torch.nn as nn
import torch.nn.functional as F
from annot import shard, Col


@shard(lm_head=Col())
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8)

    def forward(self, x, y, t):
"""


@pytest.mark.parametrize(
    "body, rewritten",
    [
        # both branches sharded
        ("if t:\n    z = self.lm_head(x)\nelse:\n    z = self.lm_head(x[:, [-1]])", True),
        # the later assignment on the straight-line path decides
        ("z = post(x)\nz = self.lm_head(x)", True),
        ("z = self.lm_head(x)\nz = post(z)", False),
        # only one branch sharded: not provable, left alone
        ("z = post(x)\nif t:\n    z = self.lm_head(x)", False),
        # x = x.float() in a loop keeps it sharded
        ("z = self.lm_head(x)\nwhile t:\n    z = z.float()", True),
    ],
)
def test_names_follow_the_assignments_that_reach_the_loss(body, rewritten):
    lines = textwrap.indent(body + "\nreturn F.cross_entropy(z, y)\n", " " * 8)
    out = rewrite_tensor_parallel(_FLOW_HEAD + lines, 2, path="model.py")
    assert ("return vocab_parallel_cross_entropy(z, y)" in out) is rewritten
    compile(out, "model.py", "exec")


def test_an_assignment_later_in_a_loop_reaches_the_loss():
    body = "z = self.lm_head(x)\nfor i in t:\n    loss = F.cross_entropy(z, y)\n    z = post(z)\n"
    out = rewrite_tensor_parallel(
        _FLOW_HEAD + textwrap.indent(body + "return loss\n", " " * 8), 2, path="model.py"
    )
    assert "loss = F.cross_entropy(z, y)" in out


# ---- hint reading --------------------------------------------------------------------


def test_read_shard_hints_builds_specs():
    hints = read_shard_hints(
        dedent(
            """
            import annot as a
            from annot import shard, P

            @a.shard(c_attn=a.Col(chunks=3), c_proj=a.Row(), local=("n_head", "n_embd"))
            class Attn: pass

            @shard(wte=a.Vocab(), bias=a.Replicate(), w=P("tp", None), h=a.Col(gather=True), local="C")
            class GPT: pass

            class Plain: pass
            """
        )
    )
    assert hints == {
        "Attn": ShardSpec({"c_attn": Col(chunks=3), "c_proj": Row()}, ("n_head", "n_embd")),
        "GPT": ShardSpec(
            {"wte": Vocab(), "bias": Replicate(), "w": P("tp", None), "h": Col(gather=True)},
            ("C",),
        ),
    }


def test_read_stage_hints():
    hints = read_stage_hints(
        dedent(
            """
            import annot
            from annot import stage
            from annot.core.hints import stage as st

            @stage(split=["h.4", "h.8"], checkpoint=True)
            class A: pass

            @annot.stage(auto=True, cost="flops", memory="1KiB")
            class B: pass

            @st()
            class C: pass
            """
        )
    )
    assert hints == {
        "A": StageSpec(split=("h.4", "h.8"), checkpoint=True),
        "B": StageSpec(auto=True, cost="flops", memory=1024),
        "C": StageSpec(),
    }
    for bad, reason in [
        ('@stage(split=["h.4"], auto=True)', "either split=[...] or auto=True, not both"),
        ('@stage(cost="speed")', "expected 'time', 'flops' or 'params'"),
        ('@stage(memory="lots")', "expected bytes as an int or a string like '16GiB'"),
        ("@stage(splits=[])", "unknown argument splits=; @stage takes split=, auto=,"),
        ("@stage(split=SPLITS)", "SPLITS is not a literal"),
    ]:
        with pytest.raises(RewriteError, match=re.escape(reason)) as info:
            read_stage_hints(f"from annot import stage\n{bad}\nclass A: pass\n", "s.py")
        assert info.value.line == 2


def test_read_hints_refuses_duplicate_class_names():
    with pytest.raises(RewriteError, match="two classes named A carry @shard") as info:
        read_shard_hints(
            "from annot import shard\n@shard()\nclass A: pass\n@shard()\nclass A: pass\n"
        )
    assert (info.value.line, info.value.col) == (5, 7)


def test_format_hint_round_trips():
    for spec in [
        ShardSpec({"c_attn": Col(chunks=3, gather=True), "w": P(None, "tp")}, ("n_head",)),
        ShardSpec({"wte": Vocab(), "x": Replicate()}, ("a", "b")),
        ShardSpec(),
    ]:
        source = f"from annot import shard, Col, Row, Vocab, Replicate, P\n{format_hint(spec)}\nclass M: pass\n"
        assert read_shard_hints(source) == {"M": spec}
    stage = StageSpec(split=("h.2",), cost="time", memory=100, checkpoint=True)
    assert read_stage_hints(f"import annot\n@annot.{format_hint(stage)[1:]}\nclass M: pass\n") == {
        "M": stage
    }


# ---- the rewritten fixture runs, and equals single-device ------------------------------


def _rewritten_fixture_step(tmpdir: str) -> float:
    """One rank: rewrite the nanoGPT fixture for tp=2, import it, load the
    reference's weights into the shards, and compare loss, logits and every
    gradient with the single-device model."""
    import importlib.util
    import os

    import torch

    from annot import Mesh
    from annot.runtime import process_groups as rmesh
    from annot.runtime.state_dict import full_grads, load_full_state_dict
    from tests.fixtures import gpt_model as ref_module
    from tests.parity import assert_close, gather_last_dim

    path = Path(tmpdir) / f"gpt_tp2_rank{os.environ['RANK']}.py"
    path.write_text(rewrite_tensor_parallel(FIXTURE.read_text(), 2, path=str(FIXTURE)))
    spec = importlib.util.spec_from_file_location("gpt_tp2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    ctx = rmesh.init(Mesh(tp=2))
    cfg = dict(block_size=8, vocab_size=32, n_layer=1, n_head=4, n_embd=16, dropout=0.0)
    torch.manual_seed(3)
    ref = ref_module.GPT(ref_module.GPTConfig(**cfg))
    with rmesh.use(ctx):
        local = module.GPT(module.GPTConfig(**cfg))
        load_full_state_dict(local, ref.state_dict())
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 32, (2, 5), generator=g)
        y = torch.randint(0, 32, (2, 5), generator=g)
        y[0, 0] = -1  # ignore_index
        logits, loss = local(x, y)
        loss.backward()
        grads = full_grads(local)
    ref_logits, ref_loss = ref(x, y)
    ref_loss.backward()
    assert_close(loss, ref_loss, "loss")
    assert_close(gather_last_dim(logits, ctx.tp_group), ref_logits, "logits")
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, f"grad {name}")
    # the tied embedding / head weight is still one parameter on each rank
    assert local.transformer.wte.weight is local.lm_head.weight
    return loss.item()


def test_rewritten_fixture_matches_single_device_on_2_ranks(tmp_path):
    from annot.testing import run_ranks

    losses = run_ranks(_rewritten_fixture_step, 2, str(tmp_path), timeout=300)
    assert losses[0] == pytest.approx(losses[1])
