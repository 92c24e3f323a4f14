"""HF transformers models under annot: their parallel plans as annot hints.

transformers models say how they shard in data: ``config.base_model_tp_plan``
(paths relative to the base model, ``{"layers.*.self_attn.q_proj":
"colwise", ...}``), a head class's ``_tp_plan`` (``{"lm_head":
"colwise_gather_output"}``), and the same for pipelines (``base_model_pp_plan``:
the base model's modules in order, with their inputs and outputs). A built
model merges them into ``model.tp_plan`` / ``model.pp_plan`` with full paths
(``model.layers.*...``), adding ``embed_tokens: "embedding_rowwise"``. This
module reads them into annot's hints, so an unmodified model needs none by
hand::

    ref = LlamaForCausalLM(config)
    hints = hints_from_hf_config(ref, tp=2)
    # {"lm_head": Col(gather=True), "model.embed_tokens": Vocab(),
    #  "model.layers.*.self_attn.q_proj": Col(), ..., "model.layers.*.mlp.down_proj": Row()}
    model = annot.parallelize(LlamaForCausalLM, config, mesh=annot.Mesh(tp=2), hints=hints)

=================================================  ==========================
HF style                                           annot hint
=================================================  ==========================
``colwise``                                        ``Col()``
``colwise_rep``, ``colwise_gather_output``         ``Col(gather=True)``
``rowwise``, ``rowwise_rep``                       ``Row()`` (``Vocab()`` on an
                                                   ``nn.Embedding``)
``rowwise_split_input`` (after a gathered colwise)  ``Row(split_input=True)``
``embedding_rowwise``                              ``Vocab()``
``packed_colwise`` (fused gate|up)                 ``Col(chunks=2)``
``replicated_with_grad_allreduce`` (q/k norms)      ``Replicate(sum_grad=True)``
``moe_tp_experts`` (Mixtral's fused experts)        ``Partial()``; its ``packed_colwise``
                                                   / ``rowwise`` weights ``P(...)``
                                                   on their out / in dim
``replicate``, ``sequence_parallel``               left out: replicated, annot's
                                                   default (annot runs norms on
                                                   the full sequence)
anything else (experts, ``local_*``, ...)          refused (:class:`HintError`)
=================================================  ==========================

Plans say nothing about per-rank sizes (``local=``). Current HF attention
infers its head count from the tensor (``view(*shape, -1, head_dim)``), so
Llama, Qwen2 and Mistral need none; a model whose forward reads a head count
or width needs ``Local(...)`` hints added by hand (a missing one fails with a
shape error, never silently). GPT-2 declares no plan: :data:`ANNOT_PLANS`
holds annot's own for it (fused ``c_attn`` as ``Col(chunks=3)``, ``Local(
"split_size")``, its ``Conv1D`` projections, the tied ``wte`` / ``lm_head``).

Pipelines: an HF model's blocks are looped over inside the base model's
forward (``LlamaModel.forward``); :mod:`annot.runtime.replay` cuts stages there.
:func:`stages_from_hf_config` spreads the blocks the pp plan names evenly
over the stages, and :func:`sample_inputs` makes the tiny input the meta
probe of call order runs on. Under a pipeline the KV cache cannot cross a
stage boundary: :func:`pipeline_call_kwargs` turns it off when the call does
not ask for it and refuses ``use_cache=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import torch.nn as nn

from annot.errors import HintError, PipelineError
from annot.hints import path_matches
from annot.specs import Col, Local, P, Partial, Replicate, Row, Spec, Vocab

__all__ = [
    "ANNOT_PLANS",
    "pipeline_call_kwargs",
    "sample_inputs",
    "hints_from_hf_config",
    "is_hf_model",
    "stages_from_hf_config",
]

log = logging.getLogger("annot")

Hint = Union[Spec, Local]

# HF style -> annot spec; None: replicated (left out of the hints).
_STYLES: dict[str, Optional[Spec]] = {
    "colwise": Col(),
    "colwise_rep": Col(gather=True),
    "colwise_gather_output": Col(gather=True),
    "rowwise": Row(),
    "rowwise_rep": Row(),
    "embedding_rowwise": Vocab(),
    "packed_colwise": Col(chunks=2),
    "replicate": None,
    "replicated_with_grad_allreduce": Replicate(sum_grad=True),
    "rowwise_split_input": Row(split_input=True),
    "moe_tp_experts": Partial(),
    "sequence_parallel": None,
}


def _gpt2_plan(config: Any) -> dict[str, Hint]:
    """annot's plan for GPT-2 (base-model paths): Megatron's layout on its Conv1D layers."""
    if getattr(config, "add_cross_attention", False):
        raise HintError(
            "GPT-2 with add_cross_attention=True: annot's GPT-2 plan hints GPT2Attention.c_attn "
            "as Col(chunks=3) (fused q|k|v), but the cross-attention GPT2Attention fuses only "
            "k|v in its c_attn (2 blocks) and annot hints are per class; give hints= by hand "
            "(or hints={} to run it replicated)"
        )
    return {
        "h.*.attn.c_attn": Col(chunks=3),
        "h.*.attn.c_proj": Row(),
        "h.*.attn": Local("split_size"),
        "h.*.mlp.c_fc": Col(),
        "h.*.mlp.c_proj": Row(),
        "wte": Vocab(),
    }


#: annot's own plans for model types whose config declares no ``base_model_tp_plan``:
#: ``model_type -> (config -> hints on base-model paths)``. A head ``lm_head``
#: (nn.Linear) is added as ``Col(gather=True)``.
ANNOT_PLANS: dict[str, Callable[[Any], dict[str, Hint]]] = {"gpt2": _gpt2_plan}


def is_hf_model(obj: Any) -> bool:
    """Is ``obj`` a transformers ``PreTrainedModel`` (without importing transformers)?"""
    return isinstance(obj, nn.Module) and any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(obj).__mro__
    )


def _base_prefix(model: nn.Module) -> str:
    """``"model."`` for LlamaForCausalLM (its base model lives at ``model.model``),
    ``""`` for a base model itself."""
    name = getattr(model, "base_model_prefix", "") or ""
    if name and isinstance(getattr(model, name, None), nn.Module):
        return name + "."
    return ""


def _head_count_checks(config: Any, tp: int) -> None:
    for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
        n = getattr(config, attr, None)
        if isinstance(n, int) and not isinstance(n, bool) and n % tp:
            raise HintError(
                f"{type(config).__name__}.{attr}={n} is not divisible by tp ({tp}): "
                f"each tp rank holds whole attention heads; choose a tp that divides {n}"
            )


def hints_from_hf_config(
    model_or_config: Any, *, prefix: Optional[str] = None, tp: Optional[int] = None
) -> dict[str, Hint]:
    """annot hints (``{module path pattern: spec}``) from a transformers model's
    tensor-parallel plan; ``{}`` when it has none (or is not a transformers model).

    Given a built model, its full plan is used (``model.tp_plan``: the base
    model's plan under its attribute, ``model.`` for ``LlamaForCausalLM``,
    plus the head's, e.g. ``lm_head``); entries that match no module of this
    model are dropped and each spec is checked against the module it names.
    Given a config, ``config.base_model_tp_plan`` is converted with paths
    under ``prefix`` (default ``""``: the base model). A model type without a
    plan but in :data:`ANNOT_PLANS` (GPT-2) gets annot's plan. With ``tp``,
    head counts are checked to divide. Raises :class:`HintError` naming the
    path and style annot cannot shard.
    """
    model = model_or_config if isinstance(model_or_config, nn.Module) else None
    config = getattr(model, "config", None) if model is not None else model_or_config
    if model is not None and not is_hf_model(model):
        return {}
    if config is None or not hasattr(config, "to_dict"):
        if model is None:
            raise HintError(
                f"hints_from_hf_config: expected a transformers model or config, got "
                f"{type(model_or_config).__name__}"
            )
        return {}
    if model is not None:
        base = _base_prefix(model)
    else:
        base = prefix or ""
        if base and not base.endswith("."):
            base += "."
    plan = _plan_of(model, config, base)
    known = ANNOT_PLANS.get(getattr(config, "model_type", ""))
    if not plan and known is not None:
        plan = {base + k: v for k, v in known(config).items()}
        if model is not None and isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = Col(gather=True)
    hints: dict[str, Hint] = {}
    for path, style in plan.items():
        if isinstance(style, (Col, Row, Vocab, Replicate, Local)):  # annot's own plan
            hints[path] = style
            continue
        if not isinstance(style, str) or style not in _STYLES:
            raise HintError(
                f"{type(model or config).__name__}: tp plan entry {path!r}: {style!r} has no "
                f"annot equivalent (annot knows {', '.join(sorted(_STYLES))}); give hints= "
                "by hand for this model (hints={} runs it replicated)"
            )
        spec = _STYLES[style]
        if spec is not None:
            hints[path] = spec
    if model is not None:
        hints = _fit(model, hints)
    if hints and tp is not None:
        _head_count_checks(config, tp)
    log.debug("annot: hints from the transformers plan: %s", hints)
    return hints


def _plan_of(model: Optional[nn.Module], config: Any, base: str) -> dict[str, Any]:
    full = getattr(model, "tp_plan", None) if model is not None else None
    if isinstance(full, dict) and full:
        return dict(full)  # transformers >= 5: merged, full paths
    plan = {base + k: v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items()}
    if model is not None:
        head = getattr(type(model), "_tp_plan", None) or {}
        plan = {**head, **plan}
    return plan


def _fit(model: nn.Module, hints: dict[str, Hint]) -> dict[str, Hint]:
    """Drop entries that match nothing in ``model``; check the rest fit their targets."""
    from annot.runtime.tp_convert import layer_kind

    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, Hint] = {}
    where = type(model).__name__
    for pattern, spec in hints.items():
        hits = [p for p in modules if p and path_matches(pattern, p)]
        phits = [p for p in params if path_matches(pattern, p)]
        if not hits and not phits:
            log.debug("annot: %s: tp plan entry %r matches nothing; dropped", where, pattern)
            continue
        if isinstance(spec, Local):
            out[pattern] = spec
            continue
        if phits and _inside_partial(phits[0], hints):
            # MoE experts' fused weights (E, out, in): colwise splits out, rowwise in
            t = params[phits[0]]
            spec = _param_spec(spec, t.dim())
            if spec is not None:
                out[pattern] = spec
            continue
        if phits:
            p = phits[0]
            raise HintError(
                f"{where}: tp plan entry {pattern!r} ({spec!r}) names the raw parameter {p} "
                f"(shape {tuple(params[p].shape)}); annot shards modules from a plan, not "
                "parameters (experts and other fused tensors): give hints= by hand, with "
                "P(...) for parameters (hints={} runs it replicated)"
            )
        m = modules[hits[0]]
        kind = type(m).__name__
        if isinstance(spec, (Col, Row)) and isinstance(m, nn.Embedding):
            if isinstance(spec, Row):
                spec = Vocab()  # HF's rowwise embedding splits the vocabulary rows
            else:
                raise HintError(
                    f"{where}: tp plan entry {pattern!r} splits the embedding {hits[0]} on "
                    "its hidden dim (colwise), and the plan does not say who reads the "
                    "sharded output: give hints= by hand, Col(gather=True) for a full output "
                    "or Col() where the reader is split the same way"
                )
        elif isinstance(spec, (Col, Row)) and layer_kind(m) not in ("linear", "conv1d"):
            raise HintError(
                f"{where}: tp plan entry {pattern!r} ({spec!r}) names {hits[0]}, a {kind}; "
                "annot shards nn.Linear and transformers' Conv1D with Col() / Row(): give "
                "hints= by hand for this module (hints={} runs the model replicated)"
            )
        elif isinstance(spec, Vocab) and not isinstance(m, nn.Embedding):
            raise HintError(
                f"{where}: tp plan entry {pattern!r} (embedding_rowwise) names {hits[0]}, a "
                f"{kind}, not an nn.Embedding: give hints= by hand"
            )
        out[pattern] = spec
    return out


def _inside_partial(path: str, hints: dict[str, Hint]) -> bool:
    """Whether a ``moe_tp_experts`` (``Partial()``) entry names a module above ``path``."""
    return any(
        isinstance(s, Partial) and path.startswith(_prefix_of(pattern, path))
        for pattern, s in hints.items()
    )


def _prefix_of(pattern: str, path: str) -> str:
    """The prefix of ``path`` that ``pattern`` matches as a whole module path
    (``"\0"``, matching nothing, when none does)."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        head = ".".join(parts[:i])
        if path_matches(pattern, head):
            return head + "."
    return "\0"


def _param_spec(spec: Hint, ndim: int) -> Optional[P]:
    """An HF plan style on a raw ``(..., out, in)`` weight as a partition spec:
    colwise splits ``out`` (dim -2; a 1-D bias its only dim), rowwise splits
    ``in`` (dim -1; a 1-D bias stays whole)."""
    if isinstance(spec, Col):
        dim = ndim - 2 if ndim >= 2 else 0
        return P(*("tp" if i == dim else None for i in range(ndim)), chunks=spec.chunks)
    if isinstance(spec, Row):
        return None if ndim < 2 else P(*([None] * (ndim - 1)), "tp")
    return None


# ---- pipelines ---------------------------------------------------------------


def _pp_plan_of(model: nn.Module) -> dict[str, Any]:
    full = getattr(model, "pp_plan", None)
    if isinstance(full, dict) and full:
        return dict(full)
    base = _base_prefix(model)
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
        # balance the blocks, wherever they sit (annot.runtime.replay cuts nested forwards)
        n = len(model.get_submodule(blocks))
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


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def sample_inputs(model: nn.Module) -> Optional[dict]:
    """A tiny microbatch for a transformers model, made from its config (token
    ids, pixels, decoder ids): enough for a meta forward that shows the order
    of module calls. None for other models."""
    import torch

    if not is_hf_model(model):
        return None
    config = model.config
    name = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model)
    if name == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        out = {name: torch.zeros(1, getattr(config, "num_channels", 3), size, size)}
    elif name == "input_ids":
        out = {name: torch.zeros(1, 4, dtype=torch.long)}
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
    if not is_hf_model(module) or "use_cache" not in _forward_params(module):
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


def _forward_params(module: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()
