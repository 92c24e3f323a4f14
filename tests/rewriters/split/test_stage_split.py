"""Pipeline stage split of forward (annot.rewriters.split.stage_split): inline
before/after sources, executed stages composed and compared with forward, every
refusal with its position. Liveness is in test_liveness.py."""

from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from annot.core.errors import RewriteError
from annot.rewriters.split.stage_split import split_decorated, split_stages

# ---- helpers --------------------------------------------------------------------


def build(source: str, name: str, *args, seed: int = 0):
    """Exec a rewritten module and build ``name(*args)`` from a fixed seed."""
    ns: dict = {}
    exec(compile(source, f"<rewritten {name}>", "exec"), ns)
    torch.manual_seed(seed)
    model = ns[name](*args)
    model.eval()
    return model


def compose(model, n_stages: int, *args, **kwargs):
    """``stage_{n-1}(**...stage_1(**stage_0(*args, **kwargs)))``."""
    out = model._annot_stage_0(*args, **kwargs)
    for k in range(1, n_stages):
        assert isinstance(out, dict), f"stage {k - 1} must return a dict, got {type(out)}"
        out = getattr(model, f"_annot_stage_{k}")(**out)
    return out


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


HEAD = """\
import torch
import torch.nn as nn
from annot import boundary


class M(nn.Module):
    def forward(self, x, y=None):
"""  # forward is on line 7, col 5; its body starts on line 8, col 9


def module(body: str) -> str:
    return HEAD + textwrap.indent(textwrap.dedent(body), " " * 8)


def refused(source: str, boundaries, cls: str = "M") -> RewriteError:
    with pytest.raises(RewriteError) as info:
        split_stages(source, cls, boundaries, path="model.py")
    return info.value


# ---- the GPT-like model of the design --------------------------------------------

GPT_SRC = """\
import torch
import torch.nn as nn
from torch.nn import functional as F
from annot import stage


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = nn.LayerNorm(n)
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Cfg:
    vocab_size = 11
    block_size = 8
    n_embd = 6

    def __init__(self, n_layer=4):
        self.n_layer = n_layer


@stage(split=["transformer.h.2"])            # a new stage begins before this call
class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(config.n_embd) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)
        x = self.transformer.drop(tok_emb + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss
"""

GPT_STAGE_0 = """\
def _annot_stage_0(self, idx, targets=None):
    device = idx.device
    b, t = idx.size()
    pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
    tok_emb = self.transformer.wte(idx)
    x = self.transformer.drop(tok_emb + self.transformer.wpe(pos))
    for block in [*self.transformer.h][:2]:
        x = block(x)
    return {"x": x, "targets": targets}
"""

GPT_STAGE_1 = """\
def _annot_stage_1(self, x, targets):
    for block in [*self.transformer.h][2:]:
        x = block(x)
    x = self.transformer.ln_f(x)
    if targets is not None:
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    else:
        logits = self.lm_head(x[:, [-1], :])
        loss = None
    return logits, loss
"""


def gpt_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 11, (2, 5), generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    return idx, targets


def test_gpt_stage_sources():
    split = split_stages(GPT_SRC, "GPT", ["transformer.h.2"])
    assert [s.source for s in split.stages] == [GPT_STAGE_0, GPT_STAGE_1]
    s0, s1 = split.stages
    assert (s0.index, s0.method, s0.inputs, s0.outputs) == (
        0,
        "_annot_stage_0",
        ("idx", "targets"),
        ("x", "targets"),
    )
    assert (s1.index, s1.method, s1.inputs, s1.outputs) == (
        1,
        "_annot_stage_1",
        ("x", "targets"),
        None,
    )
    assert s0.modules == (
        "transformer.wte",
        "transformer.drop",
        "transformer.wpe",
        "transformer.h[0:2]",
    )
    assert s1.modules == ("transformer.h[2:]", "transformer.ln_f", "lm_head")
    assert split.output_arity == 2
    assert split.boundaries == ("transformer.h.2",)


def test_gpt_class_layout_after_rewrite():
    out = split_stages(GPT_SRC, "GPT", ["transformer.h.2"]).source
    assert "\n@stage" not in out
    assert (
        '# annot: @stage(split=["transformer.h.2"]) applied: 2 stages\n'
        "# a new stage begins before this call\n"
        "class GPT(nn.Module):\n"
    ) in out
    # forward is unchanged and the stages follow it, introduced by a comment
    forward = GPT_SRC[GPT_SRC.index("    def forward(self, idx") :]
    assert forward in out
    tail = out[out.index("        return logits, loss\n") :]
    assert tail.startswith(
        "        return logits, loss\n"
        "\n"
        "    # annot: pipeline stages of forward (boundaries: transformer.h.2)\n"
        "    def _annot_stage_0(self, idx, targets=None):\n"
    )
    assert textwrap.indent(GPT_STAGE_1, "    ") in out
    compile(out, "gpt.py", "exec")


@pytest.mark.parametrize("with_targets", [True, False])
def test_gpt_three_stages_compose_to_forward(with_targets):
    split = split_stages(GPT_SRC, "GPT", ["transformer.h.1", "transformer.h.3"])
    assert len(split.stages) == 3
    assert [s.modules[-1] for s in split.stages[:2]] == [
        "transformer.h[0:1]",
        "transformer.h[1:3]",
    ]
    assert split.stages[2].modules[0] == "transformer.h[3:]"
    assert "for block in [*self.transformer.h][1:3]:" in split.stages[1].source
    model = build(split.source, "GPT", build_cfg(split.source, 4))
    idx, targets = gpt_inputs()
    args = (idx, targets) if with_targets else (idx,)
    with torch.no_grad():
        assert_same(compose(model, 3, *args), model(*args))


def build_cfg(source: str, n_layer: int):
    ns: dict = {}
    exec(compile(source, "<cfg>", "exec"), ns)
    return ns["Cfg"](n_layer)


def test_rewrite_is_idempotent():
    once = split_stages(GPT_SRC, "GPT", ["transformer.h.2"]).source
    # splitting again replaces the stage methods with the same ones
    assert split_stages(once, "GPT", ["transformer.h.2"]).source == once
    # a class without @stage is left alone by split_decorated
    again, splits = split_decorated(once)
    assert again == once
    assert splits == {}


def test_split_decorated_reads_the_decorator():
    out, splits = split_decorated(GPT_SRC, path="gpt.py")
    assert out == split_stages(GPT_SRC, "GPT", ["transformer.h.2"]).source
    assert list(splits) == ["GPT"]
    assert splits["GPT"].boundaries == ("transformer.h.2",)
    # runtime-chosen boundaries override the decorator's
    out2, splits2 = split_decorated(GPT_SRC, boundaries={"GPT": ["transformer.ln_f"]})
    assert (
        splits2["GPT"]
        .stages[1]
        .source.startswith(
            "def _annot_stage_1(self, x, targets):\n    x = self.transformer.ln_f(x)\n"
        )
    )
    assert '# annot: @stage(split=["transformer.h.2"]) applied: 2 stages' in out2


def test_split_decorated_error_points_at_the_decorator_literal():
    src = GPT_SRC.replace('split=["transformer.h.2"]', 'split=["transformer.h.2", "nope"]')
    with pytest.raises(RewriteError) as info:
        split_decorated(src, path="gpt.py")
    line = src[: src.index('"nope"')].count("\n") + 1
    col = src.splitlines()[line - 1].index('"nope"') + 1
    assert (info.value.path, info.value.line, info.value.col) == ("gpt.py", line, col)
    assert "forward never calls self.nope" in info.value.reason
    assert "transformer.h (looped over)" in info.value.reason


def test_split_decorated_auto_needs_boundaries():
    src = GPT_SRC.replace('split=["transformer.h.2"]', "auto=True")
    with pytest.raises(RewriteError, match="automatic boundaries are chosen from the built model"):
        split_decorated(src)
    _, splits = split_decorated(src, boundaries={"GPT": ["transformer.h.1"]})
    assert len(splits["GPT"].stages) == 2


def test_split_decorated_several_classes_bottom_up():
    two = GPT_SRC + "\n\n" + GPT_SRC[GPT_SRC.index("@stage") :].replace("class GPT", "class GPT2")
    out, splits = split_decorated(two)
    assert list(splits) == ["GPT", "GPT2"]
    assert out.count("def _annot_stage_1(self, x, targets):") == 2
    assert "@stage(" not in out.replace("# annot: @stage(", "")
    compile(out, "two.py", "exec")


# ---- more models, executed ---------------------------------------------------------

MARKER_SRC = '''\
import torch
import torch.nn as nn
import annot as a


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.h = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.out = nn.Linear(4, 2)

    def forward(self, x, mask=None, *, scale: int = 2, **kwargs):
        """Docstring stays in forward only."""
        n = x.shape[0]
        if mask is None:
            bias = None
        else:
            bias = mask.float()
        h = self.inp(x)
        # blocks next
        a.boundary()
        for i, block in enumerate(self.h, 1):
            h = block(h) * i
            if bias is not None:
                h = h + bias
        h = self.out(h) + kwargs.get("shift", 0)
        return h, n
'''


def test_boundary_marker_enumerate_kwargs_none_and_int():
    split = split_stages(MARKER_SRC, "Net", ["h.2"])
    s0, s1, s2 = (s.source for s in split.stages)
    assert s0 == textwrap.dedent("""\
        def _annot_stage_0(self, x, mask=None, *, scale: int = 2, **kwargs):
            n = x.shape[0]
            if mask is None:
                bias = None
            else:
                bias = mask.float()
            h = self.inp(x)
            return {"h": h, "bias": bias, "kwargs": kwargs, "n": n}
        """)
    # the marker's comment moves to the start of the next stage; the marker goes
    assert s1 == textwrap.dedent("""\
        def _annot_stage_1(self, h, bias, kwargs, n):
            # blocks next
            for i, block in enumerate([*self.h][:2], 1):
                h = block(h) * i
                if bias is not None:
                    h = h + bias
            return {"h": h, "bias": bias, "kwargs": kwargs, "n": n}
        """)
    assert s2.startswith(
        "def _annot_stage_2(self, h, bias, kwargs, n):\n"
        "    for i, block in enumerate([*self.h][2:], 3):\n"
    )
    assert split.boundaries == ("boundary()@22", "h.2")
    assert "boundary()" not in "".join(s.source for s in split.stages)
    model = build(split.source, "Net")
    x = torch.randn(3, 4)
    with torch.no_grad():
        for mask in (None, torch.ones(3, 4)):
            for kw in ({}, {"shift": 0.5}):
                ref = model(x, mask, **kw)
                got = compose(model, 3, x, mask, **kw)
                assert_same(got, ref)
                assert isinstance(got[1], int)


ENUM_SRC = """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.h = nn.ModuleList([nn.Linear(3, 3) for _ in range(n)])

    def forward(self, x):
        outs = []
        for i, block in enumerate(self.h):
            x = block(x) + i
            outs.append(x.sum())
        return x, torch.stack(outs)
"""


@pytest.mark.parametrize("cuts", [["h.1"], ["h.2", "h.4"], ["h.1", "h.2", "h.3", "h.4"]])
def test_enumerate_loop_split(cuts):
    split = split_stages(ENUM_SRC, "Net", cuts)
    bounds = [0] + [int(c[2:]) for c in cuts] + [None]
    for stage, a, b in zip(split.stages, bounds, bounds[1:]):
        sl = f"{a or ''}:{'' if b is None else b}"
        start = f", {a}" if a else ""
        assert f"    for i, block in enumerate([*self.h][{sl}]{start}):\n" in stage.source
        assert stage.modules == (f"h[{a}:{'' if b is None else b}]",)
    # the list carried through the loop crosses every boundary
    assert all(s.outputs == ("x", "outs") for s in split.stages[:-1])
    model = build(split.source, "Net")
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert_same(compose(model, len(cuts) + 1, x), model(x))


BRANCH_SRC = """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 3)

    def forward(self, x, y=None):
        if y is not None:
            z = self.a(y)
        x = self.b(x)
        x = self.c(x)
        if x.sum() > 0:
            x = x * 2
        else:
            x = x - 1
        if y is not None:
            x = x + z
        return x
"""


def test_data_dependent_branch_and_maybe_assigned_value():
    split = split_stages(BRANCH_SRC, "Net", ["c"])
    s0 = split.stages[0].source
    # z is assigned on one path only: sent as None when unassigned
    assert "# annot: z may be unassigned here" in s0
    assert 'return {"x": x, "y": y, "z": locals().get("z")}' in s0
    assert split.stages[1].inputs == ("x", "y", "z")
    model = build(split.source, "Net")
    with torch.no_grad():
        for sign in (1.0, -1.0):
            x = torch.full((2, 3), sign) * 5
            for y in (None, torch.randn(2, 3)):
                # both branches of `if x.sum() > 0` run, depending on the data
                assert_same(compose(model, 2, x, y), model(x, y))


def test_loop_else_goes_to_the_last_piece_and_continue_is_kept():
    src = ENUM_SRC.replace(
        "            outs.append(x.sum())\n",
        "            if i == 2:\n                continue\n            outs.append(x.sum())\n"
        "        else:\n            outs.append(x.mean())\n",
    )
    split = split_stages(src, "Net", ["h.3"])
    assert "else:" not in split.stages[0].source
    assert "else:" in split.stages[1].source
    model = build(split.source, "Net")
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert_same(compose(model, 2, x), model(x))


def test_direct_element_call_and_reused_module():
    src = module("""\
        x = self.h[0](x)
        x = self.h[1](x)
        x = self.h[0](x)  # module re-use
        return x
        """).replace(
        "class M(nn.Module):\n",
        "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.h = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])\n\n",
    )
    split = split_stages(src, "M", ["h.1"])
    assert [s.modules for s in split.stages] == [("h.0",), ("h.1", "h.0")]
    model = build(split.source, "M")
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert_same(compose(model, 2, x), model(x))


def test_single_stage_and_whole_list_boundary():
    split = split_stages(GPT_SRC, "GPT", [])
    assert len(split.stages) == 1
    assert split.stages[0].outputs is None
    assert "(one stage: no boundaries)" in split.source
    # naming the list itself: the stage begins before the loop
    split = split_stages(GPT_SRC, "GPT", ["transformer.h"])
    assert split.stages[1].source.startswith(
        "def _annot_stage_1(self, x, targets):\n    for block in self.transformer.h:\n"
    )
    assert split.stages[1].modules[0] == "transformer.h"


def test_non_module_self_attributes_are_listed():
    src = GPT_SRC.replace(
        "        x = self.transformer.ln_f(x)\n",
        "        x = self.transformer.ln_f(x) * self.config.n_embd\n",
    )
    split = split_stages(src, "GPT", ["transformer.ln_f"])
    assert split.stages[1].modules == ("transformer.ln_f", "config.n_embd", "lm_head")
    assert split.stages[0].modules[-1] == "transformer.h"


def test_modules_of_helper_methods_are_included():
    src = GPT_SRC.replace(
        "    def forward(self, idx, targets=None):\n",
        "    def head(me, x):\n        return me.lm_head(me.norm(x))\n\n"
        "    def norm(this, x):\n        return this.transformer.ln_f(x)\n\n"
        "    def forward(self, idx, targets=None):\n",
    ).replace("        x = self.transformer.ln_f(x)\n", "        x = self.norm(x)\n")
    split = split_stages(src, "GPT", ["transformer.h.3"])
    # what the stage reads itself, then what the methods it calls read
    assert split.stages[1].modules == ("transformer.h[3:]", "norm", "lm_head", "transformer.ln_f")
    src = src.replace("logits = self.lm_head(x)\n", "logits = self.head(x)\n")
    split = split_stages(src, "GPT", ["norm"])
    assert split.stages[1].modules == ("norm", "head", "lm_head", "transformer.ln_f")


def test_qualified_class_name():
    src = "class Outer:\n" + textwrap.indent(GPT_SRC[GPT_SRC.index("class GPT") :], "    ")
    src = GPT_SRC[: GPT_SRC.index("@stage")] + src
    split = split_stages(src, "Outer.GPT", ["transformer.h.2"])
    assert [s.source for s in split.stages] == [GPT_STAGE_0, GPT_STAGE_1]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sets(st.sampled_from([f"transformer.h.{i}" for i in range(6)] + ["transformer.ln_f"])))
@example(set())
@example({"transformer.h.0", "transformer.h.5", "transformer.ln_f"})
@example({f"transformer.h.{i}" for i in range(1, 6)})
def test_random_boundaries_compose_to_forward(cuts):
    order = [f"transformer.h.{i}" for i in range(6)] + ["transformer.ln_f"]
    boundaries = [b for b in order if b in cuts]
    split = split_stages(GPT_SRC, "GPT", boundaries)
    assert len(split.stages) == len(boundaries) + 1
    model = build(split.source, "GPT", build_cfg(split.source, 6))
    idx, targets = gpt_inputs(len(cuts))
    with torch.no_grad():
        assert_same(compose(model, len(split.stages), idx, targets), model(idx, targets))
        assert_same(compose(model, len(split.stages), idx), model(idx))


# ---- refusals --------------------------------------------------------------------


def test_refuse_boundary_never_called():
    err = refused(
        module("""\
        x = self.a(x)
        for b in self.h:
            x = b(x)
        return x
        """),
        ["nope"],
    )
    assert (err.path, err.line, err.col) == ("model.py", 7, 5)
    assert "forward never calls self.nope" in err.reason
    assert "forward of M calls: a, h (looped over)" in err.reason
    assert str(err).startswith("model.py:7:5: boundary 'nope'")


@pytest.mark.parametrize(
    "body, where, pos",
    [
        ("if y is not None:\n    x = self.a(x)\nreturn x\n", "an `if` branch", (9, 17)),
        ("with torch.no_grad():\n    x = self.a(x)\nreturn x\n", "a `with` block", (9, 17)),
        ("try:\n    x = self.a(x)\nfinally:\n    pass\nreturn x\n", "a `try` statement", (9, 17)),
        ("while x.sum() > 0:\n    x = self.a(x)\nreturn x\n", "a `while` loop", (9, 17)),
        ("x = [self.a(v) for v in x]\nreturn x\n", "a comprehension", (8, 14)),
        ("f = lambda v: self.a(v)\nreturn f(x)\n", "a lambda", (8, 23)),
        ("def g(v):\n    return self.a(v)\nreturn g(x)\n", "a nested function", (9, 20)),
        ("for v in range(2):\n    x = self.a(x)\nreturn x\n", "the body of a `for` loop", (9, 17)),
    ],
)
def test_refuse_boundary_inside_nested_statement(body, where, pos):
    err = refused(module(body), ["a"])
    assert f"self.a is first called inside {where}" in err.reason
    assert "put `annot.boundary()` on its own line before the enclosing statement" in err.reason
    assert (err.line, err.col) == pos


def test_refuse_boundary_in_nested_loop():
    err = refused(module("if y:\n    for b in self.h:\n        x = b(x)\nreturn x\n"), ["h.1"])
    assert "self.h is first looped over inside an `if` branch" in err.reason
    assert (err.line, err.col) == (9, 13)


@pytest.mark.parametrize(
    "loop, pos",
    [
        ("for b in self.h[1:3]:\n    x = b(x)\n", (8, 18)),
        ("for i in range(len(self.h)):\n    x = self.h[i](x)\n", (8, 18)),
        ("for b in list(self.h):\n    x = b(x)\n", (8, 18)),
    ],
)
def test_refuse_loop_over_other_iterable(loop, pos):
    err = refused(module(loop + "return x\n"), ["h.1"])
    assert "annot can cut a loop only when it iterates the module list itself" in err.reason
    assert "write `for block in self.h:`" in err.reason
    assert (err.line, err.col) == pos


def test_refuse_enumerate_start_not_literal():
    err = refused(module("for i, b in enumerate(self.h, y):\n    x = b(x)\nreturn x\n"), ["h.1"])
    assert "start that is not an int literal" in err.reason
    assert (err.line, err.col) == (8, 9)


def test_refuse_return_before_boundary():
    err = refused(module("if y is None:\n    return x\nx = self.a(x)\nreturn x\n"), ["a"])
    assert "`return` in stage 0 of 2, before the boundary 'a'" in err.reason
    assert "only the last stage may return" in err.reason
    assert (err.line, err.col) == (9, 13)


def test_refuse_return_inside_split_loop():
    err = refused(
        module("for b in self.h:\n    if y:\n        return x\n    x = b(x)\nreturn x\n"), ["h.1"]
    )
    assert "`return` in stage 0 of 2" in err.reason
    assert (err.line, err.col) == (10, 17)


def test_refuse_yield():
    err = refused(module("x = self.a(x)\nyield x\n"), ["a"])
    assert "forward contains `yield`" in err.reason
    assert (err.line, err.col) == (9, 9)


@pytest.mark.parametrize("kw", ["global", "nonlocal"])
def test_refuse_global_and_nonlocal(kw):
    if kw == "global":
        body = "global G\nG = x\nx = self.a(x)\nreturn x\n"
        pos = (8, 9)
    else:
        body = "n = 0\ndef g():\n    nonlocal n\n    n += 1\nx = self.a(x)\nreturn x\n"
        pos = (10, 13)
    err = refused(module(body), ["a"])
    assert f"`{kw}` statement in forward" in err.reason
    assert (err.line, err.col) == pos


def test_refuse_loop_variable_used_after_split_loop():
    err = refused(module("for i, b in enumerate(self.h):\n    x = b(x)\nreturn x * i\n"), ["h.2"])
    assert (
        "loop variable 'i' of the loop over `enumerate(self.h)` is read after the loop"
        in err.reason
    )
    assert "`last = i`" in err.reason
    assert (err.line, err.col) == (10, 20)
    # a copy made inside the body is fine: every piece of the loop assigns it
    ok = module("for i, b in enumerate(self.h):\n    x = b(x)\n    last = i\nreturn x * last\n")
    split = split_stages(ok, "M", ["h.2"])
    assert split.stages[0].outputs == ("x",)
    assert split.stages[1].source.endswith("        last = i\n    return x * last\n")


def test_refuse_break_in_split_loop():
    err = refused(
        module("for b in self.h:\n    x = b(x)\n    if y:\n        break\nreturn x\n"), ["h.1"]
    )
    assert "`break` in a loop that is split into stages" in err.reason
    assert (err.line, err.col) == (11, 17)


def test_refuse_boundaries_out_of_order_and_duplicated():
    body = "x = self.a(x)\nx = self.b(x) + self.c(x)\nx = self.d(x)\nreturn x\n"
    err = refused(module(body), ["d", "b"])
    assert "boundaries out of forward order: 'b' (line 9) runs before 'd' (line 10)" in err.reason
    assert "['b', 'd']" in err.reason
    assert (err.line, err.col) == (7, 5)
    err = refused(module(body), ["b", "b"])
    assert "boundary 'b' is given twice" in err.reason
    err = refused(module(body), ["b", "c"])
    assert "boundaries 'b' and 'c' both begin a stage before line 9" in err.reason


def test_refuse_empty_first_and_last_stage():
    err = refused(module("x = self.a(x)\nreturn x\n"), ["a"])
    assert "leaving stage 0 empty" in err.reason
    err = refused(module("x = self.a(x)\nboundary()\n"), [])
    assert "leaving the last stage empty" in err.reason
    assert (err.line, err.col) == (9, 9)


def test_refuse_misplaced_boundary_marker():
    err = refused(module("x = self.a(x)\nif y:\n    boundary()\nreturn x\n"), [])
    assert "annot.boundary() inside an `if` branch" in err.reason
    assert (err.line, err.col) == (10, 13)
    err = refused(module("x = self.a(x)\nz = boundary()\nreturn x\n"), [])
    assert "must be a statement on its own line" in err.reason
    assert (err.line, err.col) == (9, 13)


def test_boundary_marker_comments_move_to_the_next_stage():
    src = module("x = self.a(x)\n# head\nboundary()  # the head is heavy\nreturn self.b(x)\n")
    split = split_stages(src, "M", [])
    assert split.stages[1].source == (
        "def _annot_stage_1(self, x):\n    # head\n    # the head is heavy\n    return self.b(x)\n"
    )
    assert split.boundaries == ("boundary()@10",)
    assert "(boundaries: boundary()@10)" in split.source


def test_boundary_marker_by_qualified_name_only():
    # a local function that happens to be called `boundary` is not the marker
    src = module("x = self.a(x)\nboundary()\nreturn x\n").replace(
        "from annot import boundary\n", "def boundary():\n    pass\n"
    )
    with pytest.raises(RewriteError, match="leaving stage 0 empty"):
        split_stages(src, "M", ["a"])
    assert len(split_stages(src, "M", []).stages) == 1


def test_refuse_closure_reading_a_name_a_later_stage_assigns():
    body = "k = 2\nf = lambda v: v * k\nx = self.a(x)\nk = 3\nreturn f(x)\n"
    err = refused(module(body), ["a"])
    assert "this lambda in stage 0 reads 'k', which a later stage assigns" in err.reason
    assert (err.line, err.col) == (9, 13)
    fine = "k = 2\nf = lambda v: v * k\nx = self.a(x)\nreturn f(x)\n"
    assert split_stages(module(fine), "M", ["a"]).stages[0].outputs == ("x", "f")


def test_refuse_missing_class_and_forward_and_syntax():
    with pytest.raises(RewriteError, match="class Nope is not defined"):
        split_stages(GPT_SRC, "Nope", [])
    err = refused("class M:\n    def other(self):\n        pass\n", [])
    assert "class M has no forward method" in err.reason
    assert (err.line, err.col) == (1, 1)
    with pytest.raises(RewriteError, match="syntax error"):
        split_stages("def (:\n", "M", [])


def test_errors_are_rewrite_errors_with_file_line_col():
    err = refused(module("x = self.a(x)\nyield x\n"), ["a"])
    assert str(err) == f"model.py:9:9: {err.reason}"
