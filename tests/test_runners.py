"""The two stage runners (annot.runtime.runners.stage_runner) on the same plan: the source
split, the build's fast path where the rewriter can cut the root's forward, and the
replay, which cuts any plan, give identical losses and every gradient, on real
gloo ranks; the choice is made once at build, recorded and shown by explain."""

import pytest

from annot.testing import run_ranks


def _both_runners(model_name: str, split: list, chunks: int, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    pp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if model_name == "branchy":
        from tests.pipeline_models import Branchy

        cls, args = Branchy, ()
        g = torch.Generator().manual_seed(1)
        batches = [
            (
                (torch.randint(0, 16, (4, 6), generator=g),),
                {"targets": torch.randint(0, 16, (4, 6), generator=g), "scale": 0.5},
            )
            for _ in range(2)
        ]
    elif model_name == "two_tower":  # raw parameters read between the towers' calls
        from tests.nested_models import TwoTower

        cls, args = TwoTower, ()
        g = torch.Generator().manual_seed(1)
        batches = [
            ((torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 64, (4, 8), generator=g)), {})
            for _ in range(2)
        ]
    elif model_name in ("llama", "llama_labels", "llama_tuple", "t5"):  # in nested forwards
        from tests.e2e.test_pp_nested import _llama, _t5

        cls, args = _t5() if model_name == "t5" else _llama()
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(2):
            ids = torch.randint(0, 64, (4, 8), generator=g)
            labels = ids[:, :4].contiguous() if model_name == "t5" else ids
            if model_name == "llama_labels":  # its own tensor: the last stage takes it
                labels = ids.clone()
            kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
            if model_name == "llama_tuple":  # the root's @can_return_tuple, around the call
                kwargs["return_dict"] = False
            batches.append(((), kwargs))
    else:
        from examples.gpt.model import GPT, GPTConfig

        cls, args = GPT, (GPTConfig(n_layer=4, n_embd=32, vocab_size=64, block_size=16),)
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(2):
            x = torch.randint(0, 64, (4, 16), generator=g)
            batches.append(((x,), {"targets": x}))
    runs = {}
    for runner in ("source", "replay"):
        model = annot.parallelize(
            cls, *args, mesh=annot.Mesh(pp=pp), seed=0, split=split, chunks=chunks, runner=runner
        )
        assert model.report.runner == runner
        assert model.report.boundaries == tuple(split)

        schedule = "interleaved" if chunks > 1 else "1f1b"

        @annot.jit(model, microbatches=4, schedule=schedule)
        def step(*a, model=model, **k):
            out = model(*a, **k)
            if model_name == "llama_tuple":
                assert type(out) is tuple, type(out)  # (loss, logits)
                loss = out[0]
            elif model_name == "two_tower":
                from tests.nested_models import clip_loss

                loss = clip_loss(out)
            else:
                loss = out.loss if hasattr(out, "loss") else out[1]
            model.backward(loss)
            return loss

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for a, k in batches:
            losses.append(step(*a, **k).reduce_mean())
            grads.append(model.full_grads())
            opt.step()
            opt.zero_grad()
        runs[runner] = (losses, grads, model.full_state_dict())
    (src_l, src_g, src_s), (rep_l, rep_g, rep_s) = runs["source"], runs["replay"]
    torch.manual_seed(0)
    names = [n for n, _ in cls(*args).named_parameters()]
    for i in range(len(batches)):
        assert torch.equal(src_l[i], rep_l[i]), f"step {i}: loss {src_l[i]} != {rep_l[i]}"
        for n in names:
            assert n in src_g[i], f"step {i}: no gradient for {n} from the source split"
            assert n in rep_g[i], f"step {i}: no gradient for {n} from the replay"
            assert torch.equal(src_g[i][n], rep_g[i][n]), (
                f"step {i}: grad {n} differs by "
                f"{(src_g[i][n] - rep_g[i][n]).abs().max().item():.3g}"
            )
    for k, v in src_s.items():
        assert torch.equal(v, rep_s[k]), f"after the steps: {k} differs"


def test_source_and_replay_give_identical_losses_and_gradients(tmp_path):
    """Branchy: a tied embedding and head across the first and last stage, a
    module called twice, a branch on the data inside the cut loop, kwargs."""
    run_ranks(_both_runners, 2, "branchy", ["blocks.2"], 1, str(tmp_path))


def test_nested_source_split_and_replay_identical_on_hf_llama(tmp_path):
    """HF Llama cut inside LlamaModel.forward: runner="source" runs the nested
    split (the root's stage methods call the base model's), the replay cuts the
    same boundary at run time; its tied embedding and head span both stages."""
    run_ranks(_both_runners, 2, "llama", ["model.layers.1"], 1, str(tmp_path))


def test_return_dict_false_identical_on_hf_llama(tmp_path):
    """``model(..., return_dict=False)``: the root's @can_return_tuple takes it
    out of the call; the source runner gives it around the whole pipeline (the
    last stage's output as a tuple), the replay runs the decorator itself."""
    run_ranks(_both_runners, 2, "llama_tuple", ["model.layers.1"], 1, str(tmp_path))


def test_labels_taken_from_the_call_identical_on_hf_llama(tmp_path):
    """HF Llama's labels as a tensor of their own: the source split's last
    stage takes them from its call (the replay sends them), bitwise equal."""
    run_ranks(_both_runners, 2, "llama_labels", ["model.layers.1"], 1, str(tmp_path))


@pytest.mark.parametrize("split", [["visual.blocks.1"], ["text.blocks.1"]])
def test_nested_source_split_and_replay_identical_between_two_towers(tmp_path, split):
    """open_clip's shape: the root reads a class token, positional embeddings,
    projections and a temperature between and after its towers' calls; cut
    inside the image tower (through the helper encode_image and the tower's
    nn.Sequential) and inside the text tower. Each raw parameter is held by
    the stage that reads it (the source split reads that from the source, the
    replay from one meta forward)."""
    run_ranks(_both_runners, 2, "two_tower", split, 1, str(tmp_path))


@pytest.mark.slow
def test_nested_source_split_and_replay_identical_on_interleaved_hf_llama(tmp_path):
    """Four virtual stages on two ranks, every boundary in LlamaModel.forward."""
    split = ["model.layers.1", "model.layers.2", "model.layers.3"]
    run_ranks(_both_runners, 2, "llama", split, 2, str(tmp_path))


@pytest.mark.slow
def test_nested_source_split_and_replay_identical_on_t5(tmp_path):
    """T5 cut in its decoder: the encoder and the decoder's embedding on stage 0
    (``shared`` is the same weight, held under every name), the rest on stage 1."""
    run_ranks(_both_runners, 2, "t5", ["decoder.block.1"], 1, str(tmp_path))


@pytest.mark.slow
def test_source_and_replay_identical_on_gpt_pp4_and_interleaved(tmp_path):
    run_ranks(_both_runners, 4, "gpt", ["h.1", "h.2", "h.3"], 1, str(tmp_path))
    run_ranks(_both_runners, 2, "gpt", ["h.1", "h.2", "h.3"], 2, str(tmp_path))


def _choice(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.pipeline_models import Branchy

    model = annot.parallelize(Branchy, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.2"])
    assert model.report.runner == "source", model.report.runner_reason
    assert "cuts the root's forward" in model.report.runner_reason
    replayed = annot.parallelize(
        Branchy, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.2"], runner="replay"
    )
    x = torch.randint(0, 16, (4, 6))
    texts = []
    for m in (model, replayed):

        @annot.jit(m, microbatches=2)
        def step(idx, targets, m=m):
            _, loss = m(idx, targets=targets)
            m.backward(loss)
            return loss

        step(x, x)
        texts.append(step.explain(x, x))
    assert "runner: source split (" in texts[0]
    assert "runner chosen at build: the rewriter cuts the root's forward" in texts[0]
    assert "runner: replay (" in texts[1]
    assert "runner chosen at build: asked for (runner='replay')" in texts[1]
    return texts


def test_explain_shows_the_runner_and_why(tmp_path):
    run_ranks(_choice, 2, str(tmp_path))


def _refusals(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from annot.core.errors import HintError
    from tests.nested_models import TimmStyleViT, XStyleSubclass
    from tests.pipeline_models import Marked

    with pytest.raises(HintError, match="runner='replay', but Marked.forward places its stages"):
        annot.parallelize(Marked, mesh=annot.Mesh(pp=2), seed=0, runner="replay")
    with pytest.raises(HintError, match="runner='source', but the stage split cannot cut"):
        annot.parallelize(
            XStyleSubclass, mesh=annot.Mesh(pp=2), seed=0, split=["layers.1.0"], runner="source"
        )
    with pytest.raises(HintError, match="runner='fast'; expected one of auto, source, replay"):
        annot.parallelize(Marked, mesh=annot.Mesh(pp=2), seed=0, runner="fast")
    model = annot.parallelize(TimmStyleViT, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.2"])
    assert model.report.runner == "source"  # the nested split cuts through its helper
    model = annot.parallelize(TimmStyleViT, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.1.mlp"])
    assert model.report.runner == "replay"  # inside a block
    assert model.report.runner_reason.startswith("the source split cannot cut there: ")
    model = annot.parallelize(XStyleSubclass, mesh=annot.Mesh(pp=2), seed=0, split=["layers.1.0"])
    assert model.report.runner == "replay"
    assert model.report.runner_reason.startswith("the source split cannot cut there: ")


@pytest.mark.slow  # the refusal's reason: tests/plan/test_stage_points.py, fast
def test_a_runner_that_cannot_run_the_plan_is_refused(tmp_path):
    run_ranks(_refusals, 2, str(tmp_path))


def _capture_refused(cache: str, asked: dict):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from annot.core.errors import PipelineError, RankFailure
    from tests.e2e.test_pp_nested import _llama

    cls, args = _llama()
    model = annot.parallelize(cls, *args, mesh=annot.Mesh(pp=2), seed=0, split=["model.layers.1"])
    assert model.report.runner == "source"  # what runner= left out chooses here

    @annot.jit(model, microbatches=2)
    def step(ids):
        out = model(input_ids=ids, labels=ids, use_cache=False, **asked)
        loss = out[0] if isinstance(out, tuple) else out.loss
        model.backward(loss)
        return loss

    with pytest.raises((PipelineError, RankFailure)) as err:
        step(torch.randint(0, 64, (4, 8)))
    return str(err.value)


@pytest.mark.parametrize(
    "asked, named",
    [
        ({"output_hidden_states": True}, "output_hidden_states=True (for @capture_outputs on "),
        pytest.param(
            {"output_attentions": True},
            "output_attentions=True (for @capture_outputs on ",
            marks=pytest.mark.slow,  # the same refusal as output_hidden_states
        ),
    ],
)
def test_nested_source_split_refuses_what_wraps_the_whole_call(tmp_path, asked, named):
    """HF's @capture_outputs on LlamaModel.forward runs on its first stage only
    under the nested split: asking it for what only the whole call gives is
    refused on every rank (the replay runs the model's own forward,
    tests/e2e/test_pp_nested.py; a config that asks makes the build choose it,
    tests/plan/test_stage_points.py)."""
    texts = run_ranks(_capture_refused, 2, str(tmp_path), asked)
    assert named in texts[0]
    assert "on a pipeline run by the source split" in texts[0]
    assert "runner='replay'" in texts[0]
    assert "rank 0" in texts[1]


def _two_classes_one_file(cache: str) -> list:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.nested_models import ScaledHeadLM, TimmStyleViT

    out = []
    inputs = {
        TimmStyleViT: torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)),
        ScaledHeadLM: torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)),
    }
    for cls, x in inputs.items():
        model = annot.parallelize(cls, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.2"])

        @annot.jit(model, microbatches=2)
        def step(x, model=model):
            loss = model(x).float().square().mean()
            model.backward(loss)
            return loss

        out.append((model.report.runner, float(step(x).reduce_mean()) > 0))
    return out


def test_two_classes_of_one_file_split_at_the_same_paths(tmp_path):
    """Two models defined in one file, each split by the source runner at
    ``blocks.2``, built one after the other with one rewrite cache: each gets
    its own rewritten file (the split's class is part of the cache key; it was
    not, and the second model found the first's stage methods only)."""
    for res in run_ranks(_two_classes_one_file, 2, str(tmp_path)):
        assert res == [("source", True), ("source", True)], res
