"""Expert parallelism on transformers' Qwen3-MoE as shipped, zero hints (its
``base_model_ep_plan`` names the experts): each rank of an expert group holds
half the experts, tokens travel by all-to-all, and the loss (with the router's
load-balancing term), every gradient, the clipped norm and every parameter
after AdamW steps equal the single-device model on the whole batch. Composed
with tp (each expert split inside, as the tp plan says) and with a pipeline;
with FSDP2 over dp; written with ``save_pretrained`` in the single-device
layout and read back by ``from_pretrained``, each rank reading its own experts;
saved and resumed by DCP."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from annot.testing import run_ranks

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=16,
    output_router_logits=True,  # the load-balancing loss in the loss
    router_aux_loss_coef=0.1,
)


def _qwen3_moe():
    import transformers

    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**SMALL)


def _train(model, ref, steps: int = 2, microbatches: int = 2) -> None:
    """``steps`` AdamW steps: this replica's part of each batch in an
    ``@annot.jit`` step of ``microbatches``; the reference on every
    (replica, microbatch) part, accumulated, as the router's loss is per part."""
    import torch
    import torch.distributed as dist

    import annot
    from tests.parity import assert_close, compare_grads, compare_state, step_both

    @annot.jit(model, microbatches=microbatches)
    def step(ids):
        out = model(ids, labels=ids, use_cache=False)
        model.backward(out.loss)
        return out.loss

    dp = model.ctx.mesh.dp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # as the other transformers parity tests
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    what = repr(model.ctx.mesh)
    for s in range(steps):
        ids = torch.randint(0, SMALL["vocab_size"], (2 * dp * microbatches, 8), generator=g)
        loss = step(ids.chunk(dp)[model.ctx.dp_rank]).reduce_mean().detach().clone()
        dist.all_reduce(loss, group=model.ctx.dp_group)
        expected = 0.0
        for part in ids.chunk(dp * microbatches):
            r = ref(part, labels=part, use_cache=False).loss / (dp * microbatches)
            r.backward()
            expected += r.detach()
        assert_close(loss / dp, expected, f"{what} step {s}: loss")
        compare_grads(model, ref, f"{what} step {s}")
        norm = model.clip_grad_norm_(0.05)
        assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), "norm")
        step_both(opt, ref_opt)
    compare_state(model, ref, f"{what} after {steps} AdamW steps")


def _parity(
    cache: str, tp: int, pp: int, dp: int = 2, fsdp: bool = False, compile: bool = False
) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    cls, cfg = _qwen3_moe()
    mesh = annot.Mesh(dp=dp, ep=2, tp=tp, pp=pp)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, fsdp=fsdp, compile=compile)
    torch.manual_seed(0)
    ref = cls(cfg)
    _train(model, ref)
    experts = {n: tuple(p.shape) for n, p in model.named_parameters() if "experts" in n}
    return {"experts": model.report.experts, "shapes": experts, "ref": ref.state_dict()}


def _round_trip(cache: str) -> None:
    """ep=2: Qwen3-MoE read from a single-device safetensors file (each rank
    its own experts); a hand-written MoE written whole by ``save_pretrained``
    and read back, and saved with its optimizer by DCP (each rank its experts'
    boxes of the whole), read whole and into another build."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import safetensors.torch
    import torch
    import torch.distributed as dist

    import annot
    from tests.parity import assert_close, compare_state
    from tests.runtime.ep.test_dispatch import Net

    mesh = annot.Mesh(dp=2, ep=2)
    cls, cfg = _qwen3_moe()
    torch.manual_seed(1)
    ref = cls(cfg)
    file = os.path.join(cache, "qwen3_moe.safetensors")
    if dist.get_rank() == 0:
        safetensors.torch.save_file(ref.state_dict(), file)
    dist.barrier()
    loaded = annot.from_pretrained(cls, file, cfg, mesh=mesh)
    compare_state(loaded, ref, "from_pretrained at ep=2")
    assert loaded.module.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2

    hints = {"moe.experts": annot.Experts()}
    model = annot.parallelize(Net, mesh=mesh, seed=0, hints=hints)
    torch.manual_seed(0)
    net = Net()
    path = annot.save_pretrained(model, os.path.join(cache, "saved"))
    stored = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    for k, v in net.state_dict().items():
        assert_close(stored[k], v, f"save_pretrained at ep=2: {k}")
    again = annot.from_pretrained(Net, path, mesh=mesh, hints=hints)
    compare_state(again, net, "save_pretrained, from_pretrained at ep=2")
    # DCP: each rank writes its experts at their place in the whole; read whole, and back
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ck = annot.save(model, opt, os.path.join(cache, "dcp"))
    saved, _ = annot.load_full(ck)
    for k, v in model.full_state_dict().items():
        assert_close(saved[k], v, f"DCP at ep=2: {k}")
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    annot.load(again, opt2, ck)
    for m, o in ((model, opt), (again, opt2)):  # the same state: the same next step
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    a, b = model.full_state_dict(), again.full_state_dict()
    for k in a:
        assert_close(b[k], a[k], f"DCP at ep=2, a step after load: {k}")


def test_qwen3_moe_at_ep2_each_rank_holds_half_the_experts(tmp_path):
    out = run_ranks(_parity, 2, str(tmp_path), 1, 1, timeout=300)
    for r in out:
        assert r["experts"] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        assert r["shapes"]["module.model.layers.0.mlp.experts.gate_up_proj"] == (2, 32, 32)
        assert r["shapes"]["module.model.layers.0.mlp.experts.down_proj"] == (2, 32, 16)


def test_ep2_checkpoints_pretrained_and_dcp(tmp_path):
    run_ranks(_round_trip, 2, str(tmp_path), timeout=300)


def test_qwen3_moe_at_ep2_with_fsdp2(tmp_path):
    # FSDP2 shards the rest over dp; the experts stay split over ep
    run_ranks(_parity, 2, str(tmp_path), 1, 1, 2, True, timeout=300)


@pytest.mark.slow  # compiling takes a while; the dispatch runs eagerly inside the graph
def test_qwen3_moe_at_ep2_compiled(tmp_path):
    run_ranks(_parity, 2, str(tmp_path), 1, 1, 2, False, True, timeout=400)


@pytest.mark.slow  # 4 ranks: two expert groups, each expert on two ranks
def test_qwen3_moe_dp4_ep2_with_fsdp2(tmp_path):
    out = run_ranks(_parity, 4, str(tmp_path), 1, 1, 4, True, timeout=400)
    assert out[0]["shapes"] == out[2]["shapes"]  # ranks 0 and 2 hold the same experts


@pytest.mark.slow  # 4 ranks
def test_qwen3_moe_at_ep2_tp2(tmp_path):
    out = run_ranks(_parity, 4, str(tmp_path), 2, 1, timeout=400)
    # each rank: half the experts, each expert's gate|up split over tp (Col(chunks=2))
    assert out[0]["shapes"]["module.model.layers.0.mlp.experts.gate_up_proj"] == (2, 16, 32)


@pytest.mark.slow  # 4 ranks
def test_qwen3_moe_at_ep2_pp2(tmp_path):
    out = run_ranks(_parity, 4, str(tmp_path), 1, 2, timeout=400)
    # ranks 0 and 2: stage 0 (layer 0), half its experts each; ranks 1 and 3: stage 1 (layer 1)
    for rank, layer in ((0, 0), (1, 1), (2, 0), (3, 1)):
        assert out[rank]["shapes"] == {
            f"module.model.layers.{layer}.mlp.experts.gate_up_proj": (2, 32, 32),
            f"module.model.layers.{layer}.mlp.experts.down_proj": (2, 32, 16),
        }


def _refusals(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import transformers
    from torch import nn

    import annot

    found = {}
    mesh = annot.Mesh(dp=2, ep=2)
    try:  # nothing hinted Experts(), no ep plan
        annot.parallelize(nn.Sequential, nn.Linear(4, 4), mesh=mesh, seed=0)
    except annot.HintError as err:
        found["unhinted"] = str(err)
    cfg = transformers.Qwen3MoeConfig(**{**SMALL, "num_experts": 3})
    try:  # 3 experts over 2 ranks
        annot.parallelize(transformers.Qwen3MoeForCausalLM, cfg, mesh=mesh, seed=0)
    except annot.HintError as err:
        found["indivisible"] = str(err)
    return found


def test_ep_refusals_before_any_rank_works(tmp_path):
    for found in run_ranks(_refusals, 2, str(tmp_path), timeout=300):
        assert "nothing in Sequential is hinted Experts()" in found["unhinted"]
        assert (
            "Experts() splits 3 experts over ep=2, which does not divide them"
            in (found["indivisible"])
        )
        assert "model.layers.0.mlp.experts" in found["indivisible"]


def test_ep_mesh_and_option_refusals():
    import annot

    with pytest.raises(annot.MeshError, match=r"ep must divide dp.*Mesh\(dp=2, ep=2"):
        annot.Mesh(ep=2)
    assert repr(annot.Mesh(dp=4, ep=2)) == "Mesh(dp=4, pp=1, tp=1, ep=2)"


FAMILY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
FAMILIES = {
    "Mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2Moe": {  # a shared expert beside the routed ones
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "DeepseekV3": {  # multi-head latent attention, a shared expert, grouped routing
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 0,
        "kv_lora_rank": 8,
        "q_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "n_group": 1,
        "topk_group": 1,
    },
    "GptOss": {  # experts with biases, attention sinks, sliding windows
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "Olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "GraniteMoe": {"num_local_experts": 4, "num_experts_per_tok": 2},  # block_sparse_moe
}


def _family(cache: str, name: str) -> list:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot

    cls = getattr(transformers, f"{name}ForCausalLM")
    cfg = getattr(transformers, f"{name}Config")(**FAMILY, **FAMILIES[name])
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(dp=2, ep=2), seed=0)
    torch.manual_seed(0)
    ref = cls(cfg)
    _train(model, ref, steps=1, microbatches=1)
    return model.report.experts


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n == "DeepseekV3" else pytest.mark.slow) for n in FAMILIES],
)
def test_transformers_moe_families_at_ep2_with_zero_hints(tmp_path, name):
    experts = run_ranks(_family, 2, str(tmp_path), name, timeout=300)[0]
    assert len(experts) == 2
    assert all(e.endswith(".experts") for e in experts)
