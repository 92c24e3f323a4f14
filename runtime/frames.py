"""The frame walk of the pipeline replay (:mod:`annot.runtime.runners.replay`): the
tensors alive in a forward at a boundary.

:func:`frame_tensors` collects every tensor held by the locals of the frames
on the call stack, in a fixed order (innermost frame first, locals in
definition order, containers depth first), so the sending and the receiving
stage walk the same frames of the same program into two lists that pair up
one to one. Module state (:func:`state_ids`) is left out.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any

import torch
import torch.nn as nn

from annot.core.errors import PipelineError

__all__ = ["LIBRARY_DIRS", "frame_tensors", "model_line", "named_frame_tensors", "state_ids"]


# Frames in these folders are not the model's code: torch, annot.runtime, annot.
_ANNOT_INIT = sys.modules["annot"].__file__
assert _ANNOT_INIT is not None, "annot is a regular package"
LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # annot.runtime
    os.path.dirname(os.path.abspath(_ANNOT_INIT)) + os.sep,
)


def model_line(frame) -> str:
    """``file:line`` of the innermost frame from ``frame`` outwards that is the
    model's code (not in :data:`LIBRARY_DIRS`)."""
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARY_DIRS):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


# Values that hold no tensor, told apart by exact type before anything else
# (most of what the frames of a transformers forward hold: flags, None,
# config strings, bound methods).
_LEAVES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        str,
        bytes,
        torch.dtype,
        torch.device,
        torch.Size,
        types.FunctionType,
        types.MethodType,
        types.BuiltinFunctionType,
    }
)


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)  # (co_qualname: Python 3.11+)


def frame_tensors(start, stop_code, skip: set[int]) -> list[torch.Tensor]:
    """Every tensor held by the locals of the frames from ``start`` outwards up
    to (not including) the frame running ``stop_code``: innermost frame first,
    locals in definition order, containers depth first, each object once.
    Module state (ids in ``skip``) and modules are left out."""
    return _walk(start, stop_code, skip, named=False)


def named_frame_tensors(start, stop_code, skip: set[int]) -> tuple[list[torch.Tensor], list[str]]:
    """:func:`frame_tensors` with each tensor's frame, variable and place in its
    containers (``LlamaModel.forward: position_embeddings[0]``), for messages."""
    return _walk(start, stop_code, skip, named=True)


def _walk(start, stop_code, skip: set[int], *, named: bool):
    out: list[torch.Tensor] = []
    names: list[str] = []
    seen: set[int] = set()

    # Not pytree: each object once by identity, dataclass fields, a depth limit, named paths.
    def visit(value: Any, where: Any, depth: int) -> None:
        if type(value) in _LEAVES or depth > 8:
            return
        if isinstance(value, torch.Tensor):
            if id(value) in seen or id(value) in skip or isinstance(value, nn.Parameter):
                return
            seen.add(id(value))
            out.append(value)
            if named:
                names.append(where())
            return
        if id(value) in seen:
            return
        if isinstance(value, dict):
            seen.add(id(value))
            for k, v in list(value.items()):
                if type(v) not in _LEAVES:  # (most are: skip the call)
                    visit(v, named and (lambda w=where, k=k: f"{w()}[{k!r}]"), depth + 1)
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for k, v in enumerate(value):
                if type(v) not in _LEAVES:
                    visit(v, named and (lambda w=where, k=k: f"{w()}[{k}]"), depth + 1)
        elif isinstance(value, nn.Module):
            return
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            seen.add(id(value))
            for f in dataclasses.fields(value):
                v = getattr(value, f.name, None)
                visit(v, named and (lambda w=where, n=f.name: f"{w()}.{n}"), depth + 1)

    frame = start
    while frame is not None and frame.f_code is not stop_code:
        code = frame.f_code
        for name, value in list(frame.f_locals.items()):
            if type(value) not in _LEAVES:
                visit(value, named and (lambda c=code, n=name: f"{_qualname(c)}: {n}"), 0)
        frame = frame.f_back
    if frame is None:
        raise PipelineError(
            "a pipeline boundary was reached outside the model call of the step (is the "
            "model called from another thread?)"
        )
    return (out, names) if named else out


def state_ids(root: nn.Module) -> set[int]:
    """The ids of ``root``'s parameters and buffers, and of those of the meta
    shadows its placeholders hold outside the module tree (a
    :class:`~annot.runtime.runners.placeholder.Absent` keeps its ``shadow`` in
    ``__dict__``: an attribute ``nn.Module`` never puts a submodule there)."""
    shadows = [m.__dict__.get("shadow") for m in root.modules()]
    ids: set[int] = set()
    for m in [root, *(s for s in shadows if isinstance(s, nn.Module))]:
        ids.update(id(t) for t in m.parameters())
        ids.update(id(t) for t in m.buffers())
    return ids
