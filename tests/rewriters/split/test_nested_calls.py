"""Stage splits below the root's forward, in source (``split_stages(..., nested=True)``,
``annot rewrite FILE:CLASS --pp N --split ...``).

Each level of the call chain gets stage methods; the statement that calls the
next level is cut in pieces. Checked by before/after source, by the stages
composing to ``forward`` on models written elsewhere (Hugging Face's installed
files, tests/nested_models.py's timm, torchvision and nn.Sequential styles),
and by one refusal per pattern left to the runtime cut.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from annot.core.errors import RewriteError
from annot.rewriters.split.stage_split import split_stages

CHAIN_SRC = """\
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Body(nn.Module):
    def __init__(self, n, depth):
        super().__init__()
        self.layers = nn.ModuleList([Block(n) for _ in range(depth)])
        self.depth = depth

    def forward(self, x, scale=1.0):
        h = x * scale
        for layer in self.layers[: self.depth]:
            h = layer(h)
        return h


class Net(nn.Module):
    def __init__(self, n=4, depth=4):
        super().__init__()
        self.inp = nn.Linear(n, n)
        self.body = Body(n, depth)
        self.head = nn.Sequential(nn.Linear(n, n), nn.ReLU(), nn.Linear(n, 2), nn.Tanh())

    def features(self, x):
        x = self.inp(x)
        h = self.body(x, scale=2.0)
        return h

    def forward(self, x):
        h = self.features(x)
        return self.head(h)[:, 0]
"""

_count = itertools.count()


def _load(source: str, name: str = "chain") -> types.ModuleType:
    mod = types.ModuleType(f"annot_nested_{name}_{next(_count)}")
    sys.modules[mod.__name__] = mod  # dataclasses read their module
    try:
        exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    return mod


def _compose(model, n: int, *args, **kwargs):
    out = model._annot_stage_0(*args, **kwargs)
    for k in range(1, n):
        assert isinstance(out, dict), f"stage {k - 1} returned {type(out)}"
        out = getattr(model, f"_annot_stage_{k}")(**out)
    return out


def _section(source: str, start: str, end: str) -> str:
    i = source.index(start)
    return source[i : source.index(end, i + len(start))]


def test_chain_through_a_helper_a_submodule_and_a_sliced_loop():
    split = split_stages(CHAIN_SRC, "Net", ["body.layers.2"], path="chain.py", nested=True)
    src = split.source
    body = _section(src, "    # annot: pipeline stages of Body.forward", "\n\n\nclass Net")
    assert body == (
        "    # annot: pipeline stages of Body.forward (boundaries: layers.2), run by the stages"
        " of Net.features\n"
        "    def _annot_stage_0(self, x, scale=1.0):\n"
        "        h = x * scale\n"
        "        for layer in [*self.layers[: self.depth]][:2]:\n"
        "            h = layer(h)\n"
        '        return {"h": h}\n'
        "\n"
        "    def _annot_stage_1(self, h):\n"
        "        for layer in [*self.layers[: self.depth]][2:]:\n"
        "            h = layer(h)\n"
        "        return h"
    )
    assert "    def _annot_features_stage_0(self, x):\n" in src
    assert (
        textwrap.indent(
            textwrap.dedent("""\
            def _annot_features_stage_0(self, x):
                x = self.inp(x)
                _annot_body = self.body._annot_stage_0(x, scale=2.0)
                return {"_annot_body": _annot_body}

            def _annot_features_stage_1(self, _annot_body):
                h = self.body._annot_stage_1(**_annot_body)
                return h
            """),
            "    ",
            lambda line: line.strip() != "",
        )
        in src
    )
    assert [s.source for s in split.stages] == [
        textwrap.dedent("""\
            def _annot_stage_0(self, x):
                _annot_features = self._annot_features_stage_0(x)
                return {"_annot_features": _annot_features}
            """),
        textwrap.dedent("""\
            def _annot_stage_1(self, _annot_features):
                h = self._annot_features_stage_1(**_annot_features)
                return self.head(h)[:, 0]
            """),
    ]
    assert split.boundaries == ("body.layers.2",)
    assert "def forward(self, x):\n        h = self.features(x)\n" in src  # kept as written
    mod = _load(src)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, 2, x), model(x), rtol=0, atol=0)


def test_a_sequential_called_whole_is_sliced_between_elements():
    split = split_stages(
        CHAIN_SRC, "Net", ["body.layers.1", "head.2"], path="chain.py", nested=True
    )
    s1 = split.stages[1].source
    assert s1 == textwrap.dedent("""\
        def _annot_stage_1(self, _annot_features):
            h = self._annot_features_stage_1(**_annot_features)
            _annot_head = self.head[:2](h)
            return {"_annot_head": _annot_head}
        """)
    assert split.stages[2].source == textwrap.dedent("""\
        def _annot_stage_2(self, _annot_head):
            return self.head[2:](_annot_head)[:, 0]
        """)
    mod = _load(split.source)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, 3, x), model(x), rtol=0, atol=0)


def _hf(module: str, cls: str, cfg: str, splits: list[str]):
    """An installed transformers model file split at ``splits``, loaded as a
    sibling module (its relative imports resolve), and the original class."""
    transformers = pytest.importorskip("transformers")
    orig = importlib.import_module(module)
    with open(orig.__file__) as f:
        split = split_stages(f.read(), cls, splits, path=orig.__file__, nested=True)
    name = f"{module}_annot_{next(_count)}"
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = orig.__package__, orig.__file__
    sys.modules[name] = mod  # transformers reads a class's module
    try:
        exec(compile(split.source, orig.__file__, "exec"), mod.__dict__)
    finally:
        del sys.modules[name]
    config = eval(cfg, {"T": transformers})
    return getattr(orig, cls), getattr(mod, cls), config, len(split.stages)


HF = {
    "llama": (
        "transformers.models.llama.modeling_llama",
        "LlamaForCausalLM",
        "T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,"
        " num_attention_heads=4, num_key_value_heads=2)",
        "tokens",
    ),
    "gpt2": (
        "transformers.models.gpt2.modeling_gpt2",
        "GPT2LMHeadModel",
        "T.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=16)",
        "tokens",
    ),
    "bert": (  # three levels: BertForMaskedLM -> BertModel -> BertEncoder's loop
        "transformers.models.bert.modeling_bert",
        "BertForMaskedLM",
        "T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,"
        " intermediate_size=64)",
        "tokens",
    ),
    "t5": (  # the decoder stack, whose decorator gives use_cache its config default
        "transformers.models.t5.modeling_t5",
        "T5ForConditionalGeneration",
        "T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,"
        " decoder_start_token_id=0, pad_token_id=0)",
        "seq2seq",
    ),
    "vit": (
        "transformers.models.vit.modeling_vit",
        "ViTForImageClassification",
        "T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,"
        " num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, num_labels=5)",
        "images",
    ),
}


@pytest.mark.parametrize(
    "case, splits",
    [
        ("llama", ["model.layers.1"]),
        ("llama", ["model.layers.1", "model.layers.3", "lm_head"]),  # pp=4
        ("gpt2", ["transformer.h.1"]),
        ("bert", ["bert.encoder.layer.1", "bert.encoder.layer.2"]),
        ("t5", ["decoder.block.1"]),
        ("t5", ["decoder.block.1", "decoder.block.2"]),
        ("vit", ["vit.layers.2"]),
    ],
)
def test_hf_models_stages_compose_to_forward(case, splits):
    module, cls, cfg, inputs = HF[case]
    orig_cls, staged_cls, config, n = _hf(module, cls, cfg, splits)
    assert n == len(splits) + 1
    torch.manual_seed(0)
    ref = orig_cls(config).eval()
    model = staged_cls(config).eval()
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    if inputs == "images":
        kw = {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    else:
        ids = torch.randint(0, 64, (2, 8), generator=g)
        kw = {"input_ids": ids, "labels": ids}
    want, got = ref(**kw), _compose(model, n, **kw)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    if "labels" in kw:
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize(
    "cls, splits, x",
    [
        ("TimmStyleViT", ["blocks.1"], (2, 3, 8, 8)),  # forward -> forward_features -> Sequential
        ("TorchvisionStyleResNet", ["layer2"], (2, 3, 8, 8)),  # return self._forward_impl(x)
        ("TorchvisionStyleResNet", ["layer1.1", "layer3"], (2, 3, 8, 8)),
        ("SequentialMLP", ["net.2"], (2, 8)),
    ],
)
def test_library_styles_compose_to_forward(cls, splits, x):
    import tests.nested_models as styles

    with open(styles.__file__) as f:
        split = split_stages(f.read(), cls, splits, path=styles.__file__, nested=True)
    mod = _load(split.source, cls)
    torch.manual_seed(0)
    model = getattr(mod, cls)().eval()
    inp = torch.randn(*x)
    torch.testing.assert_close(_compose(model, len(splits) + 1, inp), model(inp), rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["body", "body.layers.1", "body.layers.2", "body.layers.3", "head", "head.1", "head.3"]
        ),
        min_size=1,
        max_size=4,
        unique=True,
    )
)
def test_drawn_boundaries_across_depths_compose_to_forward(picked):
    order = ["body", "body.layers.1", "body.layers.2", "body.layers.3", "head", "head.1", "head.3"]
    cuts = sorted(picked, key=order.index)
    split = split_stages(CHAIN_SRC, "Net", cuts, path="chain.py", nested=True)
    mod = _load(split.source)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, len(cuts) + 1, x), model(x), rtol=0, atol=0)


# ---- refusals: each with where and what to do --------------------------------------


def _refused(source: str, cls: str, splits: list[str]) -> RewriteError:
    with pytest.raises(RewriteError) as info:
        split_stages(source, cls, splits, path="m.py", nested=True)
    return info.value


def test_refuse_a_call_evaluated_after_another_call():
    src = CHAIN_SRC.replace(
        "        h = self.body(x, scale=2.0)\n", "        h = x.relu() + self.body(x)\n"
    )
    err = _refused(src, "Net", ["body.layers.2"])
    assert "the call of self.body is evaluated after other calls of its statement" in err.reason
    assert "`out = self.body(...)`" in err.reason
    assert (err.line, err.col) == (36, 24)


def test_refuse_cuts_below_two_calls_of_one_statement():
    src = CHAIN_SRC.replace(
        "        h = self.features(x)\n        return self.head(h)[:, 0]\n",
        "        return self.head(self.features(x))[:, 0]\n",
    )
    err = _refused(src, "Net", ["body.layers.2", "head.2"])
    assert err.reason == (
        "boundary 'head.2' lies below self.head(...) and another below self.features(...), in "
        "the same statement; split the statement in two"
    )
    assert (err.line, err.col) == (40, 16)


def test_refuse_a_call_inside_a_branch():
    src = CHAIN_SRC.replace(
        "        h = self.body(x, scale=2.0)\n",
        "        h = x\n        if x.sum() > 0:\n            h = self.body(x)\n",
    )
    err = _refused(src, "Net", ["body.layers.2"])
    assert "lies below self.body(...), which is called inside an `if` branch" in err.reason
    assert (err.line, err.col) == (38, 17)


def test_refuse_a_boundary_inside_a_block_of_a_loop():
    err = _refused(CHAIN_SRC, "Net", ["body.layers.2.fc"])
    assert "'body.layers.2.fc' is inside element 2 of the loop over self.layers" not in err.reason
    assert "boundary 'layers.2.fc' is inside element 2 of the loop over self.layers" in err.reason
    assert "annot.parallelize(..., split=[...])" in err.reason
    assert (err.line, err.col) == (22, 9)


def test_refuse_inside_an_element_of_a_sequential_called_whole():
    err = _refused(CHAIN_SRC, "Net", ["head.2.weight"])
    assert "self.head is an nn.Sequential called whole; in source annot cuts it between" in (
        err.reason
    )


def test_refuse_a_submodule_whose_class_is_elsewhere():
    src = CHAIN_SRC.replace("self.body = Body(n, depth)", "self.body = torch.nn.Identity()")
    err = _refused(src, "Net", ["body.layers.2"])
    assert "self.body is built by `torch.nn.Identity` in Net.__init__, which is not a class of" in (
        err.reason
    )
    assert "annot rewrite follows a call only into a class whose source it has" in err.reason


def test_refuse_one_class_split_at_two_places():
    src = CHAIN_SRC.replace(
        "        h = self.body(x, scale=2.0)\n",
        "        h = self.body(x, scale=2.0)\n        h = self.body2(h)\n",
    ).replace(
        "self.body = Body(n, depth)",
        "self.body = Body(n, depth)\n        self.body2 = Body(n, depth)",
    )
    err = _refused(src, "Net", ["body.layers.2", "body2.layers.1"])
    assert "Body.forward would be split twice, at ['layers.2'] and at ['layers.1']" in err.reason


def test_refuse_t5s_encoder_called_in_a_branch():
    """T5 runs its encoder only when no encoder_outputs are given: a real refusal."""
    with pytest.raises(RewriteError) as info:
        _hf(*HF["t5"][:3], ["encoder.block.2", "decoder.block.2"])
    err = info.value
    assert err.reason.startswith(
        "boundary 'encoder.block.2' lies below self.encoder(...), which is called inside an "
        "`if` branch"
    )
    assert err.path.endswith("modeling_t5.py")


def test_without_nested_the_runtime_cut_is_left_to_the_runtime():
    with pytest.raises(RewriteError) as info:
        split_stages(CHAIN_SRC, "Net", ["body.layers.2"], path="m.py")
    assert "forward never calls self.body.layers.2" in info.value.reason


def test_a_stage_decorator_naming_a_nested_boundary_is_followed():
    from annot.rewriters.split.stage_split import split_decorated

    src = CHAIN_SRC.replace(
        "class Net(nn.Module):",
        'from annot import stage\n\n\n@stage(split=["body.layers.3"])\nclass Net(nn.Module):',
    )
    out, splits = split_decorated(src, path="m.py", nested=True)
    assert splits["Net"].boundaries == ("body.layers.3",)
    assert '# annot: @stage(split=["body.layers.3"]) applied: 2 stages' in out
    assert "        for layer in [*self.layers[: self.depth]][3:]:\n" in out
    mod = _load(out)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, 2, x), model(x), rtol=0, atol=0)


def test_the_callee_state_takes_a_name_of_its_own():
    src = CHAIN_SRC.replace(
        "        h = self.body(x, scale=2.0)\n        return h\n",
        "        _annot_body = x * 2\n        h = self.body(x, scale=2.0)\n        return h + _annot_body\n",
    )
    split = split_stages(src, "Net", ["body.layers.2"], path="m.py", nested=True)
    assert "        _annot_body_ = self.body._annot_stage_0(x, scale=2.0)\n" in split.source
    mod = _load(split.source)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, 2, x), model(x), rtol=0, atol=0)


def test_refuse_a_read_the_callee_may_change_before_the_call():
    src = CHAIN_SRC.replace(
        "        h = self.features(x)\n", "        h = self.depth * self.features(x)\n"
    )
    err = _refused(src, "Net", ["body.layers.2"])
    assert "the call of self.features is evaluated after other calls of its statement" in err.reason
    # a local name cannot change: that one stays
    src = CHAIN_SRC.replace(
        "        h = self.features(x)\n",
        "        h = x.sum() + 0\n        h = h * self.features(x)\n",
    )
    split = split_stages(src, "Net", ["body.layers.2"], path="m.py", nested=True)
    assert "        h = h * self._annot_features_stage_1(**_annot_features)\n" in split.source


def test_refuse_a_prefix_whose_length_the_loop_may_change():
    src = CHAIN_SRC.replace(
        "        for layer in self.layers[: self.depth]:\n            h = layer(h)\n",
        "        n = self.depth\n        for layer in self.layers[:n]:\n            h = layer(h)\n            n = n - 1\n",
    )
    err = _refused(src, "Net", ["body.layers.2"])
    assert "forward loops over `self.layers[:n]`; annot can cut a loop only when it iterates" in (
        err.reason
    )
    assert err.reason.endswith(
        "[in Body, called as self.body(...) by Net.features: its paths are the given ones less 'body.']"
    )


def test_refuse_a_nested_forward_with_a_decorator_that_wraps_the_call():
    src = CHAIN_SRC.replace(
        "    def forward(self, x, scale=1.0):\n",
        "    @torch.no_grad()\n    def forward(self, x, scale=1.0):\n",
    )
    err = _refused(src, "Net", ["body.layers.2"])
    assert err.reason.startswith(
        "Body.forward is decorated with @torch.no_grad(), which wraps the whole call; its stage "
        "methods cannot keep it."
    )
    assert (err.line, err.col) == (20, 5)


def test_a_callee_forward_defined_by_a_base_class_in_the_file():
    """x-transformers' style: ``Decoder(AttentionLayers)`` runs its base's forward."""
    src = CHAIN_SRC.replace(
        "class Net(nn.Module):", "class Deep(Body):\n    pass\n\n\nclass Net(nn.Module):"
    ).replace("self.body = Body(n, depth)", "self.body = Deep(n, depth)")
    split = split_stages(src, "Net", ["body.layers.2"], path="m.py", nested=True)
    assert "pipeline stages of Body.forward (boundaries: layers.2)" in split.source
    mod = _load(split.source)
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(3, 4)
    torch.testing.assert_close(_compose(model, 2, x), model(x), rtol=0, atol=0)


def test_each_stage_holds_its_part_of_the_callees():
    """A stage method calling a callee's stage (``self.body._annot_stage_0``,
    through the helper ``features``) holds what that part reads, under the
    callee's path (``body/layers[0:2]``: read relative to ``body``), so the
    runtime keeps ``body.layers.0-1`` on stage 0, not the whole ``body``."""
    split = split_stages(CHAIN_SRC, "Net", ["body.layers.2"], path="m.py", nested=True)
    assert [s.modules for s in split.stages] == [
        ("inp", "body/layers[0:2]", "body/depth"),
        ("body/layers[2:]", "body/depth", "head"),
    ]
    assert split.wrappers == ()


def test_a_forward_whose_decorator_wraps_its_outputs_is_named():
    """HF's @capture_outputs on a nested forward runs on its first stage only,
    @can_return_tuple on the root's on each stage; the split names them, and
    which call arguments ask them for what only the whole call can give."""
    src = CHAIN_SRC.replace(
        "    def forward(self, x, scale=1.0):\n",
        "    @capture_outputs\n    def forward(self, x, scale=1.0):\n",
    ).replace("    def forward(self, x):\n", "    @can_return_tuple\n    def forward(self, x):\n")
    split = split_stages(src, "Net", ["body.layers.2"], path="m.py", nested=True)
    assert set(split.wrappers) == {
        ("Body.forward", "capture_outputs"),
        ("Net.forward", "can_return_tuple"),
    }
    assert split.output_request({}, None) is None
    assert split.output_request({"return_dict": True}, None) is None
    asked = split.output_request({"output_hidden_states": True}, None)
    assert asked == "output_hidden_states=True (for @capture_outputs on Body.forward)"
    # the root's @can_return_tuple takes return_dict: the runner gives it around the call
    assert split.tuple_at_root
    assert split.output_request({"return_dict": False}, None) is None

    class Config:
        output_attentions = True

    assert split.output_request({}, Config()).startswith("output_attentions=True")

    class TupleConfig:  # read by every stage's decorator
        return_dict = False

    assert split.output_request({}, TupleConfig()) == (
        "return_dict=False (for @can_return_tuple on Net.forward)"
    )
    # only the nested forward's decorator takes it: the call's is refused
    nested_only = split_stages(
        src.replace("    @can_return_tuple\n", ""),
        "Net",
        ["body.layers.2"],
        path="m.py",
        nested=True,
    )
    assert nested_only.forwards == ("Net.forward", "Net.features", "Body.forward")
    assert not nested_only.tuple_at_root
    assert nested_only.output_request({"return_dict": False}, None) == (
        "return_dict=False (for @capture_outputs on Body.forward)"
    )
