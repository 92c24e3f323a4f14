"""annot.hf.lora: a hint on a PEFT LoRA layer shards its base layer as given
and its adapters to match (Col: lora_B; Row: lora_A); the base model's plan
reaches through the PEFT wrapper; what cannot be sharded is refused by name."""

import pytest

from annot.core.errors import HintError
from annot.core.specs import Col, Row, Vocab
from annot.hf.lora import adapter_names, lora_hints, peft_base

pytest.importorskip("peft")


def _lora_llama(targets=("q_proj", "o_proj")):
    from peft import LoraConfig, get_peft_model

    from tests.tiny_hf import tiny_llama

    cls, cfg, _ = tiny_llama()
    return get_peft_model(cls(cfg), LoraConfig(r=2, target_modules=list(targets)))


def test_a_hint_on_a_lora_layer_goes_to_its_base_layer_and_adapters():
    model = _lora_llama()
    at, inner = peft_base(model)
    assert at == "base_model.model."
    assert type(inner).__name__ == "LlamaForCausalLM"
    layer = "base_model.model.model.layers.0"
    hints = lora_hints(
        model,
        {
            f"{layer}.self_attn.q_proj": Col(),
            f"{layer}.self_attn.o_proj": Row(),
            f"{layer}.mlp.up_proj": Col(),  # not a LoRA target: as given
        },
    )
    assert hints == {
        f"{layer}.self_attn.q_proj.base_layer": Col(),
        f"{layer}.self_attn.q_proj.lora_B.default": Col(),
        f"{layer}.self_attn.o_proj.base_layer": Row(),
        f"{layer}.self_attn.o_proj.lora_A.default": Row(),
        f"{layer}.mlp.up_proj": Col(),
    }


def test_the_base_models_plan_reaches_through_the_wrapper():
    from annot.hf import hints_from_hf_config

    hints = hints_from_hf_config(_lora_llama(), tp=2)
    assert hints["base_model.model.model.layers.*.self_attn.q_proj"] == Col()
    assert hints["base_model.model.model.layers.*.self_attn.o_proj"] == Row()


def test_what_annot_cannot_shard_on_a_lora_layer_is_refused_by_name():
    model = _lora_llama()
    with pytest.raises(HintError, match=r"'\*\*.q_proj' names .*q_proj, a LoRA layer .*Vocab"):
        lora_hints(model, {"**.q_proj": Vocab()})


def test_adapters_are_stored_in_peft_names():
    model = _lora_llama()
    names = adapter_names(model, list(model.state_dict()))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert names[key] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert len(names) == 4 * 2 * 2  # layers x targets x (A, B); no base weight
