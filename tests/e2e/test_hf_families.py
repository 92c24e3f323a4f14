"""Many Hugging Face model families, unmodified, pipelined the way a user gets
it: ``parallelize(cls, config, mesh=Mesh(pp=2), split=<the uniform split>)``
with the runner left to annot (the nested source split wherever the rewriter
can cut the family's own forward code). Each against the single device: the
loss, every gradient and every parameter after two AdamW steps.

And the families whose transformers config carries a tp plan at tp=2 with
no hints (the plan read by annot), against the single device over two SGD
steps: at tp the sums run in another order, and AdamW turns those last-bit
differences on entries whose true gradient is zero (a key bias, under
softmax) into differences of its step size.

Tiny random configs of the installed transformers' classes (every family
here is in transformers 5.x, which pyproject.toml asks for)."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks

# family: the class, and the config's extra fields (beyond the shared ones below)
FAMILIES = {
    "Llama": ("LlamaForCausalLM", {}),
    "Mistral": ("MistralForCausalLM", {}),
    "Qwen2": ("Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3ForCausalLM", {}),
    "Gemma": ("GemmaForCausalLM", {}),
    "Gemma2": ("Gemma2ForCausalLM", {"sliding_window": 16}),
    "Phi": ("PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "Phi3": ("Phi3ForCausalLM", {"pad_token_id": 0}),
    "GPT2": ("GPT2LMHeadModel", {"n_embd": 64, "n_layer": 4, "n_head": 4}),
    "GPTNeoX": ("GPTNeoXForCausalLM", {}),
    "GPTJ": ("GPTJForCausalLM", {"n_embd": 64, "n_layer": 4, "n_head": 4, "rotary_dim": 8}),
    "Falcon": ("FalconForCausalLM", {}),
    "Bloom": ("BloomForCausalLM", {"n_layer": 4, "n_head": 4}),
    "OPT": ("OPTForCausalLM", {"ffn_dim": 96, "word_embed_proj_dim": 64}),
    "Mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Qwen2Moe": (
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 32},
    ),  # fmt: skip
    "Olmo2": ("Olmo2ForCausalLM", {}),
    "StableLm": ("StableLmForCausalLM", {}),
    "Starcoder2": ("Starcoder2ForCausalLM", {}),
    "Cohere": ("CohereForCausalLM", {}),
    "Granite": ("GraniteForCausalLM", {}),
    "Bert": ("BertForMaskedLM", {}),
    "DistilBert": ("DistilBertForMaskedLM", {"dim": 64, "hidden_dim": 96, "n_layers": 4, "n_heads": 4}),
    "ModernBert": ("ModernBertForMaskedLM", {"global_attn_every_n_layers": 2}),
    "T5": ("T5ForConditionalGeneration", {"d_model": 64, "d_ff": 96, "d_kv": 16, "num_layers": 4,
                                          "num_decoder_layers": 4, "num_heads": 4}),
    "Bart": ("BartForConditionalGeneration", {"d_model": 64, "encoder_layers": 4, "decoder_layers": 4,
                                              "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                                              "encoder_ffn_dim": 96, "decoder_ffn_dim": 96}),
}  # fmt: skip

SHARED = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "decoder_start_token_id": 0,
}
DROPOUTS = (
    "hidden_dropout", "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "dropout_rate", "activation_dropout",
    "classifier_dropout", "embedding_dropout", "mlp_dropout", "seq_classif_dropout", "qa_dropout",
)  # fmt: skip


def _build(family: str):
    import transformers

    name, extra = FAMILIES[family]
    cls = getattr(transformers, name)
    cfg = cls.config_class(**{**SHARED, **extra})
    for key in DROPOUTS:  # the reference and the pipeline see the same numbers
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
    return cls, cfg


# families whose config carries a tp plan (the others are refused at tp > 1 without
# hints, naming the hints to give: tests/e2e/test_hf_tp_models.py gives them)
TP_FAMILIES = (
    "Mistral", "Qwen2", "Gemma", "Gemma2", "Phi", "GPTNeoX", "Qwen2Moe", "Olmo2",
    "Starcoder2", "Cohere", "Granite",
)  # fmt: skip


def _train(cache: str, family: str, tp: int = 1):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from annot.hf import stages_from_hf_config
    from tests.parity import assert_close, compare_grads, compare_state

    cls, cfg = _build(family)
    if tp > 1:
        split, mesh = [], annot.Mesh(tp=tp)
    else:
        with torch.device("meta"):
            split = stages_from_hf_config(cls(cfg), 2)
        mesh = annot.Mesh(pp=2)
    model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, split=split or None)
    torch.manual_seed(0)
    ref = cls(cfg)
    model.train()
    ref.train()

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    optimizer = torch.optim.SGD if tp > 1 else torch.optim.AdamW
    opt = optimizer(model.parameters(), lr=1e-2)
    ref_opt = optimizer(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for i in range(2):
        ids = torch.randint(1, cfg.vocab_size, (4, 12), generator=g)
        loss = step(ids).reduce_mean()
        ref_loss = 0.0
        for part in ids.chunk(2):
            r = ref(input_ids=part, labels=part).loss
            (r / 2).backward()
            ref_loss += r.detach() / 2
        assert_close(loss, ref_loss, f"{family} step {i}: loss")
        compare_grads(model, ref, f"{family} step {i}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"{family} after 2 steps")
    return model.report.runner, split


@pytest.mark.slow  # about 5 s a family
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_pipelined_as_is_equals_one_device(tmp_path, family):
    for runner, split in run_ranks(_train, 2, str(tmp_path), family, timeout=300):
        assert len(split) == 1, split
        # every family here: the rewriter cuts its own forward code (the faster runner)
        assert runner == "source", (family, runner)


@pytest.mark.slow  # about 5 s a family
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_hf_family_at_tp2_from_its_plan_equals_one_device(tmp_path, family):
    run_ranks(_train, 2, str(tmp_path), family, 2, timeout=300)
