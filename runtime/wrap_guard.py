"""torch's data-parallel wrappers around an annot model: refused before a step.

``DistributedDataParallel(model)`` broadcasts rank 0's parameters over its
group and averages every gradient over it; ``fully_shard(model)`` (FSDP2)
shards every parameter over its mesh. Around an annot model whose ranks hold
different parts (tp shards, pipeline stages, annot's own FSDP2 shards) the
first overwrites each rank's shard with rank 0's and averages the gradients
of different shards, silently (or dies in its constructor where the stages
differ); the second shards shards. Training loops do this for the user (the
Hugging Face Trainer and accelerate wrap in DDP whenever the world has more
than one process), so once such a model exists:

- ``DistributedDataParallel.__init__`` is wrapped (the class, so every name
  a script bound it to): a module that is or holds a guarded model is
  refused with :class:`~annot.core.errors.IntegrationError` before DDP talks
  to any rank;
- ``fully_shard`` is a function scripts bind by name, so it is caught where
  it acts: ``fully_shard(model)`` turns the model's class into an FSDP2 one,
  which :func:`refuse_class_swap` refuses (FSDP2 has sharded the parameters
  on this rank by then, and talked to no other); ``fully_shard`` on a module
  holding the model is found by :func:`check_unwrapped` (the model's first
  forward, and the start of every step), which finds parameters FSDP2
  manages that annot did not shard and refuses before any rank computes.
  Where the stages differ, that module's own forward hook (an all-gather
  over the stages' different parameters) runs first and fails in torch.

annot does data parallelism itself, over its ``dp`` axis only:
``annot.Mesh(dp=N, ...)`` (``fsdp=True`` to shard over it), and
:class:`annot.hf.Trainer` for the Hugging Face Trainer.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch.nn as nn

from annot.core.errors import IntegrationError

__all__ = [
    "check_unwrapped",
    "guard",
    "holds_parts",
    "install",
    "last_mesh",
    "refuse_class_swap",
    "refuse_wrapper",
]

# the distributed annot models of this process
_MODELS: weakref.WeakSet = weakref.WeakSet()
_LAST: list = []  # a weak reference to the last one built

_WAY_OUT = (
    "annot averages gradients over its own dp axis only: build the model with "
    "annot.Mesh(dp=N, pp=..., tp=...) (and fsdp=True to shard it over dp) and train it "
    "unwrapped; with the Hugging Face Trainer use annot.hf.Trainer (a drop-in subclass), "
    "with accelerate annot.hf.Accelerator, with Lightning "
    "Trainer(strategy=annot.integrations.lightning.AnnotStrategy())"
)


def guard(model: Any) -> None:
    """Refuse torch's data-parallel wrappers around ``model`` from now on,
    where its ranks hold different parts."""
    _MODELS.add(model)
    _LAST[:] = [weakref.ref(model)]
    install()


def last_mesh() -> Any:
    """The mesh of the last distributed annot model built here, or None."""
    model = _LAST[0]() if _LAST else None
    return None if model is None else model.ctx.mesh


def holds_parts(model: Any) -> bool:
    """Whether ``model``'s ranks hold different parts (tp shards, pipeline
    stages, annot's FSDP2 shards), not whole replicas."""
    mesh = model.ctx.mesh
    return mesh.tp > 1 or mesh.pp > 1 or model.fsdp is not None


def install() -> None:
    """Wrap ``DistributedDataParallel.__init__``, once."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "__annot_guard__", False):
        return

    @functools.wraps(init)
    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        refuse_wrapper(module, "torch.nn.parallel.DistributedDataParallel")
        init(self, module, *args, **kwargs)

    __init__.__annot_guard__ = True  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def refuse_wrapper(module: Any, wrapper: str) -> None:
    """Raise if ``module`` is or holds a guarded annot model."""
    if not isinstance(module, nn.Module) or not _MODELS:
        return
    for path, m in module.named_modules():
        if m in _MODELS and holds_parts(m):
            where = f" (at {path!r} inside {type(module).__name__})" if path else ""
            raise IntegrationError(
                f"{wrapper} around an annot model{where} whose ranks hold different parts "
                f"({_parts(m)}): it would broadcast rank 0's parameters over the others and "
                f"average the gradients of different shards. {_WAY_OUT}"
            )


def refuse_class_swap(model: Any, cls: type) -> None:
    """Raise if ``cls`` (the class ``model`` is being given) is FSDP2's."""
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule) and model in _MODELS and holds_parts(model):
        raise IntegrationError(_fully_shard_refusal(model))


def check_unwrapped(model: Any) -> None:
    """Raise if FSDP2 manages ``model``'s parameters and annot did not put them
    there (``fully_shard`` called by the user on the model or on a module
    holding it)."""
    if model not in _MODELS or not holds_parts(model):
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    foreign = isinstance(model, FSDPModule)
    if not foreign and model.fsdp is None:
        # fully_shard on a module holding the model makes every parameter a DTensor
        foreign = isinstance(next(model.module.parameters(), None), DTensor)
    if foreign:
        raise IntegrationError(_fully_shard_refusal(model))


def _fully_shard_refusal(model: Any) -> str:
    return (
        f"fully_shard was called on an annot model (or a module holding it) whose ranks "
        f"hold different parts ({_parts(model)}): FSDP2 would shard those parts over ranks "
        f"that do not hold them. {_WAY_OUT}"
    )


def _parts(model: Any) -> str:
    mesh = model.ctx.mesh
    held = []
    if mesh.tp > 1:
        held.append(f"tp={mesh.tp} shards")
    if mesh.pp > 1:
        held.append(f"pp={mesh.pp} pipeline stages")
    if model.fsdp is not None:
        held.append(f"annot's FSDP2 shards over dp={mesh.dp}")
    return f"{mesh!r}: " + ", ".join(held)
