"""The frame walk of the pipeline replay (:mod:`annot.runtime.replay`): the
tensors alive in a forward at a boundary.

:func:`frame_tensors` collects every tensor held by the locals of the frames
on the call stack, in a fixed order (innermost frame first, locals in
definition order, containers depth first), so the sending and the receiving
stage walk the same frames of the same program into two lists that pair up
one to one. Module state (:func:`state_ids`) is left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from annot.errors import PipelineError

__all__ = ["frame_tensors", "state_ids"]


def frame_tensors(start, stop_code, skip: set[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Every tensor held by the locals of the frames from ``start`` outwards up
    to (not including) the frame running ``stop_code``: innermost frame first,
    locals in definition order, containers depth first, each object once.
    Module state (ids in ``skip``) and modules are left out."""
    out: list[torch.Tensor] = []
    names: list[str] = []
    seen: set[int] = set()

    # Not pytree: each object once by identity, dataclass fields, a depth limit, named paths.
    def visit(value: Any, where: str, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(value, torch.Tensor):
            if id(value) in seen or id(value) in skip or isinstance(value, nn.Parameter):
                return
            seen.add(id(value))
            out.append(value)
            names.append(where)
            return
        if isinstance(value, (nn.Module, str, bytes, int, float, bool, type(None))):
            return
        if id(value) in seen:
            return
        if isinstance(value, dict):
            seen.add(id(value))
            for k, v in list(value.items()):
                visit(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for k, v in enumerate(value):
                visit(v, f"{where}[{k}]", depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            seen.add(id(value))
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name, None), f"{where}.{f.name}", depth + 1)

    frame = start
    while frame is not None and frame.f_code is not stop_code:
        where = f"{frame.f_code.co_qualname if hasattr(frame.f_code, 'co_qualname') else frame.f_code.co_name}"
        for name, value in list(frame.f_locals.items()):
            visit(value, f"{where}: {name}", 0)
        frame = frame.f_back
    if frame is None:
        raise PipelineError(
            "a pipeline boundary was reached outside the model call of the step (is the "
            "model called from another thread?)"
        )
    return out, names


def state_ids(root: nn.Module) -> set[int]:
    from annot.runtime.stage_prune import shadow_modules

    ids: set[int] = set()
    for m in [root, *shadow_modules(root)]:
        ids.update(id(t) for t in m.parameters())
        ids.update(id(t) for t in m.buffers())
    return ids
