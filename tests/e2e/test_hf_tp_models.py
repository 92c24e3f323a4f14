"""Tensor parallelism on HF transformers models as shipped (real gloo ranks,
random init from small configs, offline): tp=2 with zero hand-written hints
where the model ships a tp plan, verification on, and the loss, the logits,
every gradient and every parameter after 2 AdamW steps equal to the
single-device model.

Qwen3 is the partial-gradient case: its per-head ``q_norm`` / ``k_norm`` read
tp-sharded heads, so each rank's gradient is a partial sum. Its plan says
``replicated_with_grad_allreduce``; annot sums them over tp. Without that sum
``verify=True`` names them.

Every model runs through both paths: the class and its config, and the built
model (the instance ``from_pretrained`` gives).
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from annot.core.specs import Col, Heads, Local, Row
from annot.testing import RanksFailed, run_ranks
from tests.hf.test_models_gpt2 import LLAMA_KW

SMALL = {**LLAMA_KW, "head_dim": 8}  # the same small decoder, any family


def _build(name: str):
    import transformers

    if name == "falcon":  # no plan; its projections are FalconLinear, an nn.Linear subclass
        cfg = transformers.FalconConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=False,
            alibi=False,
            bias=True,
        )
        return transformers.FalconForCausalLM, cfg
    if name == "gptj":  # no plan; GPTJ_ATTENTION_CLASSES picks its attention class
        cfg = transformers.GPTJConfig(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=16
        )
        return transformers.GPTJForCausalLM, cfg
    if name == "opt":  # no plan, no hints: read off the sources
        cfg = transformers.OPTConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            word_embed_proj_dim=32,
            dropout=0.0,
        )
        return transformers.OPTForCausalLM, cfg
    if name == "bert":  # no plan; the attention's output projection in BertSelfOutput
        cfg = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return transformers.BertForMaskedLM, cfg
    if name == "bloom":  # no plan; ALiBi built for all heads in BloomModel.forward
        cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
        return transformers.BloomForCausalLM, cfg
    if name == "t5":  # no plan; relative-position bias made once, shared by every layer
        cfg = transformers.T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        return transformers.T5ForConditionalGeneration, cfg
    cls, cfg_cls, extra = {
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
        # plan + embedding_rowwise on Gemma3TextScaledWordEmbedding (an nn.Embedding
        # subclass whose forward scales super().forward(ids))
        "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {"sliding_window": 4}),
        # colwise_gather_output then rowwise_split_input on fused qkv / gate_up
        "phi3": ("Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0}),
        # moe_tp_experts: fused (E, 2I, H) / (E, H, I) expert weights split inside one module
        "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4}),
    }[name]
    return getattr(transformers, cls), getattr(transformers, cfg_cls)(**SMALL, **extra)


# At most 6 lines of hints for a model that ships no plan.
HINTS = {
    "falcon": lambda: {
        "**.self_attention.query_key_value": Col(),  # per head q|k|v: a plain split keeps heads
        "**.self_attention.dense": Row(),
        "**.mlp.dense_h_to_4h": Col(),
        "**.mlp.dense_4h_to_h": Row(),
        "**.self_attention": Local("num_heads", "num_kv_heads"),
    },
    "gptj": lambda: {
        "**.attn.[qkv]_proj": Col(),
        "**.attn.out_proj": Row(),
        "**.mlp.fc_in": Col(),
        "**.mlp.fc_out": Row(),
        "**.attn": Local("num_attention_heads"),
    },
    "bloom": lambda: {
        "**.self_attention.query_key_value": Col(),  # per head q|k|v, as Falcon
        "**.self_attention.dense": Row(),
        "**.mlp.dense_h_to_4h": Col(),
        "**.mlp.dense_4h_to_h": Row(),
        "**.self_attention": Local("num_heads"),
        "**.self_attention.alibi": Heads(dim=0, heads=4),  # (batch * n_head, 1, k)
    },
    "t5": lambda: {
        "**.[qkv]": Col(),
        "**.o": Row(),
        "**.relative_attention_bias": Col(),  # (buckets, n_heads): its columns are heads
        "**.DenseReluDense.wi": Col(),
        "**.DenseReluDense.wo": Row(),
        "**.*Attention": Local("n_heads", "inner_dim"),
    },
}


def _train(model, ref, what):
    import torch

    from tests.parity import train_against_reference

    def run(m, ids):
        out = m(ids, labels=ids, use_cache=False)
        return out.loss, {"logits": out.logits}

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, SMALL["vocab_size"], (2, 8), generator=g) for _ in range(2)]
    train_against_reference(model, ref, batches, run, what, lr=1e-3)


def _parity(cache: str, name: str, hints=None, built: bool = False, inferred: bool = False):
    """tp=2 against the single-device model; ``built``: hand annot the built
    model (the instance path) instead of the class and its config;
    ``inferred``: no hints, those read off the sources."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot

    cls, cfg = _build(name)
    if hints is None and name in HINTS and not inferred:
        hints = HINTS[name]()
    mesh = annot.Mesh(tp=2)
    if built:
        torch.manual_seed(0)
        model = annot.parallelize(cls(cfg), mesh=mesh, hints=hints, verify=True)
    else:
        model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, hints=hints, verify=True)
    assert (model.report.inferred is not None) == inferred
    torch.manual_seed(0)
    ref = cls(cfg)
    _train(model, ref, f"{name} tp=2")
    if inferred:  # each class the hints split checked against the whole module on the first call
        assert model.report.inferred.checked == CHECKED[name], model.report.inferred.checked
    return sorted(n for n, p in model.named_parameters() if getattr(p, "annot_grad_sum", None))


@pytest.mark.parametrize(
    "built", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["class", "instance"]
)
def test_qwen3_tp2_sums_partial_qk_norm_gradients(tmp_path, built):
    summed = run_ranks(_parity, 2, str(tmp_path), "qwen3", None, built, timeout=300)
    assert summed[0] == summed[1]
    assert summed[0] == [
        f"module.model.layers.{i}.self_attn.{n}.weight"
        for i in range(2)
        for n in ("k_norm", "q_norm")
    ]


def _plan_without_sums(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    from annot.core.specs import Replicate
    from annot.hf import hints_from_hf_config

    cls, cfg = _build("qwen3")
    with __import__("torch").device("meta"):
        hints = hints_from_hf_config(cls(cfg), tp=2)
    hints = {k: v for k, v in hints.items() if not isinstance(v, Replicate)}
    return _parity(cache, "qwen3", hints)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_verify_names_a_missing_gradient_sum(tmp_path):
    with pytest.raises(RanksFailed) as err:
        run_ranks(_plan_without_sums, 2, str(tmp_path), timeout=300)
    for text in err.value.failures.values():
        assert (
            "VerifyError: the tp ranks disagree on the gradient of 4 replicated parameter(s): "
            in text
        )
        assert "model.layers.0.self_attn.q_norm.weight (off by up to" in text
        assert "Replicate(sum_grad=True)" in text


@pytest.mark.parametrize(
    "name, built",
    [
        ("gemma3", False),  # zero hints: the plan, and the scaled embedding kept
        pytest.param("gemma3", True, marks=pytest.mark.slow),
        ("phi3", False),  # zero hints: rowwise_split_input
        pytest.param("phi3", True, marks=pytest.mark.slow),
        ("mixtral", False),  # zero hints: MoE experts, router replicated
        pytest.param("mixtral", True, marks=pytest.mark.slow),
        ("falcon", False),  # FalconLinear by runtime type
        pytest.param("falcon", True, marks=pytest.mark.slow),
        ("gptj", False),  # the class path follows GPTJ_ATTENTION_CLASSES to the rewrite
        pytest.param("gptj", True, marks=pytest.mark.slow),
        ("bloom", False),  # ALiBi: each rank's heads of it, where it enters the attention
        pytest.param("bloom", True, marks=pytest.mark.slow),
        ("t5", False),  # the relative-position table split by heads, read by own heads
        pytest.param("t5", True, marks=pytest.mark.slow),
    ],
)
def test_tp2_parity_on_models_without_plain_layers(tmp_path, name, built):
    run_ranks(_parity, 2, str(tmp_path), name, None, built, timeout=300)


def _bloom_without_heads(cache: str):
    hints = {k: v for k, v in HINTS["bloom"]().items() if not isinstance(v, Heads)}
    return _parity(cache, "bloom", hints)


def test_bloom_alibi_left_whole_is_refused_before_training(tmp_path):
    """Without Heads(), each rank's attention gets ALiBi for all heads: the
    pre-flight refuses, naming the attention module, before any step."""
    with pytest.raises(RanksFailed) as err:
        run_ranks(_bloom_without_heads, 2, str(tmp_path), timeout=300)
    for text in err.value.failures.values():
        assert (
            "HintError: tp pre-flight: at tp=2, this rank's model fails in "
            "'transformer.h.0.self_attention' (BloomAttention)" in text
        )
        assert "transformer.h.0.self_attention: Local('num_heads')" in text


def _dropout_parity(cache: str, name: str):
    """Dropout > 0 inside the tp regions: T5's eager attention (F.dropout on the
    heads-split weights) and GPT-2's SDPA (``dropout_p``); each forward seeded
    alike, so every rank draws its slice of the single-device masks."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot
    from tests.parity import train_against_reference

    if name == "t5":
        cls, cfg = _build("t5")
        cfg.dropout_rate = 0.1
        hints = HINTS["t5"]()
    else:
        from tests.hf.test_models_gpt2 import GPT2_KW, _accept_conv1d_in_verify, _gpt2_hints

        _accept_conv1d_in_verify()
        kw = {**GPT2_KW, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
        cls, cfg, hints = transformers.GPT2LMHeadModel, transformers.GPT2Config(**kw), _gpt2_hints()
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(tp=2), seed=0, hints=hints, verify=True)
    torch.manual_seed(0)
    ref = cls(cfg)
    assert model.dropout, "the pre-flight found no dropout on a tp shard"

    def run(m, batch):
        ids, seed = batch
        torch.manual_seed(seed)
        out = m(ids, labels=ids, use_cache=False)
        return out.loss, {}

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 64, (2, 8), generator=g), 10 + s) for s in range(2)]
    train_against_reference(model, ref, batches, run, f"{name} dropout tp=2", lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_tp2_dropout_equals_the_single_device_run(tmp_path, name):
    run_ranks(_dropout_parity, 2, str(tmp_path), name, timeout=300)


def _inferred(cache: str, name: str):
    _parity(cache, name, inferred=True)
    return True


CHECKED = {  # the modules whose forward shows a split, one of each class
    "opt": ["model.decoder.layers.0", "model.decoder.layers.0.self_attn"],
    # the attention's columns in BertSelfAttention, its row in BertSelfOutput: the
    # module above both is checked; the MLP's (BertIntermediate, BertOutput, called
    # through apply_chunking_to_forward) pair up in the layer, checked whole
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.0.attention"],
}


@pytest.mark.parametrize("name", ["opt", "bert"])
def test_tp2_without_hints(tmp_path, name):
    """OPT and BERT ship no tp plan: what their sources show is split."""
    assert run_ranks(_inferred, 2, str(tmp_path), name, timeout=300) == [True, True]
