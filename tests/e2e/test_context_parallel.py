"""Context parallelism on transformers models as shipped, zero hints: each rank
of a cp group gets the same batch and keeps its half of every sequence
(zig-zag, load-balanced for the causal mask); the loss (the batch's, on every
rank), every gradient and every parameter after AdamW steps equal the
single-device model on the whole sequence. Llama and Qwen3 at cp=2, Llama at
cp=2 x tp=2, and two batches a step at dp=4 x cp=2 in an ``@annot.jit`` step of
two microbatches; what cp cannot split refused on every rank, naming the fix."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from annot.testing import run_ranks
from tests.hf.test_models_gpt2 import LLAMA_KW

SMALL = {**LLAMA_KW, "max_position_embeddings": 64}  # the small decoder, longer sequences


def _model(name: str):
    import transformers

    if name == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**SMALL, head_dim=8)
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL)


def _parity(
    cache: str, name: str, dp: int, tp: int, microbatches: int, compile: bool = False
) -> str:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist

    import annot
    from tests.parity import assert_close, compare_grads, compare_state, step_both

    cls, cfg = _model(name)
    mesh = annot.Mesh(dp=dp, cp=2, tp=tp)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, compile=compile)
    torch.manual_seed(0)
    ref = cls(cfg)

    @annot.jit(model, microbatches=microbatches)
    def step(ids, labels):
        out = model(ids, labels=labels)
        model.backward(out.loss)
        return out.loss

    batches = model.ctx.mesh.batches
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    what = f"{name} {model.ctx.mesh!r}"
    for s in range(2):
        ids = torch.randint(0, 64, (2 * batches * microbatches, 16), generator=g)
        labels = ids.clone()
        labels[0, 5:9] = -100  # ignored targets, on one rank's tokens more than the other's
        mine = model.ctx.batch_rank
        loss = step(ids.chunk(batches)[mine], labels.chunk(batches)[mine]).reduce_mean()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=model.ctx.dp_group)
        expected = 0.0
        parts = list(zip(ids.chunk(batches * microbatches), labels.chunk(batches * microbatches)))
        for part, lab in parts:
            r = ref(part, labels=lab).loss / len(parts)
            r.backward()
            expected += r.detach()
        assert_close(loss / model.ctx.mesh.dp, expected, f"{what} step {s}: loss")
        compare_grads(model, ref, f"{what} step {s}")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what} after 2 AdamW steps")
    return step.explain(ids, labels).splitlines()[1]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cp2_equals_one_device(tmp_path, name):
    plans = run_ranks(_parity, 2, str(tmp_path), name, 2, 1, 1, timeout=300)
    for r, line in enumerate(plans):
        assert f"this rank holds chunks {r} and {3 - r} of 4 of each sequence" in line


@pytest.mark.slow  # compiling takes a while
def test_cp2_compiled(tmp_path):
    run_ranks(_parity, 2, str(tmp_path), "llama", 2, 1, 1, True, timeout=400)


@pytest.mark.slow  # 4 ranks
def test_cp2_tp2(tmp_path):
    run_ranks(_parity, 4, str(tmp_path), "llama", 2, 2, 1, timeout=400)


@pytest.mark.slow  # 4 ranks
def test_dp2_cp2_two_batches_two_microbatches(tmp_path):
    run_ranks(_parity, 4, str(tmp_path), "llama", 4, 1, 2, timeout=400)


def _own_loss_llama():
    """A Llama whose forward computes its own loss, shifting the labels itself."""
    import transformers

    class OwnLoss(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if labels is not None:
                logits = out.logits[:, :-1].flatten(0, 1)
                out.loss = __import__("torch").nn.functional.cross_entropy(
                    logits, labels[:, 1:].flatten()
                )
            return out

    return OwnLoss


def _refused(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers
    from torch import nn

    import annot

    mesh = annot.Mesh(dp=2, cp=2)
    found = {}
    cls, cfg = _model("llama")
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0)
    torch.manual_seed(0)
    ref = cls(cfg)
    whole = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # return_dict=False: the loss is the tuple's first value
        got = model(input_ids=whole, labels=whole, return_dict=False)[0]
        found["tuple loss"] = float((got - ref(whole, labels=whole).loss).abs())
    ids = torch.randint(0, 64, (2, 14))
    for key, call in {
        "length": lambda: model(ids, labels=ids),
        "padding": lambda: model(ids[:, :12], attention_mask=torch.ones(2, 12).tril()),
        "own loss": lambda: annot.parallelize(_own_loss_llama()(cfg), mesh=mesh)(
            whole, labels=whole
        ),
    }.items():
        try:
            call()
        except annot.HintError as err:
            found[key] = str(err)
    for key, build in {
        "not transformers": lambda: annot.parallelize(nn.Linear, 4, 4, mesh=mesh, seed=0),
        "window": lambda: annot.parallelize(
            transformers.MistralForCausalLM,
            transformers.MistralConfig(**SMALL, sliding_window=4),
            mesh=mesh,
            seed=0,
        ),
    }.items():
        try:
            build()
        except annot.HintError as err:
            found[key] = str(err)
    return found


def test_cp_refusals_on_every_rank(tmp_path):
    for found in run_ranks(_refused, 2, str(tmp_path), timeout=300):
        assert found["tuple loss"] < 1e-5
        assert "a sequence of 14 tokens cannot be split over cp=2 ranks" in found["length"]
        assert "pad it to a multiple of 4" in found["length"]
        assert "an attention_mask with padding" in found["padding"]
        assert "OwnLoss.forward computes its loss itself" in found["own loss"]
        assert "Linear is not one" in found["not transformers"]
        assert "sliding-window attention (sliding_window=4)" in found["window"]


def test_cp_mesh_refusals():
    import annot

    with pytest.raises(annot.MeshError, match=r"cp must divide dp.*Mesh\(dp=2, cp=2"):
        annot.Mesh(cp=2)
    with pytest.raises(annot.MeshError, match="expert and context parallelism together"):
        annot.Mesh(dp=2, ep=2, cp=2)
    cls, cfg = _model("llama")
    with pytest.raises(annot.MeshError, match="context parallelism with pipeline stages"):
        annot.parallelize(cls, cfg, mesh=annot.Mesh(dp=2, cp=2, pp=2))
    assert annot.Mesh(dp=4, cp=2).batches == 2


FAMILIES = {  # transformers families as shipped, SDPA attention without windows
    "Qwen2": {},
    "Mistral": {"sliding_window": None},
    "Gemma": {"head_dim": 8},  # the scaled embedding
    "Phi3": {"pad_token_id": 0},  # fused qkv and gate|up
    "Olmo2": {},  # q/k norms over the whole width
    "Granite": {},  # multipliers on the embedding, residuals and logits
}


def _family(cache: str, name: str) -> None:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot
    from tests.parity import assert_close, compare_grads

    cls = getattr(transformers, f"{name}ForCausalLM")
    cfg = getattr(transformers, f"{name}Config")(**SMALL, **FAMILIES[name])
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(dp=2, cp=2), seed=0)
    torch.manual_seed(0)
    ref = cls(cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(ids, labels=ids)
    model.backward(out.loss)
    r = ref(ids, labels=ids).loss
    r.backward()
    assert_close(out.loss, r, f"{name} cp=2: loss")
    compare_grads(model, ref, f"{name} cp=2")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_families_at_cp2(tmp_path, name):
    run_ranks(_family, 2, str(tmp_path), name, timeout=300)
