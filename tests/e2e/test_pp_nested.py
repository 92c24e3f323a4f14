"""Pipelines of models as they are written: boundaries at any depth (annot.runtime.runners.replay).

Each case builds a model annot has no hint for (Hugging Face models from small
configs, and models in timm's, torchvision's and plain ``nn.Sequential``
style), cuts it at boundaries inside nested forwards, helper methods and
containers called whole, and trains it on real gloo ranks with the loss
computed in the step body. Loss, every gradient and every parameter after
AdamW steps equal the single-device run on the same microbatches.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from annot.testing import run_ranks
from tests.requires import fsdp_unused_params

MICRO = 2


# ---- builders: (class, args, batch maker, model call + loss) --------------------------
# Each returns everything a rank needs; module-level so spawned ranks can import them.


def _llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM, (cfg,)


def _qwen2_moe(experts: str = "grouped_mm"):
    """A mixture of experts: tokens routed by value (``grouped_mm`` over
    offsets from a histogram, or ``eager``: ``nonzero`` per expert), whose
    kernels have no meta version in float32 or output shapes that depend on
    the data; a later stage replays them from their owner's log."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        experts_implementation=experts,
    )
    return Qwen2MoeForCausalLM, (cfg,)


def _qwen2_moe_eager():
    return _qwen2_moe("eager")


def _qwen2_moe_aux():
    """Qwen2-MoE trained with its load-balancing loss: every layer's router
    logits, captured by transformers' output hooks, reach the last stage."""
    cls, (cfg,) = _qwen2_moe()
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5
    return cls, (cfg,)


def _hidden_states_loss(model, b):
    """A loss on every layer's hidden state (``output_hidden_states=True``)."""
    out = model(input_ids=b["ids"], labels=b["ids"], output_hidden_states=True)
    assert len(out.hidden_states) == 5
    return out.loss + 0.1 * sum(h.pow(2).mean() for h in out.hidden_states)


def _deberta():
    """DeBERTa-v2: its encoder reads ``self.rel_embeddings.weight`` directly
    (the embedding module is never called), after registering the layers."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    cfg = DebertaV2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        pad_token_id=0,
    )
    return DebertaV2ForMaskedLM, (cfg,)


def _tokens(g, step):
    import torch

    seq = (8, 5, 6)[step % 3]  # a different length each step
    return {"ids": torch.randint(0, 64, (4, seq), generator=g)}


def _even_tokens(g, step):
    """Lengths that change per step and divide by tp=2 (sequence parallelism)."""
    import torch

    return {"ids": torch.randint(0, 64, (4, (8, 4, 6)[step % 3]), generator=g)}


def _ce_on_logits(model, b):
    """Style 1: the loss outside the model, on its logits."""
    import torch.nn.functional as F

    logits = model(b["ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), b["ids"].flatten())


def _hf_labels(model, b):
    """Style 2: ``model(**batch).loss``, the model's own loss from ``labels=``."""
    return model(input_ids=b["ids"], labels=b["ids"]).loss


def _llama_checkpointed():
    """Llama with every decoder layer checkpointed (``annot.recompute`` applied
    to the installed class, as a user who cannot edit it would)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import annot

    annot.recompute(LlamaDecoderLayer)
    return _llama()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel, (cfg,)


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM, (cfg,)


def _bert_mlm(model, b):
    import torch

    mask = torch.ones_like(b["ids"])
    mask[0, -2:] = 0  # padding in the first row
    return model(input_ids=b["ids"], attention_mask=mask, labels=b["ids"]).loss


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration, (cfg,)


def _t5_loss(model, b):
    return model(input_ids=b["ids"], labels=b["ids"][:, :4].contiguous()).loss


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTForImageClassification, (cfg,)


def _images(g, step):
    import torch

    return {"x": torch.randn(4, 3, 8, 8, generator=g), "y": torch.randint(0, 5, (4,), generator=g)}


def _convnext():
    """HF ConvNext: its __init__ reads .tolist() of a tensor, so deferred init
    cannot replay it and each rank builds it whole (with a warning)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16, 24, 32], depths=[1, 2, 1, 1], num_labels=5
    )
    return ConvNextForImageClassification, (cfg,)


def _images32(g, step):
    import torch

    return {
        "x": torch.randn(4, 3, 32, 32, generator=g),
        "y": torch.randint(0, 5, (4,), generator=g),
    }


def _dataclass_logits(model, b):
    """Style 3: a field of the model's dataclass output, loss outside."""
    import torch.nn.functional as F

    out = model(pixel_values=b["x"])
    return F.cross_entropy(out.logits, b["y"])


def _plain_ce(model, b):
    import torch.nn.functional as F

    return F.cross_entropy(model(b["x"]), b["y"])


def _timm():
    from tests.nested_models import TimmStyleViT

    return TimmStyleViT, ()


def _resnet():
    from tests.nested_models import TorchvisionStyleResNet

    return TorchvisionStyleResNet, ()


def _sequential():
    from tests.nested_models import SequentialMLP

    return SequentialMLP, ()


def _vectors(g, step):
    import torch

    return {"x": torch.randn(4, 8, generator=g), "y": torch.randint(0, 8, (4,), generator=g)}


def _xstyle():
    from tests.nested_models import XStyleWrapper

    return XStyleWrapper, ()


def _xsubclass():
    from tests.nested_models import XStyleSubclass

    return XStyleSubclass, ()


def _ce_on_output(model, b):
    import torch.nn.functional as F

    return F.cross_entropy(model(b["ids"]).flatten(0, 1), b["ids"].flatten())


def _branchy():
    from tests.nested_models import BranchyEncoder

    return BranchyEncoder, ()


def _branchy_loss(model, b):
    import torch.nn.functional as F

    return F.cross_entropy(model(b["x"], twice=True), b["y"] % 3)


def _two_tower():
    from tests.nested_models import TwoTower

    return TwoTower, ()


def _image_text(g, step):
    import torch

    seq = (8, 5, 6)[step % 3]
    return {
        "x": torch.randn(4, 3, 8, 8, generator=g),
        "ids": torch.randint(0, 64, (4, seq), generator=g),
    }


def _clip_loss(model, b):
    from tests.nested_models import clip_loss

    return clip_loss(model(b["x"], b["ids"]))


def _late_projection():
    from tests.nested_models import LateProjection

    return LateProjection, ()


def _scaled_head():
    from tests.nested_models import ScaledHeadLM

    return ScaledHeadLM, ()


CASES = {
    "llama": (_llama, _tokens, _ce_on_logits),
    "llama-labels": (_llama, _tokens, _hf_labels),
    "gpt2": (_gpt2, _tokens, _hf_labels),
    "bert": (_bert, _tokens, _bert_mlm),
    "t5": (_t5, _tokens, _t5_loss),
    "vit": (_vit, _images, _dataclass_logits),
    "timm": (_timm, _images, _plain_ce),
    "resnet": (_resnet, _images, _plain_ce),
    "sequential": (_sequential, _vectors, _plain_ce),
    "llama_ckpt": (_llama_checkpointed, _tokens, _ce_on_logits),
    "llama_sp": (_llama, _even_tokens, _ce_on_logits),
    "branchy": (_branchy, _vectors, _branchy_loss),
    "xstyle": (_xstyle, _tokens, _ce_on_output),
    "convnext": (_convnext, _images32, _dataclass_logits),
    "qwen2moe": (_qwen2_moe, _tokens, _hf_labels),
    "qwen2moe_eager": (_qwen2_moe_eager, _tokens, _hf_labels),
    "qwen2moe_aux": (_qwen2_moe_aux, _tokens, _hf_labels),
    "llama_hs": (_llama, _tokens, _hidden_states_loss),
    "deberta": (_deberta, _tokens, _hf_labels),
    "xsubclass": (_xsubclass, _tokens, _ce_on_output),
    "two_tower": (_two_tower, _image_text, _clip_loss),
    "scaled_head": (_scaled_head, _tokens, _ce_on_output),
    "late_projection": (_late_projection, _tokens, _ce_on_output),
}


def _two_tower_sample():
    import torch

    return (torch.zeros(2, 3, 8, 8), torch.zeros(2, 8, dtype=torch.long))


def _tokens_sample():
    import torch

    return (torch.zeros(2, 8, dtype=torch.long),)


# one microbatch of forward's arguments, for sample=
def _images_sample():
    import torch

    return (torch.zeros(2, 3, 8, 8),)


SAMPLES = {
    "timm": _images_sample,
    "xstyle": _tokens_sample,
    "xsubclass": _tokens_sample,
    "two_tower": _two_tower_sample,
    "scaled_head": _tokens_sample,
    "late_projection": _tokens_sample,
}


def _parity(
    cache: str,
    case: str,
    splits: list,
    tp: int = 1,
    steps: int = 2,
    schedule="1f1b",
    pp=None,
    sp=False,
    dp=1,
    fsdp=False,
    sample=False,
    runner="auto",
):
    """On every rank: for each split in ``splits`` (None: annot chooses, over
    ``pp`` stages), parallelize, train ``steps`` AdamW steps beside the
    single-device reference (the same microbatches, accumulated; with ``dp``
    replicas each runs its part of the batch), compare loss, every gradient
    and every parameter. ``runner``: parallelize's (the source split runs
    where it can cut; "replay" for what the replay does)."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import assert_close, compare_grads, compare_state

    build, batch, loss_of = CASES[case]
    cls, args = build()
    out = []
    for split in splits:
        mesh = annot.Mesh(dp=dp, pp=pp or len(split) + 1, tp=tp)
        model = annot.parallelize(
            cls,
            *args,
            mesh=mesh,
            seed=0,
            split=list(split) if split is not None else None,
            sequence_parallel=sp,
            fsdp=fsdp,
            sample=SAMPLES[case]() if sample else None,
            runner=runner,
        )
        if fsdp:  # no shadow keeps a whole (stale) copy of a weight FSDP2 sharded
            from annot.runtime.runners.placeholder import shadow_modules

            real = [
                t for m in shadow_modules(model.module) for t in m.parameters() if not t.is_meta
            ]
            assert not real, [tuple(t.shape) for t in real]
        if sp:  # this rank's row layers reduce-scatter to sequence shards
            assert any(getattr(m, "sequence_dim", None) == 1 for m in model.modules())
        torch.manual_seed(0)
        ref = cls(*args)
        model.train()
        ref.train()
        if case == "llama_ckpt":  # this rank's decoder layers recompute in backward
            layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
            assert layers
            assert all(repr(m.forward).startswith("checkpointed(") for m in layers)

        @annot.jit(model, microbatches=MICRO, schedule=schedule)
        def step(b):
            loss = loss_of(model, b)  # noqa: B023 - one step per model
            model.backward(loss)  # noqa: B023
            return loss

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(4)
        for i in range(steps):
            b = batch(g, i)
            mine = {k: v.chunk(dp)[model.ctx.dp_rank] for k, v in b.items()}
            loss = step(mine).reduce_mean()
            if dp > 1:
                torch.distributed.all_reduce(loss, group=model.ctx.dp_group)
                loss /= dp
            ref_loss = 0.0
            n = next(iter(b.values())).shape[0] // (MICRO * dp)
            for part in range(MICRO * dp):
                mb = {k: v[part * n : (part + 1) * n] for k, v in b.items()}
                r = loss_of(ref, mb)
                (r / (MICRO * dp)).backward()
                ref_loss += r.detach() / (MICRO * dp)
            what = f"{case} split={split} step {i}"
            assert_close(loss, ref_loss, f"{what}: loss")
            compare_grads(model, ref, what)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        compare_state(model, ref, f"{case} split={split} after {steps} AdamW steps")
        out.append(([t.names for t in model.pipeline.ties], list(model.pipeline.boundaries)))
    return out


def _run(tmp_path, case, splits, world=2, **kw):
    return run_ranks(_parity, world, str(tmp_path), case, splits, timeout=400, **kw)


# ---- pp=2, boundaries inside nested forwards ------------------------------------------


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_hf_llama_mid_block_splits_and_tied_head(tmp_path):
    # inside a block (attention | MLP), inside a part (the MLP's last linear,
    # whose input is a temporary), between blocks, and at the head
    splits = [["model.layers.1.mlp"], ["model.layers.1.mlp.down_proj"], ["model.layers.2"]]
    res = _run(tmp_path, "llama", [*splits, ["lm_head"]])
    assert res[0][0][0] == [("model.embed_tokens.weight", "lm_head.weight")]


@pytest.mark.slow  # (fast-set budget)
def test_measured_plans_split_inside_block_parts(tmp_path):
    # annot.plan.module_units with measured costs goes inside a block part where the
    # parts cannot balance the stages: here at pp=3 over 4 layers, inside an
    # attention and an MLP (at pp=2 the blocks balance)
    import torch

    from annot.plan.module_units import ModuleUnits
    from annot.plan.planner import plan as plan_stages

    cls, args = _llama()
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plan = plan_stages(cls(*args), 3, units=ModuleUnits(), sample={"input_ids": ids}, cost="flops")
    deep = {u.path for u in plan.units if u.level == 2}
    assert deep & set(plan.boundaries), plan.table()
    _run(tmp_path, "llama", [plan.boundaries], world=3)


@pytest.mark.slow  # 10-17 s: keeps the README's test command under 10 minutes
def test_automatic_splits_are_balanced_nested_boundaries(tmp_path):
    # no split=: annot.plan.module_units balances blocks and block parts in call order
    res = _run(tmp_path, "llama", [None], pp=2)
    (boundary,) = res[0][0][1]
    assert boundary.startswith("model.layers."), boundary  # inside LlamaModel.forward
    (tmp_path / "timm").mkdir()  # (not a transformers model: sample= gives the call order)
    res = _run(tmp_path / "timm", "timm", [None], pp=2, sample=True)
    assert res[0][0][1][0].startswith("blocks."), res
    # without sample=: the source split runs the plan, reading from the source what
    # each stage calls; the call order is needed only where the replay would run it
    (tmp_path / "timm-source").mkdir()
    res = _run(tmp_path / "timm-source", "timm", [None], pp=2)
    assert res[0][0][1] == ["blocks.2"], res


@pytest.mark.parametrize(
    "case, split",
    [
        ("gpt2", ["transformer.h.2"]),
        # (fast-set budget: the other three run with the slow cases)
        pytest.param("bert", ["bert.encoder.layer.2.attention"], marks=pytest.mark.slow),
        # encoder on stage 0, decoder on 1; the shared embedding tied
        pytest.param("t5", ["decoder.block.0"], marks=pytest.mark.slow),
        pytest.param("vit", ["vit.layers.2"], marks=pytest.mark.slow),
    ],
)
def test_hf_gpt2_bert_t5_vit(tmp_path, case, split):
    _run(tmp_path, case, [split])


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
@pytest.mark.parametrize(
    "case, splits",
    [
        ("timm", [["blocks.2"], ["blocks.1.mlp"], ["head"]]),  # helper methods, Sequential
        # _forward_impl, BatchNorm statistics (fast-set budget: with the slow cases)
        pytest.param("resnet", [["layer2.1"], ["layer3"]], marks=pytest.mark.slow),
        ("sequential", [["net.8"]]),  # one nn.Sequential called once
    ],
)
def test_timm_torchvision_and_sequential_styles(tmp_path, case, splits):
    _run(tmp_path, case, splits)


@pytest.mark.slow  # fast-set budget
def test_layers_that_are_module_lists_split_automatically(tmp_path):
    # x-transformers' layout: the planner begins a stage at a layer's first
    # element (called), never at the layer's ModuleList (never called)
    res = _run(tmp_path, "xstyle", [None], pp=2, sample=True)
    (boundary,) = res[0][0][1]
    assert boundary.startswith("net.layers."), boundary
    assert boundary.count(".") == 3, boundary
    # a subclass that inherits forward (only its __init__ is its own): cut at run time
    _run(tmp_path, "xsubclass", [None, ["layers.2.0"]], pp=2, sample=True)
    # the layer itself: the nested source split cuts the loop over the layers there;
    # the replay begins the stage at the first call inside the layer (a ModuleList)
    (tmp_path / "layer").mkdir()
    res = _run(tmp_path / "layer", "xstyle", [["net.layers.2"]])
    assert res[0][0][1] == ["net.layers.2"], res
    (tmp_path / "layer-replay").mkdir()
    res = _run(tmp_path / "layer-replay", "xstyle", [["net.layers.2"]], runner="replay")
    assert res[0][0][1] == ["net.layers.2.0"], res


@pytest.mark.slow
def test_hf_t5_automatic_split_sees_the_layers_of_its_blocks(tmp_path):
    # T5Block keeps its layers in a ModuleList: they are the blocks' parts
    res = _run(tmp_path, "t5", [None], pp=2)
    (boundary,) = res[0][0][1]
    assert ".block." in boundary, boundary


@pytest.mark.slow
def test_hf_convnext_built_whole_when_deferred_init_cannot_replay_it(tmp_path):
    _run(tmp_path, "convnext", [["convnext.encoder.stages.1.layers.1"], None], pp=2)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_mixture_of_experts_replays_from_the_owners_log(tmp_path):
    # HF Qwen2-MoE: float32 grouped_mm has no meta kernel; a boundary inside a
    # block (after attention), the MoE on both sides (between blocks: below)
    _run(tmp_path, "qwen2moe", [["model.layers.1.mlp"]])


@pytest.mark.slow  # 10-17 s: keeps the README's test command under 10 minutes
def test_outputs_captured_by_hooks_cross_the_stages(tmp_path):
    # transformers' output capture (forward hooks append each layer's output):
    # the load-balancing loss over every layer's router logits, and a loss on
    # every hidden state; the gradients reach the routers of stage 0
    _run(tmp_path, "qwen2moe_aux", [["model.layers.1.mlp"]])
    (tmp_path / "hs").mkdir()
    # (between blocks the source split would run: asked in the call, the
    # capture is refused there, tests/test_runners.py)
    _run(tmp_path / "hs", "llama_hs", [["model.layers.2"]], runner="replay")


@pytest.mark.slow
def test_a_weight_read_directly_goes_with_the_stage_that_reads_it(tmp_path):
    # DeBERTa-v2's encoder reads rel_embeddings.weight in its own forward: the
    # probe of call order places it on stage 0, where it is read
    _run(tmp_path, "deberta", [["deberta.encoder.layer.2"], None], pp=2)


@pytest.mark.slow
def test_mixture_of_experts_eager_routing_automatic_split(tmp_path):
    # the eager experts loop: nonzero() per expert (shapes from the data); and
    # a last stage holding only the head, where the whole base model is one
    # placeholder returning a ModelOutput: its layers answer from the log
    _run(tmp_path, "qwen2moe_eager", [None, ["lm_head"]], pp=2)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_data_dependent_control_flow_before_the_boundary(tmp_path):
    # the branch and the .item() sit before and after the boundary; a module called twice
    _run(tmp_path, "branchy", [["encoder.layers.2"], ["encoder.layers.0"], ["head"]])


@pytest.mark.slow  # 10-17 s: keeps the README's test command under 10 minutes
def test_loss_in_the_step_body_three_styles(tmp_path):
    # F.cross_entropy(model(x).logits, y); model(..., labels=).loss; a dataclass field
    _run(tmp_path, "llama-labels", [["model.layers.2"]])
    (tmp_path / "vit").mkdir()
    _run(tmp_path / "vit", "vit", [["vit.layers.1.mlp"]])


@pytest.mark.slow  # 4 drawn splits, each on 2 ranks
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_drawn_split_points_across_depths(tmp_path_factory, data):
    # any module on the call path can begin a stage: blocks, parts of a block, leaves
    paths = [
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.1",
        "model.layers.1.post_attention_layernorm",
        "model.layers.2.self_attn.o_proj",
        "model.layers.3",
        "model.norm",
        "lm_head",
    ]
    split = data.draw(st.sampled_from(paths))
    _run(tmp_path_factory.mktemp("draw"), "llama", [[split]], steps=1)


# ---- pp=4, tp x pp --------------------------------------------------------------------


@pytest.mark.slow
def test_pp4_llama_and_resnet(tmp_path):
    _run(tmp_path, "llama", [["model.layers.0.mlp", "model.layers.2", "model.norm"]], world=4)
    (tmp_path / "r").mkdir()
    _run(tmp_path / "r", "resnet", [["layer1.1", "layer2", "layer3"]], world=4)


@pytest.mark.slow
def test_tp2_pp2_llama_mid_block(tmp_path):
    _run(tmp_path, "llama", [["model.layers.1.mlp"]], world=4, tp=2)


@pytest.mark.slow
def test_tp2_pp2_llama_sequence_parallel(tmp_path):
    # each stage's decoder layers on sequence shards, whole activations between stages
    _run(tmp_path, "llama_sp", [["model.layers.2"]], world=4, tp=2, sp=True, steps=3)


# ---- composition: interleaved virtual stages, DCP checkpoints ---------------------------


@pytest.mark.slow
def test_zero_bubble_on_nested_stages_tied_head_and_checkpointing(tmp_path):
    # ZB-H1's split backward on replayed stages: the tied embedding / LM head
    # across stages, a boundary inside a block, recomputing (checkpointed) blocks
    _run(tmp_path, "llama", [["model.layers.1.mlp"]], schedule="zbh1")
    (tmp_path / "c").mkdir()
    _run(tmp_path / "c", "llama_ckpt", [["model.layers.2"]], schedule="zbh1")
    (tmp_path / "tp").mkdir()
    _run(tmp_path / "tp", "llama", [["model.layers.2"]], world=4, tp=2, schedule="zbh1")


@pytest.mark.slow
@fsdp_unused_params
def test_fsdp_on_nested_stages_mid_block_tied_head(tmp_path):
    # FSDP2 over dp=2 on replayed stages: a boundary inside a block, the tied
    # embedding / LM head across stages (reduce-scattered, then summed), 1f1b and zbh1
    _run(tmp_path, "llama", [["model.layers.1.mlp"]], world=4, dp=2, fsdp=True)
    (tmp_path / "zb").mkdir()
    _run(tmp_path / "zb", "llama", [["model.layers.2"]], world=4, dp=2, fsdp=True, schedule="zbh1")


@pytest.mark.slow
def test_checkpointed_blocks_with_boundaries_between_and_inside_them(tmp_path):
    # @recompute on the installed decoder-layer class; a boundary inside a
    # checkpointed block: stage 0's recomputation stops where its part ended
    _run(tmp_path, "llama_ckpt", [["model.layers.2"], ["model.layers.1.mlp"]])


def _compare_two_microbatches(model, ref, b, loss, loss_of, what: str) -> None:
    """``loss``, a jit step's over ``b`` in 2 microbatches, and ``model``'s
    gradients against ``ref`` run on the same microbatches, accumulated."""
    from tests.parity import assert_close, compare_grads

    ref_loss = 0.0
    for part in range(2):
        r = loss_of(ref, {"ids": b["ids"][2 * part : 2 * part + 2]})
        (r / 2).backward()
        ref_loss += r.detach() / 2
    assert_close(loss, ref_loss, f"{what}: loss")
    compare_grads(model, ref, what)


def _interleaved_and_checkpoint(cache: str, ckpt: str) -> int:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import assert_close

    cls, args = _llama()
    model = annot.parallelize(
        cls,
        *args,
        mesh=annot.Mesh(pp=2),
        seed=0,
        chunks=2,  # 4 virtual stages on 2 ranks, all cut inside LlamaModel.forward
        split=["model.layers.1", "model.layers.2.mlp", "model.norm"],
    )
    torch.manual_seed(0)
    ref = cls(*args)

    @annot.jit(model, microbatches=2, schedule="interleaved")
    def step(b):
        loss = _ce_on_logits(model, b)
        model.backward(loss)
        return loss

    b = _tokens(torch.Generator().manual_seed(4), 0)
    _compare_two_microbatches(model, ref, b, step(b).reduce_mean(), _ce_on_logits, "interleaved")
    annot.save(model, None, ckpt, step=1)  # each rank its stages, single-device layout
    state, _ = annot.load_full(ckpt)
    assert state.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert_close(state[k], v, f"checkpoint {k}")
    return len(state)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_interleaved_nested_stages_and_dcp_checkpoint(tmp_path):
    res = run_ranks(
        _interleaved_and_checkpoint, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout=300
    )
    assert res[0] == res[1] > 0


# ---- refusals -------------------------------------------------------------------------


def _refusal(cache: str) -> list[str]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from annot.core.errors import HintError
    from tests.nested_models import TimmStyleViT

    out = []
    cases = [
        (TimmStyleViT, (), "blocks.9", "auto"),
        (*_llama(), "model.layers.1.mlp.up_proj", "auto"),
    ]
    for cls, args, split, runner in cases:
        try:
            annot.parallelize(
                cls, *args, mesh=annot.Mesh(pp=2), seed=0, split=[split], runner=runner
            )
            out.append("no error")
        except HintError as e:
            out.append(str(e))
    return out


def test_boundary_naming_no_module_or_stranding_a_tensor_is_refused(tmp_path):
    msg, stranding = run_ranks(_refusal, 2, str(tmp_path), timeout=120)[0]
    # LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); the left operand is
    # a temporary on Python's stack while up_proj runs
    assert stranding.startswith(
        "pipeline boundary 'model.layers.1.mlp.up_proj': a stage cannot begin at that call: "
        "the result of silu made at activations.py:"
    ), stranding
    assert stranding.endswith(
        "and no local variable holds it when the call begins (a temporary of the expression "
        "that makes the call, or a tensor kept on a module), so the next stage could not "
        "receive it. To fix: begin the stage at 'model.layers.1.mlp', which encloses it, or "
        "begin it at another module call, or assign that value to a local variable before the "
        "call"
    ), stranding
    assert "is used after that call, at modeling_llama.py:" in stranding, stranding
    assert msg == (
        "pipeline boundary 'blocks.9' names no submodule of TimmStyleViT; a boundary is the "
        "path of the module whose call begins a stage (e.g. blocks, blocks.0, blocks.0.norm1, "
        "blocks.0.attn, blocks.0.attn.qkv, blocks.0.attn.proj, blocks.0.norm2, blocks.0.mlp)"
    ), msg


def _interleaved_moe(cache: str, runner: str) -> str:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from annot.core.errors import AnnotError

    cls, args = _qwen2_moe()
    model = annot.parallelize(
        cls,
        *args,
        mesh=annot.Mesh(pp=2),
        seed=0,
        chunks=2,
        split=["model.layers.1", "model.layers.2", "model.layers.3"],
        runner=runner,
    )

    @annot.jit(model, microbatches=2, schedule="interleaved")
    def step(b):
        loss = _hf_labels(model, b)
        model.backward(loss)
        return loss

    b = _tokens(torch.Generator().manual_seed(4), 0)
    try:
        loss = step(b).reduce_mean()
    except AnnotError as e:
        return f"{type(e).__name__}: {e}"
    torch.manual_seed(0)
    _compare_two_microbatches(model, cls(*args), b, loss, _hf_labels, "interleaved MoE")
    return f"ran: {model.report.runner}"


@pytest.mark.slow
def test_interleaved_stages_refuse_replaying_their_own_moe_on_meta(tmp_path):
    # rank 1 holds stages 1 and 3: stage 3 replays stage 1's layer (its own
    # module, not a placeholder answered from the log) on meta, where float32
    # grouped_mm has no kernel
    _, second = run_ranks(_interleaved_moe, 2, str(tmp_path), "replay", timeout=200)
    assert second.startswith(
        "PipelineError: pipeline stage 3 replays the earlier stages' part of forward (shapes "
        "only, on the meta device) and an op in 'model.layers.1' failed there: "
    ), second
    assert second.endswith(
        "float32. 'model.layers.1' belongs to an earlier stage this rank also holds "
        "(interleaved virtual stages), and a rank's own modules replay on meta, where its ops "
        "cannot run. Use chunks=1 for this model, or boundaries between blocks the source "
        "split can cut (runner='source' or left out: no stage runs an earlier one again)"
    ), second
    # runner= left out: the nested source split runs no earlier stage again
    (tmp_path / "source").mkdir()
    res = run_ranks(_interleaved_moe, 2, str(tmp_path / "source"), "auto", timeout=200)
    assert res == ["ran: source"] * 2, res


# ---- raw parameters read in a forward that spans the stages ---------------------------


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_raw_parameters_read_between_two_towers(tmp_path):
    # a CLIP-like model: the root reads a class token, positional embeddings,
    # projections and a temperature between and after its towers' calls. With
    # sample= each raw parameter is held by the stage that reads it (no tie);
    # without, one of the root (whose forward spans both stages) is held by both,
    # its gradient summed over them
    # (the replay's placement; the source split reads each stage's reads from
    # the source: no tie either way, below)
    res = _run(
        tmp_path, "two_tower", [["visual.blocks.1"], None], pp=2, sample=True, runner="replay"
    )
    assert res[0] == [([], ["visual.blocks.1"]), ([], ["visual.norm"])], res[0]
    (tmp_path / "gpipe").mkdir()
    res = _run(
        tmp_path / "gpipe", "two_tower", [["text.blocks.1"]], schedule="gpipe", runner="replay"
    )
    raw = ["class_embedding", "visual_positional", "visual_proj", "positional_embedding"]
    raw += ["text_projection", "logit_scale"]
    assert res[0] == [([(n,) for n in raw], ["text.blocks.1"])], res[0]
    # runner= left out: the nested source split, each raw parameter on the stage reading it
    (tmp_path / "source").mkdir()
    res = _run(tmp_path / "source", "two_tower", [["text.blocks.1"]], schedule="gpipe")
    assert res[0] == [([], ["text.blocks.1"])], res[0]


@pytest.mark.slow  # the structure fuzzer's fast profile pins this case too
def test_raw_parameter_after_the_blocks_with_a_tied_head(tmp_path):
    # self.head(self.norm(x) * self.scale.exp()), the embedding tied to the head:
    # split in the root's forward (source), by hand and automatically
    res = _run(tmp_path, "scaled_head", [["blocks.2"], None], pp=2)
    assert [ties for ties, _ in res[0]] == [[("embed.weight", "head.weight")]] * 2, res[0]
    (tmp_path / "gpipe").mkdir()
    _run(tmp_path / "gpipe", "scaled_head", [["norm"]], schedule="gpipe")


def _refusals(cache: str) -> list:
    """On every rank: the automatic split of the two-tower model and, cut at
    run time (the replay), a tower's raw parameter read on the other stage,
    both without sample=: the stages are placed in registration order, and
    the first call refuses that placement, before any stage runs."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    out = []
    runs = (("two_tower", None, "auto"), ("late_projection", ["text.blocks.1"], "replay"))
    for case, split, runner in runs:
        build, batch, loss_of = CASES[case]
        cls, args = build()
        model = annot.parallelize(
            cls, *args, mesh=annot.Mesh(pp=2), seed=0, split=split, runner=runner
        )

        @annot.jit(model, microbatches=MICRO)
        def step(b):
            loss = loss_of(model, b)  # noqa: B023 - called in this iteration
            model.backward(loss)  # noqa: B023
            return loss

        try:
            step(batch(torch.Generator().manual_seed(0), 0))
            out.append("no error")
        except annot.AnnotError as exc:
            out.append(str(exc))
    return out


@pytest.mark.slow  # the structure fuzzer's fast profile pins this case too
def test_raw_parameters_refused_where_annot_cannot_place_them(tmp_path):
    res = run_ranks(_refusals, 2, str(tmp_path), timeout=300)
    two_tower, late = res[0]
    # placed in registration order, the towers' calls and reads agree: it runs (parity below)
    assert two_tower == "no error", two_tower
    # stage 1 reads image.proj, placed on stage 0 with its tower
    assert late == (  # on every rank, before any stage runs
        "LateProjection's stages were placed in the order its modules are "
        "registered (no sample= to show the order forward calls them), and its first call "
        "shows otherwise: stage 1 (from boundary 'text.blocks.1') calls or reads 'image.proj', "
        "which that order placed on stage(s) [0]. To fix: pass sample=<one microbatch of "
        "forward's arguments, a tuple or a dict> to annot.parallelize, or give other "
        "boundaries with split=[...]"
    ), late
    (tmp_path / "two-tower").mkdir()  # the same automatic split, every gradient
    _run(tmp_path / "two-tower", "two_tower", [None], pp=2)
    # with sample= it is held by the stage that reads it
    (tmp_path / "sample").mkdir()
    _run(tmp_path / "sample", "late_projection", [["text.blocks.1"]], sample=True, runner="replay")
    # runner= left out, no sample=: the nested source split reads where forward reads it
    (tmp_path / "source").mkdir()
    _run(tmp_path / "source", "late_projection", [["text.blocks.1"]])
