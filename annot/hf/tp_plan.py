"""HF transformers models' tensor-parallel plans as annot hints.

transformers models say how they shard in data: ``config.base_model_tp_plan``
(paths relative to the base model, ``{"layers.*.self_attn.q_proj":
"colwise", ...}``), a head class's ``_tp_plan`` (``{"lm_head":
"colwise_gather_output"}``), and the same for pipelines (``base_model_pp_plan``:
the base model's modules in order, with their inputs and outputs). A built
model merges them into ``model.tp_plan`` / ``model.pp_plan`` with full paths
(``model.layers.*...``), adding ``embed_tokens: "embedding_rowwise"``. This
module reads the tensor-parallel ones into annot's hints, so an unmodified
model needs none by hand (the pipeline side is :mod:`annot.hf`)::

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import torch.nn as nn

from annot.core.errors import HintError
from annot.core.hints import path_matches
from annot.core.specs import Col, Local, P, Partial, Replicate, Row, Spec, Vocab

__all__ = [
    "ANNOT_PLANS",
    "Hint",
    "base_prefix",
    "experts_from_hf_config",
    "hints_from_hf_config",
    "is_hf_class",
    "is_hf_model",
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
    return isinstance(obj, nn.Module) and is_hf_class(type(obj))


def is_hf_class(cls: type) -> bool:
    """Is ``cls`` a subclass of transformers' ``PreTrainedModel``?"""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in cls.__mro__
    )


def base_prefix(model: nn.Module) -> str:
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
        from annot.hf.lora import peft_base

        wrapped = peft_base(model)  # a PEFT model: the plan of the model it wraps
        if wrapped is None:
            return {}
        at, inner = wrapped
        return {at + k: v for k, v in hints_from_hf_config(inner, tp=tp).items()}
    if config is None or not hasattr(config, "to_dict"):
        if model is None:
            raise HintError(
                f"hints_from_hf_config: expected a transformers model or config, got "
                f"{type(model_or_config).__name__}"
            )
        return {}
    if model is not None:
        base = base_prefix(model)
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


def experts_from_hf_config(model: nn.Module) -> dict[str, Hint]:
    """``Experts()`` at the modules a transformers model's expert-parallel plan
    (``config.base_model_ep_plan``: ``"layers.*.mlp.experts": "ep_dispatch_experts"``)
    names, on this model's paths; ``{}`` without a plan. The plan's other
    entries (``grouped_gemm`` on the experts' weights) are how transformers runs
    them: annot runs the experts module's own forward."""
    from annot.core.specs import Experts

    if not is_hf_model(model):
        return {}
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    base = base_prefix(model)
    modules = [p for p, _ in model.named_modules() if p]
    return {
        base + k: Experts()
        for k, style in plan.items()
        if style == "ep_dispatch_experts" and any(path_matches(base + k, p) for p in modules)
    }


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
    from annot.hf.lora import is_lora_layer
    from annot.runtime.tp.convert import layer_kind

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
            partition = _param_spec(spec, t.dim())
            if partition is not None:
                out[pattern] = partition
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
        if is_lora_layer(m):  # a PEFT LoRA layer: it is sharded as the layer it wraps
            m = m.base_layer
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
