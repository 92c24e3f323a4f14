"""Step 3 of the tensor-parallel rewrite (annot.rewriters.tp.local_sizes): per-rank
sizes (``local=``) divided where they are read, and the updates it refuses."""

from __future__ import annotations

import pytest

from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from tests.rewriters.tp.cases import HEAD, assert_rewrite, refusal


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
        from annot.runtime.tp.layers import ColumnParallelLinear

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
        from annot.runtime.tp.layers import ColumnParallelEmbedding

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
