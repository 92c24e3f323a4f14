"""Step 3 of :func:`annot.parallelize`: the hints the build applies, from
wherever they come: ``@shard`` on the classes, ``hints=`` by module path, a
transformers model's tp plan, the sources read (:mod:`annot.plan.inferred_hints`)
when nothing else says how to split, and at ep > 1 the experts (a
transformers model's ep plan, unless hinted)."""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from annot.build.hint_checks import check_shard_hints
from annot.core.errors import HintError
from annot.core.hints import ShardSpec, get_shard_spec, hinted_paths, resolve_hints
from annot.core.mesh import Mesh
from annot.core.specs import Spec

__all__ = ["build_hints", "class_specs"]

log = logging.getLogger("annot")


def class_specs(
    ref: nn.Module, hints: Optional[dict]
) -> tuple[dict[type, ShardSpec], dict[str, Spec]]:
    """(the specs each class's source rewrite applies, every hint by path):
    ``@shard`` decorators, merged with external ``hints=`` (which win)."""
    specs: dict[type, ShardSpec] = {}
    for m in ref.modules():
        s = get_shard_spec(type(m))
        if s is not None:
            specs[type(m)] = s
    external: dict[str, Spec] = {}
    if hints:
        ext_specs, external = resolve_hints(ref, hints)
        for cls, ext in ext_specs.items():
            base = specs.get(cls)
            if base is not None:  # external entries override the decorator's
                ext = ShardSpec(
                    {**base.specs, **ext.specs}, tuple(dict.fromkeys(base.local + ext.local))
                )
            specs[cls] = ext
    return specs, {**hinted_paths(ref, specs), **external}


def build_hints(ref: nn.Module, hints: Optional[dict], mesh: Mesh, report) -> tuple[dict, dict]:
    """Step 3: ``(specs by class, hints by path)``, verified against the
    reference; when nothing is hinted, a transformers model's own tp plan, else
    the hints its sources show (:mod:`annot.plan.inferred_hints`); at ep > 1 a
    transformers model's experts from its ep plan, unless hinted."""
    tp = mesh.tp
    if hints is None and tp > 1 and not any(get_shard_spec(type(m)) for m in ref.modules()):
        from annot.hf import hints_from_hf_config  # {} unless a transformers model with a plan
        from annot.plan.inferred_hints import infer_hints

        hints = hints_from_hf_config(ref, tp=tp) or None
        if hints is None:
            report.inferred = infer_hints(ref)
            hints = report.inferred.hints or None
            log.info("annot: tp hints inferred from source:\n%s", report.inferred.source())
    if hints and tp > 1:
        from annot.hf.lora import lora_hints

        hints = lora_hints(ref, hints)  # a LoRA layer's hint: its base layer's and adapters'
    if mesh.ep > 1:
        hints = _with_experts(ref, hints, mesh.ep)
    specs, paths = class_specs(ref, hints)
    if tp > 1 and not specs and not paths:
        raise HintError(
            f"tp={tp}, but nothing in {type(ref).__name__} says how to split it: no @shard on "
            "its classes, no hints= given, and no transformers tp plan; every rank would run "
            "the whole model. Give the layers' layout from outside, e.g. "
            "hints={'**.attn.q_proj': Col(), '**.attn.o_proj': Row(), "
            "'**.attn': Local('num_heads')} (README: 'A model you cannot edit'), or use tp=1"
            + (report.inferred.why_nothing() if report.inferred is not None else "")
        )
    check_shard_hints(ref, specs, tp, paths)
    return specs, paths


def _with_experts(ref: nn.Module, hints: Optional[dict], ep: int) -> dict:
    """``hints`` and, where neither they nor ``@shard`` name ``Experts()``, a
    transformers model's experts (its ep plan); refused when there are none."""
    from annot.core.specs import Experts, Partial
    from annot.hf.tp_plan import experts_from_hf_config

    given = any(isinstance(s, Experts) for s in (hints or {}).values()) or any(
        isinstance(s, Experts)
        for m in ref.modules()
        for s in (get_shard_spec(type(m)) or ShardSpec()).specs.values()
    )
    if given:
        return dict(hints or {})
    found = {  # where the tp plan says Partial(), the experts are split inside too
        k: Experts(partial=isinstance((hints or {}).get(k), Partial))
        for k in experts_from_hf_config(ref)
    }
    if not found:
        raise HintError(
            f"ep={ep}: nothing in {type(ref).__name__} is hinted Experts(), and it has "
            "no transformers expert-parallel plan, so there are no experts to split. Hint the "
            "module holding the experts' stacked weights, e.g. "
            "hints={'layers.*.moe.experts': annot.Experts()} or @shard(experts=Experts()) on "
            "its parent, or use ep=1"
        )
    return {**(hints or {}), **found}
