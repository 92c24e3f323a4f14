"""Step 2 of the tensor-parallel rewrite (annot.rewriters.tp.constructors): the
constructors swapped in ``__init__``, and the specs and assignments it refuses."""

from __future__ import annotations

import pytest

from annot.core.errors import RewriteError
from annot.core.hints import ShardSpec
from annot.core.specs import Col
from annot.rewriters.tp.rewrite import rewrite_tensor_parallel
from tests.rewriters.tp.cases import HEAD, assert_rewrite, dedent, refusal


def test_layers_built_by_subclasses_factories_and_partials_are_converted():
    # What the call builds is decided at runtime (annot.runtime.tp.convert), so the call stays.
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
        from annot.runtime.tp.convert import column_parallel, partial_module, row_parallel, vocab_parallel

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
        from annot.runtime.tp.convert import row_parallel
        from annot.runtime.tp.layers import RowParallelLinear

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


def test_extra_hints_on_what_a_base_assigns_are_left_to_conversion_by_path():
    # PEFT's lora.Linear: LoraLayer.__init__ (a base) assigns base_layer
    source = """
import torch.nn as nn
class Layer(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base_layer = base
class Linear(Layer):
    def __init__(self, base):
        super().__init__(base)
        self.scale = 2.0
"""
    hints = {"Linear": ShardSpec({"base_layer": Col()})}
    out = rewrite_tensor_parallel(source, 2, extra_hints=hints, extra_by_path=True)
    assert out == source.replace(
        "class Linear(", "# annot: @shard(base_layer=Col()) applied for tp=2\nclass Linear("
    )  # the constructor left as it was
    with pytest.raises(RewriteError, match="Linear.__init__ never assigns self.base_layer"):
        rewrite_tensor_parallel(source, 2, extra_hints=hints)
