"""The op record of deferred initialization (:mod:`annot.runtime.init.recorder`):
what a recorded op (:class:`Op`), a tensor argument of one (:class:`Ref`, a
view of one version of a storage) and a storage's history (:class:`Storage`)
hold; which ops overwrite, leave values uninitialised, read only shapes,
change only a view, or cannot be replayed; and the helpers that bind an op's
arguments, set its device and lay out a replayed result like its storage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "EMPTY",
    "METADATA_INPLACE",
    "OVERWRITE",
    "SHAPE_ONLY",
    "SNAPSHOT_NUMEL",
    "UNSUPPORTED",
    "Geometry",
    "Op",
    "Ref",
    "Storage",
    "adopt",
    "bind",
    "geometry",
    "is_random",
    "on_device",
]

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset

# In-place ops that write ``self`` without reading it (when ``self`` covers its storage).
OVERWRITE = frozenset(
    {
        "fill_",
        "zero_",
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "bernoulli_",
        "copy_",
    }
)
# Ops whose values are uninitialised (replayed as zeros).
EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that read only the shape of their tensor input: a replay does not rebuild its values.
SHAPE_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
# In-place ops that change only a tensor's view of its storage, never values.
METADATA_INPLACE = frozenset(
    {"t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "detach_"}
)
UNSUPPORTED = frozenset({"set_", "resize_", "resize_as_", "as_strided_"})
_RANDOM_EXTRA = frozenset({"native_dropout"})  # random ops without a generator argument
SNAPSHOT_NUMEL = 1 << 16  # outside tensors up to this size are copied into the record


@dataclass(frozen=True)
class Ref:
    """A tensor argument of a recorded op: a view of one version of a storage."""

    sid: int
    ver: int
    geom: Geometry


@dataclass
class Op:
    """One recorded op, enough to run it again for real."""

    func: Any
    args: tuple  # tensors made inside build() as Ref, others as they were
    kwargs: dict
    writes: dict[int, int]  # sid -> version before the op (the op makes version + 1)
    pure: frozenset[int]  # written sids the op does not read (start from an empty buffer)
    creates: tuple[tuple[int, int, Geometry, int], ...]  # (sid, output index, geometry, numel)
    random: bool
    empty: bool
    shape_only: bool
    rng: Optional[torch.Tensor] = None  # CPU generator state before the op (random ops)
    gen_state: Optional[torch.Tensor] = None  # same for an explicit generator= argument


@dataclass
class Storage:
    sid: int
    dtype: torch.dtype
    numel: int
    meta: Any  # the meta untyped storage, kept alive so its address is not reused
    versions: list  # versions[v] is the Op that made version v


def geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.size()), tuple(t.stride()), int(t.storage_offset())


def bind(func, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """``[(schema argument, value)]`` for the arguments actually given."""
    schema = func._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    bound = list(zip(positional, args))
    bound += [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    return bound


def on_device(func, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """``args, kwargs`` with the op's ``device`` argument (if it has one) set to ``device``."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "device":
            if not a.kwarg_only and i < len(args):
                args = args[:i] + (device,) + args[i + 1 :]
            else:
                kwargs = {**kwargs, "device": device}
    return args, kwargs


@functools.cache
def is_random(packet) -> bool:
    """An op draws random numbers if any of its overloads takes a generator."""
    if packet.__name__ in _RANDOM_EXTRA:
        return True
    return any(
        a.name == "generator"
        for o in packet.overloads()
        for a in getattr(packet, o)._schema.arguments
    )


def adopt(real: torch.Tensor, geom: Geometry, numel: int) -> torch.Tensor:
    """A flat real tensor laid out like a storage whose view ``geom`` holds ``real``."""
    size, stride, offset = geom
    if (
        tuple(real.stride()) == stride
        and real.storage_offset() == offset
        and real.untyped_storage().nbytes() == numel * real.element_size()
    ):
        return real.as_strided((numel,), (1,), 0)
    flat = torch.empty(numel, dtype=real.dtype)
    flat.as_strided(size, stride, offset).copy_(real)
    return flat
