"""Context parallelism for transformers models (``annot.Mesh(dp=2, cp=2)``).

Each rank of a cp group is handed the same batch; the model's forward keeps
this rank's tokens of each sequence (:func:`annot.runtime.cp.sequence.positions`,
load-balanced for the causal mask), with their positions in the whole sequence
(``position_ids``: rotary embeddings follow each token), and its labels
shifted over the whole sequence first (``shift_labels``: a token's target may
live on another rank). Attention runs through transformers' SDPA attention
function, which annot wraps once: while a cp model's forward runs, each layer's
keys and values are all-gathered over the cp group and the causal mask comes
from the tokens' positions (:mod:`annot.runtime.cp.attention`). The loss is this
rank's tokens' summed loss over its share of the batch's tokens
(``num_items_in_batch``), so the dp average of the gradients is the
single-device gradient; the loss returned is the cp group's mean: the batch's
loss. Logits stay this rank's tokens'.

Refused, naming the fix: another attention implementation than SDPA, sliding
windows, a padding ``attention_mask``, a sequence that ``2 * cp`` does not
divide, a model that is not a transformers model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from annot.core.errors import HintError
from annot.hf.tp_plan import is_hf_model
from annot.runtime.cp.attention import SequenceSplit, attend
from annot.runtime.cp.sequence import check_length, mean_over, positions

__all__ = ["install"]

# the split of the cp forward running now (innermost last; None: a forward on meta)
_ACTIVE: list[SequenceSplit | None] = []


def _refuse_unsupported(root: nn.Module) -> None:
    name = type(root).__name__
    if not is_hf_model(root):
        raise HintError(
            f"cp > 1: context parallelism splits the sequence of transformers models (their "
            f"attention goes through one function annot wraps); {name} is not one. Use cp=1"
        )
    cfg = root.config
    impl = getattr(cfg, "_attn_implementation", None)
    if impl != "sdpa":
        raise HintError(
            f"cp > 1: {name} runs attention with {impl!r}; context parallelism runs it "
            "through SDPA. Build it with attn_implementation='sdpa' (transformers' default)"
        )
    window = getattr(cfg, "sliding_window", None)
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if window and (not kinds or kinds - {"full_attention"}):
        raise HintError(
            f"cp > 1: {name} has sliding-window attention (sliding_window={window}); context "
            "parallelism masks the whole causal sequence only. Use cp=1, or a config "
            "without sliding windows"
        )


def _wrap_sdpa() -> None:
    """transformers' SDPA attention function, cp-aware while a cp forward runs (once)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(original, "__annot_cp__", False):
        return

    def sdpa(module, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        split = _ACTIVE[-1] if _ACTIVE else None
        if split is None or kwargs.get("position_bias") is not None or args:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        out = attend(
            query,
            key,
            value,
            split,
            causal=causal,
            dropout=kwargs.get("dropout", 0.0),
            scale=kwargs.get("scaling"),
        )
        return out.transpose(1, 2).contiguous(), None

    sdpa.__annot_cp__ = True  # type: ignore[attr-defined]
    AttentionInterface.register("sdpa", sdpa)


def _enter(ctx, module, args, kwargs):
    """The root's forward pre-hook: this rank's tokens, positions and labels."""
    cp, rank = ctx.mesh.cp, ctx.cp_rank
    args = list(args)
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    whole = ids if ids is not None else embeds
    if whole is None:
        raise HintError(
            f"cp > 1: {type(module).__name__} was called without input_ids or inputs_embeds"
        )
    if whole.is_meta:  # the pre-flight's shapes: the model as tp built it
        _ACTIVE.append(None)
        return None
    length = whole.shape[1]
    check_length(length, cp, type(module).__name__)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise HintError(
            f"cp > 1: {type(module).__name__} was given an attention_mask with padding; context "
            "parallelism masks the causal sequence only. Pack the batch without padding, or "
            "mark padded labels -100 and pass no attention_mask"
        )
    mine = positions(length, cp, rank, whole.device)
    every = torch.cat([positions(length, cp, r, whole.device) for r in range(cp)])
    given = kwargs.get("position_ids")
    full = given if given is not None else torch.arange(length, device=whole.device)[None]
    kwargs["position_ids"] = full.expand(whole.shape[0], length)[:, mine]
    if ids is not None:
        if "input_ids" in kwargs or not args:
            kwargs["input_ids"] = ids[:, mine]
        else:
            args[0] = ids[:, mine]
    if embeds is not None:
        kwargs["inputs_embeds"] = embeds[:, mine]
    labels = kwargs.get("labels")
    if labels is not None and not _shared_loss(type(module)):
        raise HintError(
            f"cp > 1: {type(module).__name__}.forward computes its loss itself, shifting the "
            "labels within the sequence it sees (this rank's part), which would be wrong here; "
            "call it without labels and compute the loss from the logits against the labels "
            "shifted over the whole sequence, or use cp=1"
        )
    if labels is not None:  # shifted over the whole sequence, then this rank's
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)
        kwargs["labels"] = kwargs["shift_labels"] = shifted[:, mine]
        kwargs["num_items_in_batch"] = (shifted != -100).sum().float() / cp
    kwargs["use_cache"] = False
    _ACTIVE.append(SequenceSplit(mine, every, ctx.cp_group, cp))
    return tuple(args), kwargs


@functools.cache
def _shared_loss(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` computes its loss with transformers' shared loss
    function (``self.loss_function``, which takes ``shift_labels``); read once
    per class."""
    import inspect

    try:
        return "self.loss_function(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _leave(ctx, module, args, kwargs, output):
    """The root's forward hook: the batch's loss, the cp group's mean (a
    ``ModelOutput``'s ``loss``, or the first value of the tuple
    ``return_dict=False`` gives when there are labels)."""
    if _ACTIVE.pop() is None:
        return output
    if isinstance(output, tuple):
        if "shift_labels" in kwargs and output and isinstance(output[0], torch.Tensor):
            return (mean_over(output[0], ctx.cp_group, ctx.mesh.cp), *output[1:])
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        output.loss = mean_over(loss, ctx.cp_group, ctx.mesh.cp)
        if isinstance(output, dict) and "loss" in output:
            output["loss"] = output.loss
    return output


class _Hook:
    """A hook bound to the mesh's context; copies of the model (the pre-flight's
    meta twin) share it rather than copy its process groups."""

    def __init__(self, fn, ctx):
        self.fn, self.ctx = fn, ctx

    def __call__(self, *args):
        return self.fn(self.ctx, *args)

    def __deepcopy__(self, memo):
        return self


def install(root: nn.Module, ctx) -> None:
    """Context parallelism on a built transformers model (``ctx.mesh.cp > 1``)."""
    _refuse_unsupported(root)
    _wrap_sdpa()
    root.register_forward_pre_hook(_Hook(_enter, ctx), with_kwargs=True)
    root.register_forward_hook(_Hook(_leave, ctx), with_kwargs=True)
