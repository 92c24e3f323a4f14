"""Layers decided by runtime type (annot.runtime.tp.convert): subclasses, factories,
partials, Sequential / ModuleDict entries and registries, by class and by
instance, against the single-device model on real gloo ranks."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn as nn

from annot.core.errors import HintError
from annot.core.specs import Col, Local, Row, Vocab
from annot.runtime.tp.convert import check_layer, layer_kind, to_parallel
from annot.testing import run_ranks
from tests.layer_styles_models import FusedLinear, ScaledEmbedding, StyledLM

HINTS = {
    "embed": Vocab(),
    "blocks.*.attn.proj.*": Col(),
    "blocks.*.attn.out": Row(),
    "blocks.*.mlp.fc1": Col(),
    "blocks.*.mlp.fc2": Row(),
    "blocks.0.ff.0": Col(),  # x-transformers' plain feed-forward: Linear at index 0
    "blocks.1.ff.0.0": Col(),  # its GLU variant: inside project_in
    "blocks.*.ff.2": Row(),
    "blocks.*.attn": Local("heads"),
}


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class Lora(nn.Linear):
    def __init__(self, n, m):
        super().__init__(n, m)
        self.lora = nn.Parameter(torch.zeros(m, n))

    def forward(self, x):
        return super().forward(x) + x @ self.lora.T


class ReadsWeight(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) / self.weight.norm()


def test_two_patterns_giving_one_path_different_specs_are_refused():
    from annot.core.hints import resolve_hints

    with pytest.raises(HintError) as err:
        resolve_hints(StyledLM(), {"blocks.*.mlp.fc[12]": Col(), "blocks.*.mlp.fc2": Row()})
    assert str(err.value) == (
        "hints: 'blocks.*.mlp.fc[12]' gives blocks.0.mlp.fc2 Col() but 'blocks.*.mlp.fc2' "
        "gives it Row(); make the patterns agree"
    )


def test_heads_names_a_forward_argument():
    from annot.build.hint_checks import check_shard_hints
    from annot.core.hints import resolve_hints
    from annot.core.specs import Heads

    model = StyledLM()
    specs, paths = resolve_hints(model, {"blocks.*.attn.x": Heads(dim=1)})
    assert paths["blocks.0.attn.x"] == Heads(dim=1)
    check_shard_hints(model, specs, 2, paths)
    specs, paths = resolve_hints(model, {"blocks.*.attn.mask": Heads(dim=1)})
    with pytest.raises(HintError) as err:
        check_shard_hints(model, specs, 2, paths)
    assert "Attention.forward has no argument 'mask' (its arguments: x); Heads() names" in str(
        err.value
    )
    specs, paths = resolve_hints(model, {"blocks.*.attn.x": Heads(dim=0, heads=3)})
    with pytest.raises(HintError, match=r"heads=3 is not divisible by tp \(2\)"):
        check_shard_hints(model, specs, 2, paths)


def test_kind_is_the_runtime_type():
    assert layer_kind(FusedLinear(4, 4)) == "linear"
    assert layer_kind(partial(nn.Linear, bias=False)(4, 4)) == "linear"
    assert layer_kind(ScaledEmbedding(8, 4, 2.0)) == "embedding"
    assert layer_kind(nn.Conv2d(4, 4, 1)) is None


def test_subclasses_taken_and_refused():
    check_layer(FusedLinear(4, 4), Col(), "h")  # same result as F.linear on a probe
    check_layer(ScaledEmbedding(8, 4, 2.0), Vocab(), "h")  # post-processes super()
    check_layer(Scaled(4, 4), Row(), "h")
    with pytest.raises(HintError) as err:
        check_layer(Scaled(4, 4), Col(), "hint c=Col()", "M.c")
    assert str(err.value).startswith(
        "hint c=Col(): M.c is a Scaled, and annot cannot show its own forward stays right "
        "when sharded (its forward computes something other than the base layer's output)"
    )
    with pytest.raises(HintError) as err:
        check_layer(Lora(4, 4), Row(), "h")
    assert "it holds more than weight and bias (lora), and it reads its input x outside" in str(
        err.value
    )
    with pytest.raises(HintError, match=r"it reads self.weight \(line 2 of its forward\)"):
        check_layer(ReadsWeight(8, 4), Vocab(), "h")
    with pytest.raises(HintError) as err:
        check_layer(nn.Conv2d(4, 4, 1), Row(), "hint c=Row()", "M.c")
    assert str(err.value) == (
        "hint c=Row(): annot shards nn.Linear, HF Conv1D and nn.Embedding (and their "
        "subclasses) but M.c is a Conv2d; hint a layer inside it, or Replicate() it"
    )
    with pytest.raises(HintError, match=r"applies to nn.Embedding, but M.c is a FusedLinear"):
        check_layer(FusedLinear(4, 4), Vocab(), "hint c=Vocab()", "M.c")


def test_converted_layers_keep_values_buffers_and_forward():
    torch.manual_seed(0)
    emb = ScaledEmbedding(8, 4, 3.0)
    ids = torch.tensor([[1, 7, 0]])
    conv = to_parallel(emb, Vocab(), 1)
    assert type(conv).__name__ == "VocabParallelEmbedding_ScaledEmbedding"
    assert dict(conv.state_dict()).keys() == dict(emb.state_dict()).keys()
    torch.testing.assert_close(conv(ids), emb(ids), rtol=0, atol=0)
    assert conv.embed_scale.item() == 3.0
    assert "embed_scale" in conv._non_persistent_buffers_set
    lin = FusedLinear(4, 6)
    x = torch.randn(2, 4)
    torch.testing.assert_close(to_parallel(lin, Col(chunks=2), 1)(x), lin(x))


def _parity(cache: str, built: bool):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import train_against_reference

    mesh = annot.Mesh(tp=2)
    if built:
        torch.manual_seed(0)
        model = annot.parallelize(StyledLM(), mesh=mesh, hints=HINTS, verify=True)
    else:
        model = annot.parallelize(StyledLM, mesh=mesh, seed=0, hints=HINTS, verify=True)
    torch.manual_seed(0)
    ref = StyledLM()
    kinds = {n: type(m).__name__ for n, m in model.module.named_modules()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32, (2, 6), generator=g) for _ in range(2)]
    train_against_reference(model, ref, batches, lambda m, ids: (m(ids, ids), {}), "tp=2", 1e-2)
    return kinds


@pytest.mark.parametrize("built", [False, True], ids=["class", "instance"])
def test_tp2_parity_with_layers_built_every_way(tmp_path, built):
    kinds = run_ranks(_parity, 2, str(tmp_path), built, timeout=300)[0]
    assert kinds["embed"] == "VocabParallelEmbedding_ScaledEmbedding"
    assert kinds["blocks.0.attn.proj.q"] == "ColumnParallelLinear"
    assert kinds["blocks.1.attn.out"] == "RowParallelLinear"
    assert kinds["blocks.0.ff.0"] == kinds["blocks.1.ff.0.0"] == "ColumnParallelLinear"
    assert kinds["blocks.1.ff.2"] == "RowParallelLinear"
    assert kinds["blocks.1.mlp.fc1"] == "ColumnParallelLinear"
