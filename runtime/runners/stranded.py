"""Where a pipeline boundary would strand a tensor (:mod:`annot.runtime.runners.replay`).

A stage that begins at a module's call receives the tensors that the locals
of the frames on the stack hold there (the frame walk,
:func:`annot.runtime.frames.frame_tensors`). A tensor computed before the
call and used after it that no local holds cannot cross: most often a
temporary of the expression that makes the call, as in LlamaMLP's
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, where the left operand waits
on Python's stack while ``up_proj`` runs; or a tensor kept on a module.
Tensors made from the step's inputs and factories alone (positions, masks)
do not count: every rank's replay makes those for real.

:func:`stranded` finds them in one meta forward: the tensors that ops make
from the model's weights (or from such tensors) are numbered as they are
made, and every op records which of them it uses; at each module's first
call the frame walk is taken. A call is a place a stage may begin when every
such tensor made before it and used after it is in its walk. Reading a
tensor's shape or dtype does not count as a use: the replay has those on
meta (not its device).
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from annot.runtime.frames import frame_tensors, model_line, state_ids

__all__ = ["stranded"]

# reads a meta tensor answers as the real one would
_METADATA = frozenset(
    [
        "shape",
        "dtype",
        "ndim",
        "layout",
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "element_size",
        "names",
        "__len__",
    ]
)


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.shape.__get__
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _Lifetimes(TorchFunctionMode):
    """Numbers every op; per tensor an op makes from the model's state (``state``:
    the ids of its parameters and buffers) or from such tensors: when, by which
    op and where, and its last use (op number, where)."""

    def __init__(self, state: set[int]):
        super().__init__()
        self.state = state
        self.seq = 0
        self.born: dict[int, tuple[int, str, str]] = {}
        self.last: dict[int, tuple[int, str]] = {}
        self.keep: list[torch.Tensor] = []  # alive, so ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seq += 1
        name = _name(func)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        derived = [t for t in inputs if id(t) in self.born]
        if derived and name not in _METADATA:
            where = model_line(sys._getframe(1))
            for t in derived:
                self.last[id(t)] = (self.seq, where)
        out = func(*args, **kwargs)
        if derived or any(id(t) in self.state for t in inputs):
            where = None
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in self.born:
                    where = where or model_line(sys._getframe(1))
                    self.born[id(t)] = (self.seq, name, where)
                    self.keep.append(t)
        return out


def stranded(root: nn.Module, sample: Any) -> dict[str, str]:
    """For each module path whose first call in a forward on ``sample`` (one
    meta forward, :func:`annot.runtime.runners.shape_run.shape_run`) would strand a tensor
    if a stage began there: what the tensor is, where it is made and used.
    Paths not in it are safe (or never called)."""
    from annot.runtime.runners.shape_run import shape_run

    first: dict[int, str] = {}
    for path, m in root.named_modules():
        first.setdefault(id(m), path)
    skip = state_ids(root)
    mode = _Lifetimes(skip)
    calls: list[tuple[int, str, set[int]]] = []  # (op number, path, walked ids)
    called: set[int] = set()

    def run(*args, **kwargs):
        with mode:
            return root(*args, **kwargs)

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if id(module) in called or id(module) not in first:
            return
        called.add(id(module))
        walked = frame_tensors(sys._getframe(1), run.__code__, skip)
        calls.append((mode.seq, first[id(module)], {id(t) for t in walked}))

    # first, as the replay's boundary hooks are: what other pre-hooks make comes after
    handles = [m.register_forward_pre_hook(pre_hook, prepend=True) for m in root.modules()]
    try:
        shape_run(run, sample)
    finally:
        for h in handles:
            h.remove()
    seqs = [c[0] for c in calls]
    out: dict[str, str] = {}
    for tid, (born, op, made) in mode.born.items():
        if tid in skip or tid not in mode.last:
            continue
        used, at = mode.last[tid]
        # the calls after its making and before its last use: a stage begun there needs it
        span = calls[bisect.bisect_left(seqs, born) : bisect.bisect_left(seqs, used)]
        for _, path, walked in span:
            if tid not in walked and path not in out:
                out[path] = (
                    f"the result of {op} made at {made} is used after that call, at {at}, "
                    "and no local variable holds it when the call begins (a temporary of "
                    "the expression that makes the call, or a tensor kept on a module)"
                )
    return out
