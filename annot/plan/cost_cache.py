"""The cost model's cache (:mod:`annot.plan.cost`): measurements stored as
JSON under :func:`cache_key`, a digest of everything they depend on, so a
second run does not profile again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from annot.core.files import atomic_write
from annot.plan.cost_segments import SegmentCost, as_segments
from annot.runtime.trees import flatten

__all__ = ["CACHE_VERSION", "cache_key", "load", "store"]

CACHE_VERSION = 1


def _source_hash(obj: Any) -> str:
    plain = inspect.isfunction(obj) or inspect.ismethod(obj)
    target = obj if plain else type(obj)
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        src = getattr(target, "__qualname__", type(target).__qualname__)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _describe(x: Any) -> Any:
    """The structure of ``x`` (its pytree spec) and each leaf: a tensor's
    shape, dtype, device and requires_grad, anything else's repr."""
    leaves, spec = flatten(x)
    return [str(spec), [_describe_leaf(v) for v in leaves]]


def _describe_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype), str(x.device), x.requires_grad]
    return repr(x)


def cache_key(
    segments: Sequence[Any],
    sample_inputs: Any,
    *,
    modules: Optional[Sequence[Sequence[nn.Module]]] = None,
    optimizer: str = "adamw",
    repeats: int = 5,
    warmup: int = 1,
) -> str:
    """A hex digest of everything the measurements depend on: each segment's
    name, code (source of the function, or of each module's class), module
    structure, parameter and buffer shapes and dtypes; the sample inputs'
    shapes, dtypes and devices; the optimizer, repeats, warmup and the torch
    version. Parameter *values* are not part of it."""
    segs = as_segments(segments, modules)
    desc = {
        "version": CACHE_VERSION,
        "torch": torch.__version__,
        "optimizer": optimizer,
        "repeats": repeats,
        "warmup": warmup,
        "inputs": _describe(
            sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
        ),
        "segments": [
            {
                "name": s.name,
                "fn": _source_hash(s.fn),
                "modules": [
                    {
                        "repr": repr(m),
                        "code": _source_hash(m),
                        "training": m.training,
                        "params": [
                            [n, list(p.shape), str(p.dtype), p.requires_grad]
                            for n, p in m.named_parameters()
                        ],
                        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in m.named_buffers()],
                    }
                    for m in s.modules
                ],
            }
            for s in segs
        ],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def load(path: Path) -> Optional[list[SegmentCost]]:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CACHE_VERSION:
            return None
        return [SegmentCost(**item) for item in data["segments"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing or unreadable: profile again


def store(path: Path, costs: list[SegmentCost]) -> None:
    atomic_write(
        path, json.dumps({"version": CACHE_VERSION, "segments": [asdict(c) for c in costs]})
    )
