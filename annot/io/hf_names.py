"""The names of a checkpoint on disk and of the single-device model, matched
as transformers' ``from_pretrained`` / ``save_pretrained`` match them, for
:mod:`annot.io.pretrained` and :mod:`annot.save_pretrained`.

Loading (:func:`match_names`): each stored name goes through transformers'
conversion mapping for the model (its ``WeightRenaming`` rules and the
``base_model_prefix`` added or stripped: ``rename_source_key``); a tied
weight (one tensor under several names) needs one of its names on disk;
what transformers ignores on load (``_keys_to_ignore_on_load_missing`` /
``_unexpected``, old ``rotary_emb.inv_freq`` and ``position_ids`` buffers)
is ignored here too, by transformers' own rule. A conversion that builds a
tensor from several stored ones (a ``WeightConverter``: fused MoE experts)
is refused, naming the key: annot reads stored tensors as they are.

Saving (:func:`save_names`): one name per tensor (a tied weight under the
name transformers keeps, its tie targets dropped as its
``save_pretrained`` drops them), ``_keys_to_ignore_on_save`` left out, each
name as it was loaded, else through transformers' reverse renamings.

A model that is not a transformers model is matched name for name.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import cast

from torch import nn

from annot.core.errors import CheckpointError

__all__ = ["Matched", "is_transformers", "match_names", "save_names", "tie_groups"]


@dataclass
class Matched:
    """``load[model name] = stored name`` for every name (tied ones each) of
    the model's state dict found on disk, and what does not fit."""

    load: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)


def tie_groups(ref: nn.Module) -> list[list[str]]:
    """The state dict's names grouped by tensor (a tied weight: several names)."""
    by_id: dict[int, list[str]] = {}
    for name, t in ref.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return list(by_id.values())


def is_transformers(model: object) -> bool:
    """Whether ``model`` (a module or a class) is a transformers model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    cls = model if isinstance(model, type) else type(model)
    return issubclass(cls, PreTrainedModel)


def _transforms(ref: nn.Module, *, saving: bool) -> tuple[list, list]:
    """(renamings, converters) transformers applies to ``ref``'s checkpoints
    (reversed for saving, as its ``revert_weight_conversion`` does)."""
    if not is_transformers(ref):
        return [], []
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    # is_transformers(ref): a PreTrainedModel
    transforms = get_model_conversion_mapping(cast(PreTrainedModel, ref), add_legacy=not saving)
    if saving:
        transforms = [
            t.reverse_transform() for t in transforms[::-1] if not isinstance(t, PrefixChange)
        ]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


def _converted(key: str, into: str, model: str) -> CheckpointError:
    return CheckpointError(
        f"{key}: transformers converts this stored tensor into {into} of {model} by combining "
        "or reshaping stored tensors (a WeightConverter of its conversion mapping); "
        "annot reads stored tensors as they are (renamed at most). Load the model with "
        "transformers and pass it to annot.parallelize, or save it in its in-memory layout "
        "first (save_pretrained(..., save_original_format=False))"
    )


def match_names(ref: nn.Module, stored: dict[str, tuple[int, ...]]) -> Matched:
    """Match the stored names (with their shapes) to ``ref``'s state dict
    (``ref``: the single-device model, on meta)."""
    from_disk: dict[str, str] = {}
    unexpected: set[str] = set()
    state = ref.state_dict(keep_vars=True)
    renamings, converters = _transforms(ref, saving=False)
    prefix = getattr(ref, "base_model_prefix", None) if is_transformers(ref) else None
    for key in stored:
        name = key
        if renamings or converters or prefix:
            from transformers.core_model_loading import rename_source_key

            name, converter = rename_source_key(key, renamings, converters, prefix or None, state)
            if converter is not None:
                raise _converted(key, name, type(ref).__name__)
        if name in state and name not in from_disk:
            from_disk[name] = key
        else:
            unexpected.add(key)
    out = Matched()
    missing: set[str] = set()
    for names in tie_groups(ref):
        found = next((from_disk[n] for n in names if n in from_disk), None)
        if found is None:
            missing.update(names)
            continue
        for n in names:
            out.load[n] = found
        want = tuple(state[names[0]].shape)
        if tuple(stored[found]) != want:
            out.wrong_shape.append(
                f"{found} has shape {tuple(stored[found])}, {names[0]} in the model {want}"
            )
    missing, unexpected = _ignored_by_transformers(ref, missing, unexpected)
    out.missing = [k for k in state if k in missing]
    out.unexpected = sorted(unexpected)
    return out


def _ignored_by_transformers(ref: nn.Module, missing: set[str], unexpected: set[str]):
    """``(missing, unexpected)`` less what transformers' ``from_pretrained``
    ignores for this model (its own rule, run on the two sets)."""
    if not is_transformers(ref):
        return missing, unexpected
    from transformers import PreTrainedModel

    # the rule reads only these two fields of its LoadStateDictInfo (whose other
    # fields change between transformers versions): a namespace of the two stands in
    info = types.SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    model = cast(PreTrainedModel, ref)  # is_transformers(ref)
    model._adjust_missing_and_unexpected_keys(info)  # type: ignore[arg-type]
    return info.missing_keys, info.unexpected_keys


def save_names(
    model: nn.Module, groups: list[list[str]], loaded_as: dict[str, str] | None
) -> dict[str, str]:
    """``{model name: stored name}`` for the tensors a checkpoint stores, in
    the order of ``groups`` (the state dict's names, grouped by tensor, of
    the whole model: every stage's): one name per tensor, the one
    transformers keeps; names as ``loaded_as`` maps them (a model read by
    :func:`annot.from_pretrained`), else reverse-renamed as transformers
    saves them. ``model`` (this rank's part) gives the transformers
    attributes (tied weights, keys not saved, conversions)."""
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    renamings, converters = _transforms(model, saving=True)
    keep: list[str] = []
    for names in groups:
        kept = [n for n in names if n not in tied_targets] or names
        keep.append(kept[0])
    out: dict[str, str] = {}
    for name in keep:
        if name in skip:
            continue
        if loaded_as and name in loaded_as:
            out[name] = loaded_as[name]
            continue
        stored = name
        if converters:
            from transformers.core_model_loading import apply_converters

            into, pattern = apply_converters(name, converters)
            if pattern is not None:
                raise _converted(into, name, type(model).__name__)
        if renamings:
            from transformers.core_model_loading import apply_renamings

            stored = apply_renamings(name, renamings)
        out[name] = stored
    return out
