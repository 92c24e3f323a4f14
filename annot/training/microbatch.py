"""Split a step's arguments into microbatches, and gather per-microbatch outputs.

Tensors (also inside tuples, lists, dicts, namedtuples and the other
containers ``torch.utils._pytree`` knows) are split on dim 0; every other
value is passed whole to every microbatch, and so are the arguments named in
``non_split``. All split tensors must share the batch size, and it must be
divisible by the number of microbatches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map, tree_unflatten

from annot.core.errors import PipelineError
from annot.runtime.trees import flatten

__all__ = ["StepOutput", "split_microbatches"]


class StepOutput(list):
    """The step function's return value for each microbatch, in order."""

    def reduce_mean(self) -> Any:
        """Mean over microbatches (the full-batch mean for equal microbatches)."""
        return _reduce(self, "mean")

    def reduce_sum(self) -> Any:
        return _reduce(self, "sum")

    def concat(self, dim: int = 0) -> Any:
        """Concatenate tensor outputs along ``dim`` (the batch, by default)."""
        return _combine(self, lambda ts: torch.cat(ts, dim=dim))


def _reduce(values: list, how: str) -> Any:
    def red(ts):
        s = torch.stack([t.detach().float() if t.is_floating_point() else t for t in ts])
        return s.mean(0) if how == "mean" else s.sum(0)

    return _combine(values, red)


def _combine(values: list, fn: Callable) -> Any:
    """Each leaf combined over the microbatches' values (same structures)."""

    def leaf(*xs: Any) -> Any:
        first = xs[0]
        if isinstance(first, torch.Tensor):
            return fn(list(xs))
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            t = fn([torch.tensor(float(v)) for v in xs])
            return t.item()
        if first is None:
            return None
        raise PipelineError(f"cannot reduce step outputs of type {type(first).__name__}")

    return tree_map(leaf, values[0], *values[1:])


def _batch_sizes(obj: Any, path: str, out: dict[str, int]) -> None:
    """The batch size (dim 0) of each tensor in ``obj``, by its path (for the
    error that names them; a pytree node registered without key paths is
    named by the leaf's place)."""
    try:
        leaves = [(path + keystr(keys), x) for keys, x in tree_flatten_with_path(obj)[0]]
    except (ValueError, TypeError):
        leaves = [(f"{path}, leaf {i}", x) for i, x in enumerate(flatten(obj)[0])]
    for where, x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            out[where] = x.shape[0]


def _split(flat: tuple[list, Any], m: int, bases: list[dict]) -> list:
    """The ``m`` microbatches of one argument (``flat``: its leaves and spec)."""
    leaves, spec = flat
    parts = [
        [_own_version(c, bases[i]) for i, c in enumerate(torch.chunk(x, m, dim=0))]
        if isinstance(x, torch.Tensor) and x.dim() > 0
        else [x] * m
        for x in leaves
    ]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(m)]


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor of its own memory that ``set_`` can stand for exactly."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_conj() or t.is_neg() or t.is_meta)
    )


def _shared_storages(values: Any) -> list:
    """The memory (storages) that more than one tensor among the step's
    arguments lives in."""
    seen: set = set()
    shared: dict = {}
    for x in flatten(list(values))[0]:
        if isinstance(x, torch.Tensor) and _plain(x):
            storage = x.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen:
                shared[ptr] = (storage, x.device)
            seen.add(ptr)
    return list(shared.items())


def _bases(shared: list) -> dict:
    """One microbatch's fresh byte tensor over each shared storage: the chunks
    of the arguments living there become views of it (one version counter)."""
    return {
        ptr: torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        for ptr, (storage, device) in shared
    }


def _own_version(chunk: torch.Tensor, bases: dict) -> torch.Tensor:
    """``chunk``'s memory as a tensor with a version counter of its
    microbatch's own. Chunks of one tensor are views sharing one counter, so a
    forward that changes its input in place (``x.add_(1)``) on microbatch
    i + 1 would make autograd refuse microbatch i's backward under 1F1B,
    whose memory it never touched; single-device gradient accumulation runs
    each backward first. Arguments sharing memory (``step(t, t)``) keep
    sharing one counter within a microbatch (``bases``: one fresh tensor per
    storage and microbatch, the chunks views of it), so autograd still sees
    an in-place change of one as a change of the other, as plain torch does.
    Left as it is: a chunk that requires grad (its gradient flows to the
    whole) and anything ``set_`` cannot stand for (conjugate or negative
    views, quantized, sparse, meta)."""
    if chunk.requires_grad or not _plain(chunk):
        return chunk
    storage = chunk.untyped_storage()
    key = storage.data_ptr()
    if key in bases:  # shared with another argument: a view of this microbatch's base
        base = bases[key]
        return base.view(chunk.dtype).as_strided(
            chunk.shape, chunk.stride(), chunk.storage_offset()
        )
    own = torch.empty(0, dtype=chunk.dtype, device=chunk.device)
    return own.set_(storage, chunk.storage_offset(), chunk.shape, chunk.stride())


def split_microbatches(
    fn: Callable, args: tuple, kwargs: dict, microbatches: int, non_split: tuple[str, ...] = ()
) -> list[tuple[tuple, dict]]:
    """``[(args_i, kwargs_i) for each microbatch i]`` for calling ``fn``."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PipelineError(f"microbatches={microbatches!r}; expected an int >= 1")
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise PipelineError(f"{fn.__qualname__}{sig}: {e}") from None
    unknown = set(non_split) - set(sig.parameters)
    if unknown:
        raise PipelineError(
            f"non_split={non_split!r} names {sorted(unknown)}, which are not parameters of "
            f"{fn.__qualname__}{sig}"
        )
    flat = {name: flatten(v) for name, v in bound.arguments.items() if name not in non_split}
    batches = {
        x.shape[0]
        for leaves, _ in flat.values()
        for x in leaves
        if isinstance(x, torch.Tensor) and x.dim() > 0
    }
    if len(batches) > 1:
        sizes: dict[str, int] = {}
        for name in flat:
            _batch_sizes(bound.arguments[name], name, sizes)
        raise PipelineError(
            "tensors split into microbatches must share the batch size (dim 0); got "
            + ", ".join(f"{k}: {v}" for k, v in sizes.items())
            + "; pass the others in non_split=(...)"
        )
    if batches:
        batch = next(iter(batches))
        if batch % microbatches:
            raise PipelineError(
                f"a batch of {batch} is not divisible into {microbatches} microbatches; "
                f"use a batch size that is a multiple of {microbatches}"
            )
    shared = _shared_storages(bound.arguments.values())
    bases = [_bases(shared) for _ in range(microbatches)]
    per_arg = {
        name: (
            [value] * microbatches if name in non_split else _split(flat[name], microbatches, bases)
        )
        for name, value in bound.arguments.items()
    }
    out = []
    for i in range(microbatches):
        ba = inspect.BoundArguments(sig, {k: v[i] for k, v in per_arg.items()})
        out.append((ba.args, ba.kwargs))
    return out
