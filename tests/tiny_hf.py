"""Tiny Hugging Face models for the training-loop tests (tests/e2e/test_frozen.py,
test_accumulation.py, test_evaluation.py, test_load_state_dict.py): each
returns ``(class, config, the pp=2 split)``. GPT-2's head is tied to its token
embedding, across the two stages."""

from __future__ import annotations


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel, cfg, ["transformer.h.2"]


def tiny_llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM, cfg, ["model.layers.2"]
