"""Reshapes that split a tensor-parallel shard into heads: the pre-flight's check.

A column-parallel projection's output holds this rank's features, contiguous:
its heads, each whole (with ``Col(chunks=k)``, its heads of each of the k
chunks). Forward splits the features into heads with a reshape,
``q.view(B, T, self.n_head, C // self.n_head)``: with the head count made
local (``Local('n_head')``) each rank gets ``n_head / tp`` heads of
``head_dim``. Left global (a forgotten ``Local``, or a count read through a
name the rewriter does not divide, ``cfg = self.config; nh = cfg.n_head``),
``q.view(B, T, nh, -1)`` still fits the shard: ``n_head`` heads of
``head_dim / tp``, each made of pieces of different heads. Every shape agrees
and the run is silently wrong.

The pre-flight (:mod:`annot.build.preflight`) records the reshapes of both models'
meta forwards (:class:`ReshapeRecorder`, the dropout :class:`Recorder` that
also logs ``view`` / ``reshape`` / ``unflatten``) and pairs them in order
(:func:`annot.runtime.tp.dropout.paired`). :func:`check_head_splits` looks at
each pair whose input is a tp shard of the single-device one
(:func:`annot.runtime.tp.dropout.shard_dim`) and whose single-device reshape
splits that dim into several: grouped by the prefix products of the input
dims, the local output must divide the group's outermost dim (heads) and keep
the inner ones (head_dim) whole; with a fused projection (``Col(chunks=k)``
in the module), the dim right after the chunks' ``k`` (timm's
``reshape(B, N, 3, heads, head_dim)``). Merges (several dims into one) and
reshapes of tensors that are not shards are left alone.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

import torch
import torch.nn as nn

from annot.core.errors import HintError
from annot.runtime.frames import LIBRARY_DIRS
from annot.runtime.tp.dropout import Recorder, Site, paired, shard_dim, site
from annot.runtime.tp.layers import ColumnParallelConv1D, ColumnParallelLinear

__all__ = ["RESHAPES", "Reshape", "ReshapeRecorder", "check_head_splits", "column_chunks"]

# What ``x.view(...)``, ``x.reshape(...)``, ``x.unflatten(...)``, ... reach a
# TorchFunctionMode as.
RESHAPES = (
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.Tensor.view_as,
    torch.Tensor.reshape_as,
    torch.Tensor.unflatten,
    torch.reshape,
    torch.unflatten,
)

log = logging.getLogger("annot")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class Reshape:
    """One reshape-family call of model code, seen on meta tensors."""

    func: Any
    site: Site
    shape_in: tuple[int, ...]
    shape_out: tuple[int, ...]


def _by_model_code() -> bool:
    """Whether the call being recorded comes from the model's code: the first
    frame outside torch (``nn.Unflatten``'s forward is torch's) and outside the
    modes that pass the call on (the pre-flight's shape mode) is not annot's."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR)
        or frame.f_code.co_name == "__torch_function__"
    ):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(LIBRARY_DIRS)


class ReshapeRecorder(Recorder):
    """The dropout :class:`Recorder` that also logs the model code's reshapes
    (``reshapes``), for :func:`check_head_splits`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.reshapes: list[Reshape] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in RESHAPES or not args or not isinstance(args[0], torch.Tensor):
            return super().__torch_function__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == args[0].numel() and _by_model_code():
            self.reshapes.append(
                Reshape(func, site(self.names), tuple(args[0].shape), tuple(out.shape))
            )
        return out


def column_chunks(model: nn.Module) -> dict[str, int]:
    """Path -> ``chunks`` of each column-parallel layer of ``model`` with a fused
    weight (``chunks`` > 1)."""
    return {
        path: m.chunks
        for path, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, ColumnParallelConv1D)) and m.chunks > 1
    }


def _prefix(shape: Sequence[int]) -> list[int]:
    out = [1]
    for n in shape:
        out.append(out[-1] * n)
    return out


def _split_group(shape_in: Sequence[int], shape_out: Sequence[int], dim: int) -> list[int]:
    """The output dims (of size > 1) that the single-device reshape splits input
    ``dim`` into, by prefix products; [] when it does not split it into several
    (kept whole, merged with others, or no clean boundary)."""
    if 0 in shape_in or 0 in shape_out:
        return []
    p_in, p_out = _prefix(shape_in), _prefix(shape_out)
    start, end = p_in[dim], p_in[dim + 1]
    if start not in p_out or end not in p_out:
        return []
    first = len(p_out) - 1 - p_out[::-1].index(start)  # after any leading 1s
    last = p_out.index(end)
    group = [j for j in range(first, last) if shape_out[j] > 1]
    return group if len(group) > 1 else []


def check_head_splits(
    local: Sequence[Reshape], ref: Sequence[Reshape], tp: int, chunks: Mapping[str, int]
) -> None:
    """Refuse (:class:`HintError`) a reshape of this rank's model (``local``) that
    splits a tp shard into heads with an inner dim divided; ``ref``: the
    single-device model's reshapes, ``chunks``: :func:`column_chunks` of this
    rank's model. See the module docstring. Reshapes that do not pair up (not
    as many, or other functions) are not compared (logged)."""
    pairs = paired(local, ref)
    if pairs is None:
        log.debug(
            "annot: tp pre-flight: this rank's model makes %d reshapes where the "
            "single-device model makes %d; how they split tp shards is not checked",
            len(local),
            len(ref),
        )
        return
    for mine, theirs in pairs:
        dim = shard_dim(mine.shape_in, theirs.shape_in, tp)
        if dim is None or len(mine.shape_out) != len(theirs.shape_out):
            continue
        group = _split_group(theirs.shape_in, theirs.shape_out, dim)
        divided = [j for j in group if mine.shape_out[j] != theirs.shape_out[j]]
        if not divided:
            continue
        path = mine.site[0]
        allowed = {1} | {k for p, k in chunks.items() if not path or p.startswith(f"{path}.")}
        if len(divided) == 1 and math.prod(theirs.shape_out[group[0] : divided[0]]) in allowed:
            continue
        _, file, line = theirs.site  # the user's source (this rank runs the rewritten copy)
        sizes = " x ".join(str(theirs.shape_out[j]) for j in group)
        heads = list(theirs.shape_out)
        heads[group[0]] //= tp
        raise HintError(
            f"tp pre-flight: at tp={tp}, {path or '<root>'} ({os.path.basename(file)}:{line}) "
            f"splits a tp shard into heads with .{mine.func.__name__}(...): "
            f"{list(mine.shape_in)} -> {list(mine.shape_out)} on this rank, where the "
            f"single-device model's {list(theirs.shape_in)} -> {list(theirs.shape_out)} "
            f"splits dim {dim} into {sizes}. Each rank holds whole heads, so its reshape must "
            f"divide the outermost of those (the heads: {heads}), not an inner one: as it is, "
            "each of its heads mixes pieces of several, and every shape still agrees. The "
            "head count in this reshape is the global one: name the head count in "
            "Local(...), e.g. Local('n_head') or Local('config.n_head'); if forward reads it "
            "through another name, read it as self.<attr> where it is used"
        )
