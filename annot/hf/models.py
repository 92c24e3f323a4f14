"""HF transformers models under annot: their plans and the pipeline side.

Tensor parallel: a model's ``tp_plan`` is read into annot hints by
:mod:`annot.hf.tp_plan` (:func:`hints_from_hf_config`, :data:`ANNOT_PLANS`
and :func:`is_hf_model` are re-exported here, where the build looks for
them).

Pipelines: an HF model's blocks are looped over inside the base model's
forward (``LlamaModel.forward``); :mod:`annot.runtime.runners.replay` cuts stages there.
:func:`stages_from_hf_config` spreads the blocks the pp plan names evenly
over the stages, and :func:`sample_inputs` makes the tiny input the meta
probe of call order runs on. Under a pipeline the KV cache cannot cross a
stage boundary: :func:`pipeline_call_kwargs` turns it off when the call does
not ask for it and refuses ``use_cache=True``. transformers' output capture
(``output_hidden_states``, ``output_router_logits``: forward hooks that append
each layer's outputs to a collector) crosses stages through
:func:`captured_outputs`, which the replay logs with each layer's outputs.

Training loops: ``annot.hf.Trainer`` and ``annot.hf.Accelerator``
(:mod:`annot.integrations.hf_trainer`, loaded on first use) are transformers' Trainer and
accelerate's Accelerator for an annot model.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Optional

import torch.nn as nn

from annot.core.errors import HintError, PipelineError
from annot.hf.tp_plan import (
    ANNOT_PLANS,
    base_prefix,
    hints_from_hf_config,
    is_hf_class,
    is_hf_model,
)
from annot.runtime.runners.placeholder import register_collectors

__all__ = [
    "ANNOT_PLANS",
    "captured_outputs",
    "hints_from_hf_config",
    "is_hf_model",
    "nested_blocks",
    "pipeline_call_kwargs",
    "sample_inputs",
    "stages_from_hf_config",
]


def _pp_plan_of(model: nn.Module) -> dict[str, Any]:
    full = getattr(model, "pp_plan", None)
    if isinstance(full, dict) and full:
        return dict(full)
    base = base_prefix(model)
    config = getattr(model, "config", None)
    plan = dict(getattr(type(model), "_pp_plan", None) or {})
    plan.update(
        {base + k: v for k, v in (getattr(config, "base_model_pp_plan", None) or {}).items()}
    )
    return plan


def nested_blocks(model: nn.Module) -> Optional[str]:
    """The block list the pp plan names (``model.layers``), else the model's
    largest ``nn.ModuleList`` (``transformer.h`` for GPT-2)."""
    modules = dict(model.named_modules())
    for path in _pp_plan_of(model):
        if isinstance(modules.get(path), nn.ModuleList):
            return path
    lists = [
        (sum(p.numel() for p in m.parameters()), path)
        for path, m in modules.items()
        if path and isinstance(m, nn.ModuleList)
    ]
    return max(lists)[1] if lists else None


def stages_from_hf_config(model: nn.Module, n_stages: int) -> list[str]:
    """A ``split=[...]`` for ``n_stages`` pipeline stages of a transformers model
    that annot can run: boundaries at the root's direct submodules covered by
    the model's pp plan (``base_model_pp_plan`` under the base model, and the
    head's ``_pp_plan``), in the root's order, first one excluded; without a pp
    plan, the root's direct submodules. For ``LlamaForCausalLM`` and
    ``GPT2LMHeadModel`` that is ``["lm_head"]``: stage 0 runs the base model,
    stage 1 the head and the loss. For a base model whose own forward loops
    over the blocks (``GPT2Model``: ``h``), the blocks split evenly (``["h.1"]``).

    Raises :class:`HintError` when there are fewer such boundaries than
    ``n_stages - 1``: the blocks are looped over in the base model's forward,
    which annot does not split yet.
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise HintError(f"stages_from_hf_config: n_stages={n_stages!r}; expected an int >= 1")
    if n_stages == 1:
        return []
    blocks = nested_blocks(model)
    if blocks is not None:
        # balance the blocks, wherever they sit (annot.runtime.runners.replay cuts nested forwards)
        block_list = model.get_submodule(blocks)
        assert isinstance(block_list, nn.ModuleList)  # what nested_blocks names
        n = len(block_list)
        if n < n_stages:
            raise HintError(
                f"{type(model).__name__}: {blocks} has {n} blocks, fewer than the "
                f"{n_stages} pipeline stages asked for"
            )
        return [f"{blocks}.{(k * n) // n_stages}" for k in range(1, n_stages)]
    raise HintError(
        f"{type(model).__name__}: no block list (an nn.ModuleList) to spread over {n_stages} "
        "pipeline stages; give the boundaries with split=[...] (module paths)"
    )


def sample_inputs(model: nn.Module) -> Optional[dict]:
    """A tiny microbatch for a transformers model, made from its config (token
    ids, pixels, mel features, decoder ids): enough for a meta forward that shows the order
    of module calls. None for other models."""
    import torch

    if not is_hf_model(model):
        from annot.hf.lora import peft_base

        wrapped = peft_base(model)  # a PEFT model passes the inputs on to the one it wraps
        return sample_inputs(wrapped[1]) if wrapped is not None else None
    config: Any = model.config  # a transformers PretrainedConfig
    name = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model)
    if name == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        out: dict[str, Any] = {name: torch.zeros(1, getattr(config, "num_channels", 3), size, size)}
    elif name == "input_ids":
        out = {name: torch.zeros(1, 4, dtype=torch.long)}
    elif name == "input_features" and hasattr(config, "num_mel_bins"):  # speech (Whisper)
        frames = 2 * getattr(config, "max_source_positions", 1500)  # the encoder's fixed length
        out = {name: torch.zeros(1, config.num_mel_bins, frames)}
    else:
        return None
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = torch.zeros(1, 4, dtype=torch.long)
    if "use_cache" in params:
        out["use_cache"] = False
    return out


def pipeline_call_kwargs(module: nn.Module, kwargs: dict) -> dict:
    """The keyword arguments of a transformers model's call under pipeline
    stages: ``use_cache=False`` added when not given (training needs no KV
    cache, and a ``DynamicCache`` cannot cross a stage boundary); an explicit
    ``use_cache=True`` is refused."""
    if not _takes_use_cache(module):
        return kwargs
    if kwargs.get("use_cache"):
        raise PipelineError(
            f"{type(module).__name__} under pipeline parallelism: use_cache=True, but the KV "
            "cache (a transformers DynamicCache) is built by the first stage and cannot cross "
            "a pipeline boundary. Pass use_cache=False to the model call (training needs no "
            "cache)"
        )
    if "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return kwargs


def _takes_use_cache(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers model whose forward takes
    ``use_cache``: looked up once per class and class forward, not on every
    microbatch (inspect.signature costs tens of us); each call where the
    instance has a forward of its own (accelerate's hooks, a patch)."""
    cls: Any = type(module)
    if "forward" in module.__dict__:
        return is_hf_class(cls) and "use_cache" in _forward_params(module)
    return _class_takes_use_cache(cls, cls.forward)


@functools.lru_cache(maxsize=256)
def _class_takes_use_cache(cls: Any, forward: Any) -> bool:
    if not is_hf_class(cls):
        return False
    try:
        return "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _forward_params(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def captured_outputs() -> list[tuple[str, list]]:
    """The lists transformers' output-capture hooks append to in the forward
    under way (``hidden_states``, ``attentions``, ``router_logits``, ...); none
    when transformers is not loaded or no capture is on."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    active = getattr(capturing, "_active_collector", None)  # (private: may move)
    collector = active.get() if active is not None else None
    if not collector:
        return []
    return [(k, v) for k, v in collector.items() if isinstance(v, list) and not k.startswith("_")]


register_collectors(captured_outputs)
