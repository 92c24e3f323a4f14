"""No hints, no tp plan: the hints read off the model's sources
(:mod:`annot.plan.inferred_hints`), on models written as third-party packages
write them. Each trains at tp2 equal to the single-device model (the loss and
every gradient at each step, every parameter after 2 AdamW steps); a model
whose sources show nothing to split is refused, naming why for each Linear."""

import pytest

from annot.testing import RanksFailed, run_ranks


def _tiny_lm(cache: str, instance: bool, pp: int = 1, compiled: bool = False):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import train_pair_lm_against_reference
    from tests.thirdparty_models import TinyLM

    mesh = annot.Mesh(pp=pp, tp=2)
    kw = {"split": ["layers.2"] if pp > 1 else None}
    if compiled:
        kw["compile"] = {"backend": "aot_eager"}
    if instance:
        torch.manual_seed(0)
        model = annot.parallelize(TinyLM(), mesh=mesh, **kw)
    else:
        model = annot.parallelize(TinyLM, mesh=mesh, seed=0, **kw)
    assert model.report.inferred.hints["layers.*.attn.qkv"] == annot.Col(chunks=3)
    torch.manual_seed(0)
    step, (x, y) = train_pair_lm_against_reference(model, TinyLM(), "no hints")
    # each class the hints split checked on the first call, where this rank holds it
    held = (
        ["layers.0", "layers.0.attn"] if model.ctx.pp_rank == 0 else ["layers.2", "layers.2.attn"]
    )
    assert model.report.inferred.checked == held, model.report.inferred.checked
    assert "tp hints read off the sources" in step.explain(x, y)
    return True


@pytest.mark.parametrize("instance", [False, True], ids=["class", "instance"])
def test_tiny_lm_tp2_without_hints(tmp_path, instance):
    assert run_ranks(_tiny_lm, 2, str(tmp_path), instance) == [True, True]


@pytest.mark.slow
def test_tiny_lm_pp2_tp2_without_hints(tmp_path):
    """Each pipeline rank checks the classes of its own stages."""
    assert run_ranks(_tiny_lm, 4, str(tmp_path), False, 2, timeout=300) == [True] * 4


@pytest.mark.slow
def test_tiny_lm_tp2_compiled_without_hints(tmp_path):
    """The first-call check runs eagerly inside torch.compile (compiler.disable)."""
    assert run_ranks(_tiny_lm, 2, str(tmp_path), False, 1, True, timeout=300) == [True] * 2


def _mixed_heads(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.thirdparty_models import MixedHeadsNet

    model = annot.parallelize(MixedHeadsNet, mesh=annot.Mesh(tp=2), seed=0)
    assert model.report.inferred.hints  # read as an attention...
    x = torch.randn(2, 4, 16)
    model(x)  # ...and refused on the first call, before backward
    return False


def test_a_wrong_reading_is_refused_on_the_first_call(tmp_path):
    with pytest.raises(RanksFailed) as err:
        run_ranks(_mixed_heads, 2, str(tmp_path))
    for text in err.value.failures.values():
        assert "HintError: the tp hints annot read off the source of MixedHeads" in text
        assert "'blocks.0.attn' at tp=2 gives other outputs than the whole module" in text


def _vit(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.nested_models import TimmStyleViT
    from tests.parity import assert_close, compare_grads, compare_state, step_both

    model = annot.parallelize(TimmStyleViT, mesh=annot.Mesh(tp=2), seed=0)
    assert model.report.inferred.hints["blocks.*.attn"] == annot.Local("heads", "C")
    torch.manual_seed(0)
    ref = TimmStyleViT()
    # the key bias's true gradient is zero (softmax ignores a constant on every key):
    # eps above its float noise, or Adam turns the noise into updates of ~lr
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"step {i} loss")
        compare_grads(model, ref, f"step {i}")
        step_both(opt, ref_opt)
    compare_state(model, ref, "after 2 steps")
    return True


def test_timm_style_vit_tp2_without_hints(tmp_path):
    """timm's fused (3, heads, head_dim) reshape: Col(chunks=3), Local('heads', 'C')."""
    assert run_ranks(_vit, 2, str(tmp_path)) == [True, True]


def _nothing(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.nested_models import TorchvisionStyleResNet

    annot.parallelize(TorchvisionStyleResNet, mesh=annot.Mesh(tp=2), seed=0)


def test_nothing_to_split_is_refused(tmp_path):
    with pytest.raises(RanksFailed) as err:
        run_ranks(_nothing, 2, str(tmp_path))
    for text in err.value.failures.values():
        assert "HintError: tp=2, but nothing in TorchvisionStyleResNet says how to split it" in text
        assert "Read from the sources, every Linear stays whole" in text
