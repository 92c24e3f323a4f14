"""LoRA adapters (PEFT) under tensor parallelism.

A PEFT model wraps a transformers model (``PeftModelForCausalLM`` holds it at
``base_model.model``) and replaces each targeted layer by a LoRA layer: the
original layer as ``base_layer``, the adapters ``lora_A[name]`` (in -> r) and
``lora_B[name]`` (r -> out) beside it, their product added to its output.

A hint on a LoRA layer shards it the way it shards the layer it wraps, and
the adapters to match, so their sum needs no communication of its own:

- ``Col(...)`` (output features split): ``base_layer`` gets the hint,
  ``lora_B`` the same hint (its rows follow the base's output columns, fused
  chunks included), ``lora_A`` stays whole (every rank has the whole input);
- ``Row()`` (input features split): ``base_layer`` and ``lora_A`` get it
  (``lora_A`` all-reduces its r outputs, a vector of rank r per token), and
  ``lora_B`` stays whole.

The base model's own tp plan (:func:`annot.hf.tp_plan.hints_from_hf_config`)
reaches through the wrapper (:func:`peft_base`), so a LoRA-wrapped Llama
needs no hints. What annot cannot shard exactly is refused by name: LoRA on a
``Vocab()`` embedding, DoRA's magnitude vectors under ``Row()``.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from annot.core.errors import HintError
from annot.core.hints import path_matches
from annot.core.specs import Col, Replicate, Row

__all__ = ["adapter_names", "is_lora_layer", "lora_hints", "peft_base", "write_adapter_config"]


def peft_base(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """``(path prefix, the model)`` a PEFT wrapper holds
    (``("base_model.model.", LlamaForCausalLM)``); None for any other model."""
    if not type(model).__module__.startswith("peft."):
        return None
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    if not isinstance(inner, nn.Module):
        return None
    path = next(p for p, m in model.named_modules() if m is inner)
    return f"{path}." if path else "", inner


def is_lora_layer(m: nn.Module) -> bool:
    """A PEFT LoRA layer: the layer it wraps as ``base_layer``, adapters in
    ``lora_A`` / ``lora_B`` (module dicts keyed by adapter name)."""
    return (
        isinstance(getattr(m, "base_layer", None), nn.Module)
        and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(m, "lora_B", None), nn.ModuleDict)
    )


def lora_hints(model: nn.Module, hints: dict) -> dict:
    """``hints`` with each hint on a LoRA layer of ``model`` given to the layer
    it wraps and to its adapters (module docstring); others as they are."""
    modules = dict(model.named_modules())
    out: dict = {}
    for pattern, spec in hints.items():
        hits = [p for p, m in modules.items() if p and path_matches(pattern, p)]
        wrapped = [p for p in hits if is_lora_layer(modules[p])]
        if not wrapped:
            out[pattern] = spec
            continue
        for p in hits:  # a pattern that also names plain layers keeps them by path
            if p in wrapped:
                out.update(_layer_hints(p, modules[p], spec, pattern))
            else:
                out[p] = spec
    return out


def _layer_hints(path: str, layer: nn.Module, spec, pattern: str) -> dict:
    where = f"hints: {pattern!r} names {path}, a LoRA layer ({type(layer).__name__})"
    if getattr(layer, "lora_embedding_A", None):
        raise HintError(
            f"{where} of an embedding: annot does not shard LoRA embeddings; leave the "
            "embedding whole (drop its hint) or keep it out of the LoRA target_modules"
        )
    if isinstance(spec, Replicate):
        return {path: spec}
    if not isinstance(spec, (Col, Row)):
        raise HintError(
            f"{where}: {spec!r} on a LoRA layer; annot shards one as Col() or Row() (its "
            "base layer with the hint, the adapters to match) or keeps it whole (Replicate())"
        )
    if isinstance(spec, Row) and getattr(layer, "lora_magnitude_vector", None):
        raise HintError(
            f"{where} with DoRA (use_dora=True) under Row(): the magnitude normalises by "
            "the whole weight's column norms; use plain LoRA on this layer, or Col()"
        )
    out = {f"{path}.base_layer": spec}
    adapters = layer.lora_A
    assert isinstance(adapters, nn.ModuleDict)
    for name in adapters:
        if isinstance(spec, Col):
            out[f"{path}.lora_B.{name}"] = spec
        else:
            out[f"{path}.lora_A.{name}"] = spec
    return out


def adapter_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """``{model name: stored name}`` for the adapter tensors of a PEFT model's
    state dict ``names`` (every stage's), as ``PeftModel.save_pretrained``
    stores them: ``...q_proj.lora_A.default.weight`` as
    ``...q_proj.lora_A.weight``. One LoRA adapter, its biases not trained
    (``bias="none"``, PEFT's default); else refused."""
    configs = getattr(model, "peft_config", {})
    (adapter, config), *more = configs.items()
    if more or getattr(config, "bias", "none") != "none":
        raise HintError(
            f"save_pretrained: {type(model).__name__} holds adapters {sorted(configs)} "
            f"(bias={getattr(config, 'bias', 'none')!r}); annot saves one adapter whose "
            "biases are not trained (bias='none'): delete the others with "
            "model.delete_adapter(name) before parallelize"
        )
    out = {}
    for name in names:
        parts = name.split(".")
        at = [i for i in range(1, len(parts)) if parts[i] == adapter and "lora_" in parts[i - 1]]
        if at:
            out[name] = ".".join(parts[: at[0]] + parts[at[0] + 1 :])
    return out


def write_adapter_config(model: nn.Module, directory: str) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it."""
    import copy

    ((_, config),) = getattr(model, "peft_config").items()  # noqa: B009 - a PEFT attribute
    config = copy.deepcopy(config)
    config.inference_mode = True
    config.save_pretrained(directory)
