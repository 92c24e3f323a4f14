"""Dropout on tensor-parallel shards that draws the single-device model's mask.

Inside a tp region each rank holds a slice of an activation (its heads, its
columns of the MLP's hidden layer). Plain dropout there draws a mask of the
slice's shape from each rank's generator; the ranks' generators agree, so
their masks are the same numbers on different heads, and none of them is the
mask the single-device model draws. Megatron's RNG tracker makes the masks
independent; annot makes them *equal to the single-device run's*: a rank draws
the whole mask, exactly as the single-device model would (same shape, same
generator, so the same numbers and the same generator state afterwards), and
keeps its slice. The memory of the full mask is the price of exactness.

Which calls see a sharded tensor, and along which dim, is found once by the
pre-flight (:mod:`annot.build.preflight`): it runs this rank's model and the
single-device model on meta tensors of the same sample, pairs their dropout
calls in order and compares shapes (:func:`sharded_sites`). A call is keyed by
its *site*: the module whose method made it (its path) and the line of the
model's code that called it, so the key is the same at every depth and on
every step, whatever the shapes and control flow.

At run time :class:`ShardedDropout` is a ``TorchFunctionMode`` around forward
(and around an activation-checkpointed recomputation, see
:func:`recompute_context`): at a keyed call it draws the full mask and keeps
this rank's contiguous slice. Covered: ``F.dropout`` (``nn.Dropout``),
``F.dropout1d/2d/3d``, ``torch.dropout``, and
``F.scaled_dot_product_attention(dropout_p=...)``, which is computed in its
math form around the full mask (bit-for-bit the CPU kernel's draws; a CUDA
reference uses its own kernels' generator). Alpha dropout on a shard is
refused by the pre-flight.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from annot.core.errors import HintError
from annot.runtime.frames import LIBRARY_DIRS

__all__ = [
    "Call",
    "Recorder",
    "ShardedDropout",
    "active",
    "Site",
    "module_names",
    "paired",
    "recompute_context",
    "shard_dim",
    "sharded_sites",
    "site",
]

# (input, p=0.5, training=True, inplace=False)
FUNCTIONAL = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)
# (input, p, train)
ATEN = (torch.dropout, torch.feature_dropout)
ALPHA = (F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout, torch.feature_alpha_dropout)
SDPA = F.scaled_dot_product_attention


Site = tuple[str, str, int]  # (module path, file, line)


def _is_dropout(func) -> bool:
    return func in FUNCTIONAL or func in ATEN or func in ALPHA or func is SDPA


def site(names: Mapping[int, str]) -> Site:
    """The module whose method made the current call (dropout, or a reshape:
    :mod:`annot.runtime.tp.reshape`), the nearest frame whose ``self`` is one of
    ``names``' modules, and the line of model code (outside torch and annot)
    that made it."""
    frame: Optional[FrameType] = sys._getframe(2)
    line: Optional[tuple[str, int]] = None
    while frame is not None:
        file = frame.f_code.co_filename
        if line is None and not file.startswith(LIBRARY_DIRS):
            line = (file, frame.f_lineno)
        if frame.f_code.co_varnames[:1] == ("self",):
            path = names.get(id(frame.f_locals.get("self")))
            if path is not None:
                return (path, *(line or (file, frame.f_lineno)))
        frame = frame.f_back
    return ("", *(line or ("", 0)))


def _p_and_training(func, args: tuple, kwargs: dict) -> tuple[float, bool]:
    if func is SDPA:
        p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        return float(p), True
    if func in ATEN or func in (torch.alpha_dropout, torch.feature_alpha_dropout):
        p = args[1] if len(args) > 1 else kwargs["p"]
        train = args[2] if len(args) > 2 else kwargs["train"]
        return float(p), bool(train)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return float(p), bool(training)


# -- the pre-flight's side: which sites see a sharded tensor ----------------------------


@dataclass(frozen=True)
class Call:
    """One dropout-family call seen on meta tensors."""

    func: Any
    site: Site
    shape: tuple[int, ...]
    p: float
    training: bool = True

    @property
    def draws(self) -> bool:
        """Whether the call draws a mask (``p > 0`` in training)."""
        return self.p > 0 and self.training

    def where(self) -> str:
        """``module path (file:line)`` of the call."""
        return _where(self.site)


class Recorder(TorchFunctionMode):
    """Logs every dropout-family call of a forward (the pre-flight runs it on
    meta tensors; :mod:`annot.runtime.compile` on a block's first real call)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = module_names(model)
        self.calls: list[Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_dropout(func) and args and isinstance(args[0], torch.Tensor):
            p, training = _p_and_training(func, args, kwargs)
            self.calls.append(Call(func, site(self.names), tuple(args[0].shape), p, training))
        return func(*args, **kwargs)


def module_names(model: nn.Module) -> dict[int, str]:
    """Module id -> its first path in ``model`` (what a site names)."""
    names: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), path)
    return names


def _where(site: Site) -> str:
    path, file, line = site
    return f"{path or '<root>'} ({os.path.basename(file)}:{line})"


def paired(local: Sequence, ref: Sequence) -> Optional[list[tuple]]:
    """This rank's recorded calls (``local``) side by side with the single-device
    model's (``ref``), in order; None when they are not the same calls (as many,
    of the same functions)."""
    if len(local) != len(ref) or any(a.func is not b.func for a, b in zip(local, ref)):
        return None
    return list(zip(local, ref))


def shard_dim(local: Sequence[int], ref: Sequence[int], tp: int) -> Optional[int]:
    """The dim along which a tensor of shape ``local`` is a tp shard of one of
    shape ``ref``: the one dim ``tp`` times smaller, all others equal. None when
    it is not one (the same shape, or another difference)."""
    dims = [d for d, (a, b) in enumerate(zip(local, ref)) if a != b]
    if len(local) != len(ref) or len(dims) != 1 or ref[dims[0]] != local[dims[0]] * tp:
        return None
    return dims[0]


def sharded_sites(local: Sequence[Call], ref: Sequence[Call], tp: int) -> dict[Site, int]:
    """The sites of this rank's calls (``local``) whose input is a tp shard of the
    single-device call's (``ref``, the same calls in the same order), with the
    sharded dim. Refuses what it cannot make equal: alpha dropout on a shard, a
    shard along two dims, one site sharded two ways."""
    pairs = paired(local, ref)
    if pairs is None:
        raise HintError(
            f"tp pre-flight: this rank's model makes {len(local)} dropout calls where the "
            f"single-device model makes {len(ref)} (or in another order), so annot cannot "
            "give each rank its part of the single-device mask. Set dropout to 0 in the "
            "model's config, or report the model"
        )
    sites: dict[Site, Optional[int]] = {}
    for mine, theirs in pairs:
        if mine.p == 0.0:
            continue
        dim = shard_dim(mine.shape, theirs.shape, tp)
        if dim is None and mine.shape != theirs.shape:
            raise HintError(
                f"tp pre-flight: dropout at {_where(mine.site)} gets a tensor of shape "
                f"{list(mine.shape)} on this rank where the single-device model's is "
                f"{list(theirs.shape)}: not one dim split {tp} ways, so annot cannot draw "
                "this rank's part of the single-device mask. Set its dropout to 0, or hint "
                "the module so the tensor is whole or split along one dim"
            )
        if dim is not None and mine.func in ALPHA:
            raise HintError(
                f"tp pre-flight: {mine.func.__name__} at {_where(mine.site)} gets a tp shard "
                "(its output is not the input times a mask, so annot cannot draw this rank's "
                "part of the single-device one); use nn.Dropout there or leave the module "
                "unsharded"
            )
        if sites.setdefault(mine.site, dim) != dim:
            raise HintError(
                f"tp pre-flight: dropout at {_where(mine.site)} gets a tp shard on some calls "
                "and not on others (or along another dim); annot keys a dropout by the module "
                "and line that call it. Call it once per kind of tensor"
            )
    return {site: dim for site, dim in sites.items() if dim is not None}


# -- the run time's side -------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Optional[ShardedDropout]] = contextvars.ContextVar(
    "annot_sharded_dropout", default=None
)


class ShardedDropout(TorchFunctionMode):
    """At a dropout site of ``sites`` (:func:`sharded_sites`) draw the whole
    single-device mask and keep this rank's slice; every other call runs as is.
    ``names``: module id -> path of this rank's model."""

    def __init__(self, names: Mapping[int, str], sites: Mapping[Site, int]) -> None:
        super().__init__()
        self.names, self.sites = names, sites

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_dropout(func) or not args:
            return func(*args, **kwargs)
        p, training = _p_and_training(func, args, kwargs)
        if p == 0.0 or not training:
            return func(*args, **kwargs)
        dim = self.sites.get(site(self.names))
        if dim is None:
            return func(*args, **kwargs)
        from annot.runtime.tp.comm import tp_env

        _, tp, rank = tp_env()
        if func is SDPA:
            return _attention(args, kwargs, p, dim, tp, rank)
        x = args[0]
        full = list(x.shape)
        full[dim] *= tp
        ones = torch.ones(full, dtype=x.dtype, device=x.device)
        mask = func(ones, p, True) if func in ATEN else func(ones, p, True, False)
        mask = mask.narrow(dim, rank * x.shape[dim], x.shape[dim])
        inplace = func in FUNCTIONAL and (args[3] if len(args) > 3 else kwargs.get("inplace"))
        return x.mul_(mask) if inplace else x * mask


def _attention(args: tuple, kwargs: dict, p: float, dim: int, tp: int, rank: int) -> torch.Tensor:
    """``scaled_dot_product_attention`` in its math form (torch's CPU kernel with
    dropout), with this rank's slice of the full ``(..., heads, L, S)`` mask."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, causal = bound.get("attn_mask"), bound.get("is_causal", False)
    scale = bound.get("scale")
    if bound.get("enable_gqa", False) and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    L, S = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q * math.sqrt(scale)) @ (k * math.sqrt(scale)).transpose(-2, -1)
    if causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    softmax = getattr(torch, "_safe_softmax", None)
    weights = softmax(scores, -1) if softmax is not None else scores.softmax(-1)
    d = dim if dim >= 0 else dim + q.dim()
    full = list(weights.shape)
    full[d] *= tp
    drop = F.dropout(torch.ones(full, dtype=weights.dtype, device=weights.device), p, True)
    return (weights * drop.narrow(d, rank * weights.shape[d], weights.shape[d])) @ v


def active() -> Optional[ShardedDropout]:
    """The sharded-dropout mode forward runs under here, if any."""
    return _ACTIVE.get()


def recompute_context() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation in
    backward runs under the sharded-dropout mode that the forward ran under, so
    it draws the same masks (torch restores the generator state itself)."""
    active = _ACTIVE.get()
    if active is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), ShardedDropout(active.names, active.sites)
