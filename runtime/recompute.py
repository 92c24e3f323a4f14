"""Activation checkpointing: recompute a forward during backward instead of
keeping its activations (memory for compute, as in Megatron and torchtitan).

Two ways in:

- ``@recompute`` on a class (:mod:`annot.core.hints`):
  the build calls ``apply_recompute(model, classes)``, which
  wraps the forward of every instance of those classes;
- ``@stage(recompute=True)``: :func:`recompute_stage` wraps each pipeline
  stage's function.

Both call ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``,
which keeps the CPU and CUDA generator states of the first forward and
restores them for the recomputation, so dropout draws the same masks twice;
it also takes keyword arguments, any output structure and inputs that do not
require grad. Under ``torch.no_grad()`` the plain forward runs.

The module tree and state-dict keys do not change: the wrapper is an instance
attribute ``forward``, not a new parent module (torch's ``CheckpointWrapper``
prefixes every key with ``_checkpoint_wrapped_module.``), and it survives
``copy.deepcopy``. Inside a checkpointed module, nested checkpointed modules
are left alone: the outer recomputation already covers them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from annot.core.errors import HintError
from annot.runtime.tp.dropout import recompute_context

__all__ = [
    "apply_recompute",
    "recompute_stage",
    "remove_recompute",
]


def _run_recomputed(fn: Callable, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    # kwargs go through a partial: checkpoint() keeps some names for itself
    # (use_reentrant, context_fn, determinism_check, debug, preserve_rng_state).
    inner = functools.partial(fn, **kwargs) if kwargs else fn
    # Early stop (torch's default, forced here): the recomputation ends once it
    # has remade what backward needs. A block a pipeline boundary cuts in two
    # (annot.runtime.runners.replay) ran only its first part on this stage, and its
    # recomputation must not go on into the part another stage holds.
    with torch.utils.checkpoint.set_checkpoint_early_stop(True):
        return _torch_checkpoint(inner, *args, use_reentrant=False, context_fn=recompute_context)


class _RecomputedForward:
    """What a checkpointed module's ``forward`` attribute becomes."""

    def __init__(self, forward: Callable):
        self.__wrapped__ = forward  # the bound forward it replaces (inspect.signature follows it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_recomputed(self.__wrapped__, args, kwargs)

    def __repr__(self) -> str:
        return f"checkpointed({self.__wrapped__!r})"


def _is_recomputed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _RecomputedForward)


def apply_recompute(module: nn.Module, classes: Iterable[type]) -> int:
    """Checkpoint the forward of every submodule of ``module`` (itself included)
    whose class is one of ``classes`` (exactly, not subclasses). Returns how
    many modules were wrapped by this call; wrapping twice is a no-op.

    ``model(x)`` then keeps only each wrapped module's inputs for backward and
    recomputes its forward when backward reaches it.
    """
    classes = set(classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise HintError(
            f"apply_recompute: classes must be nn.Module subclasses, got {bad!r}; "
            "e.g. apply_recompute(model, {Block})"
        )
    if not isinstance(module, nn.Module):
        raise HintError(f"apply_recompute: expected an nn.Module, got {type(module).__name__}")
    count = 0
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        nonlocal count
        if id(m) in seen or _is_recomputed(m):
            return  # shared, or already recomputed as a whole: so are its children
        seen.add(id(m))
        if type(m) in classes:
            m.forward = _RecomputedForward(m.forward)
            count += 1
            return
        for child in m.children():
            visit(child)

    visit(module)
    return count


def remove_recompute(module: nn.Module) -> int:
    """Undo :func:`apply_recompute` on ``module`` and its
    submodules: each wrapped forward is the module's own again. Returns how
    many were unwrapped."""
    count = 0
    for m in module.modules():
        if _is_recomputed(m):
            inner = m.__dict__["forward"].__wrapped__
            if getattr(inner, "__func__", None) is type(m).forward:
                del m.forward  # the class's forward again
            else:
                m.forward = inner  # an instance's own forward, as it was
            count += 1
    return count


def recompute_stage(fn: Callable) -> Callable:
    """``fn`` (a pipeline stage's forward) that keeps only its inputs for
    backward and recomputes the rest. Arguments and results pass through
    unchanged (tensors, None, ints, tuples, dicts); keyword arguments too."""

    @functools.wraps(fn)
    def stage(*args: Any, **kwargs: Any) -> Any:
        return _run_recomputed(fn, args, kwargs)

    return stage
