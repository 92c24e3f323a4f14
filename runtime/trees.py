"""annot's helpers on ``torch.utils._pytree``, for nested values (tuples,
lists, dicts, namedtuples and the containers torch or a library registered,
such as transformers' ``ModelOutput``).

Walk nested values with pytree. The helpers here add annot's one convention
on top: a ``torch.Size`` stays whole (:func:`keep_whole`; pytree would
rebuild it as a plain tuple). :func:`tensors` is the tensors among the
leaves, :func:`map_tensors` maps them, :func:`flatten` takes a structure
apart for ``tree_unflatten``. Hand-written walkers remain only where pytree
cannot say what is needed: the p2p wire codec (:mod:`annot.runtime.pipeline.p2p_codec`),
the frame walk of the replay (:mod:`annot.runtime.frames`) and the op
cache's structure keys (:mod:`annot.runtime.runners.meta_ops`), each saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map_only

__all__ = ["flatten", "keep_whole", "map_tensors", "tensors"]


def keep_whole(x: Any) -> bool:
    """The ``is_leaf`` of annot's walks: a ``torch.Size`` is one value."""
    return isinstance(x, torch.Size)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree``, in pytree order (depth first, dicts in
    insertion order)."""
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with each tensor ``t`` replaced by ``fn(t)``, all else as is."""
    return tree_map_only(torch.Tensor, fn, tree, is_leaf=keep_whole)


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """``tree``'s leaves and its spec, for ``tree_unflatten``."""
    return tree_flatten(tree, is_leaf=keep_whole)
