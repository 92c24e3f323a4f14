"""The tensor-parallel rewriter (annot.rewriters.tp.rewrite): before/after
source pairs, refusals, the rewritten fixture run on 2 ranks. Each step has its
own file: test_tp_constructors, test_tp_local_sizes, test_tp_loss,
test_tp_reaching; hints are read in test_hint_reader and test_hint_literals.

Each case is an inline (before, after) pair in the spirit of LibCST's
``CodemodTest.assertCodemod``; every output must compile and be a fixed point
of the rewriter (rewriting it again changes nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from annot.core.errors import HintError, MeshError, RewriteError
from annot.core.hints import ShardSpec
from annot.core.specs import Col, Row
from annot.rewriters.source.diagnostics import unified_diff
from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from tests.rewriters.tp.cases import FIXTURE, HEAD, assert_rewrite, dedent, refusal

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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear

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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy


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
        from annot.runtime.tp.layers import shard_parameter


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
        from annot.runtime.tp.layers import VocabParallelEmbedding


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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        "from annot.runtime.tp.layers import RowParallelLinear\r\n"
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
        "from annot.runtime.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding",
        "from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy",
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


def test_refuses_syntax_errors_at_their_position():
    with pytest.raises(RewriteError) as info:
        rewrite_tensor_parallel("x = 1\ndef f(:\n    pass\n", 2, path="m.py")
    assert str(info.value).startswith("m.py:2:7: syntax error: invalid syntax")


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


# ---- the rewritten fixture runs, and equals single-device ------------------------------


def _rewritten_fixture_step(tmpdir: str) -> float:
    """One rank: rewrite the nanoGPT fixture for tp=2, import it, load the
    reference's weights into the shards, and compare loss, logits and every
    gradient with the single-device model."""
    import importlib.util
    import os

    import torch

    from annot import Mesh
    from annot.runtime import process_groups
    from annot.runtime.tp.state_dict import full_grads, load_full_state_dict
    from tests.fixtures import gpt_model as ref_module
    from tests.parity import assert_close, gather_last_dim

    path = Path(tmpdir) / f"gpt_tp2_rank{os.environ['RANK']}.py"
    path.write_text(rewrite_tensor_parallel(FIXTURE.read_text(), 2, path=str(FIXTURE)))
    spec = importlib.util.spec_from_file_location("gpt_tp2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    ctx = process_groups.init(Mesh(tp=2))
    cfg = dict(block_size=8, vocab_size=32, n_layer=1, n_head=4, n_embd=16, dropout=0.0)
    torch.manual_seed(3)
    ref = ref_module.GPT(ref_module.GPTConfig(**cfg))
    with process_groups.use(ctx):
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


def test_refuses_two_shard_decorators_and_bad_arguments():
    err = refusal(HEAD + "@shard(c=Col())\n@shard(d=Row())\nclass M:\n    pass\n")
    assert (err.line, err.col) == (7, 1)
    assert err.reason == "class M has two @shard decorators; merge them into one"
    with pytest.raises(MeshError, match="tp must be an int >= 1"):
        rewrite_tensor_parallel("x = 1\n", 0)
    with pytest.raises(HintError, match="extra_hints="):
        rewrite_tensor_parallel("x = 1\n", 2, extra_hints={"M": {"c": Col()}})
