"""This rank's part of the model: :func:`prune` replaces every submodule its
pipeline stages do not use (:mod:`annot.runtime.pipeline.layout` decides which) with
an :class:`Absent` placeholder, so ``self.h[2:4]`` still indexes the same
blocks. With a meta shadow in it, a stage that replays the earlier stages'
part of forward (:mod:`annot.runtime.runners.replay`) runs the placeholder for shapes.
A raw parameter of a kept module that another stage holds becomes a
:class:`NotHeld` meta tensor: shapes for the replay, refused where this rank's
own part of forward reads it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from annot.core.errors import PipelineError
from annot.runtime.runners.replay import replaying, running_live, shadow_call

__all__ = [
    "Absent",
    "NotHeld",
    "absent_paths",
    "covered",
    "forget_real_weights",
    "prune",
    "resolve_module",
    "shadow_modules",
]


class Absent(nn.Module):
    """Placeholder for a submodule held by another pipeline stage.

    With a ``shadow`` (the module itself, its weights left on the meta device
    and not registered: no parameters, no state-dict keys here), a stage that
    replays the earlier stages' part of forward (:mod:`annot.runtime.runners.replay`) runs
    the shadow for shapes, and attribute reads fall through to it."""

    shadow: Optional[nn.Module]  # set in __dict__: not a submodule
    shapes: dict[Any, Any]

    def __init__(self, path: str, shadow: Optional[nn.Module] = None):
        super().__init__()
        self.path = path
        self.__dict__["shadow"] = shadow  # not a submodule: its weights are not this rank's
        self.__dict__["shapes"] = {}  # annot.runtime.runners.replay.shadow_call's cache

    def forward(self, *args, **kwargs):
        if self.shadow is not None and replaying():
            # another stage's work: shapes only (meta), even where its weights are real here
            return shadow_call(self, args, kwargs)
        raise PipelineError(
            f"module {self.path!r} belongs to another pipeline stage but was called here; "
            + (
                "its weights were placed by the order the model registers its modules, which "
                "differs from the order forward calls them: pass sample=<one microbatch of the "
                "model's arguments> to annot.parallelize so annot follows the calls"
                if self.shadow is not None
                else "the stage split missed a use of it (please report this with your model)"
            )
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("shadow")
            if shadow is None:
                raise
            value = getattr(shadow, name)
            if running_live() is not None and isinstance(value, torch.Tensor) and value.is_meta:
                return NotHeld.of(value, f"{self.path}.{name}")  # its shape, never its use
            return value

    def __getitem__(self, index: Any) -> Any:
        return self.__dict__["shadow"][index]

    def __len__(self) -> int:
        return len(self.__dict__["shadow"])

    def __iter__(self):
        return iter(self.__dict__["shadow"])

    def extra_repr(self) -> str:
        return f"held by another stage: {self.path}"


def _not_held(name: str, stage: int) -> str:
    return (
        f"pipeline stage {stage} reads {name!r} directly, but this stage does not hold it: "
        "annot placed it by the order the model registers its modules, which differs from "
        "where forward reads it, and its gradient would be lost. To fix: pass sample=<one "
        "microbatch of the model's arguments> to annot.parallelize, so annot follows the "
        "calls and reads (a parameter read by several stages is then held by each, its "
        "gradient summed over them)"
    )


class NotHeld(torch.Tensor):
    """A raw parameter of a module this rank keeps, held by another stage (or
    a tensor read through an :class:`Absent` while a stage runs): a meta tensor, for shapes while the rank replays the earlier
    stages' part of forward. Read by the part this rank runs for real, it
    refuses, naming the parameter, instead of letting an op mix the meta
    tensor into real ones (``x @ meta`` answers a CPU tensor of garbage)."""

    param_path: str  # the name it has in the model

    @staticmethod
    def of(t: torch.Tensor, name: str) -> NotHeld:
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.Tensor._make_subclass(NotHeld, t.detach().to("meta"), False)
        out.param_path = name
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        stage = running_live()
        if stage is not None and getattr(func, "__name__", "") != "__get__":
            held = [t for t in tree_leaves((args, kwargs)) if isinstance(t, NotHeld)]
            raise PipelineError(_not_held(held[0].param_path if held else "?", stage))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def resolve_module(root: nn.Module, path: str) -> nn.Module:
    """The module at ``path``, looking through :class:`Absent` into its shadow."""
    obj: Any = root
    for part in path.split(".") if path else ():
        if isinstance(obj, Absent) and obj.shadow is not None:
            obj = obj.shadow
        obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
    return obj


def shadow_modules(root: nn.Module) -> list[nn.Module]:
    """The meta shadows under ``root`` (to tell their tensors from activations)."""
    return [m.shadow for m in root.modules() if isinstance(m, Absent) and m.shadow is not None]


def forget_real_weights(root: nn.Module) -> None:
    """Move every real tensor the meta shadows under ``root`` still hold to the
    meta device. A shadow keeps a weight real only when it is tied to a module
    of this rank (an embedding tied to this stage's head); once FSDP2 has
    replaced that module's parameter by its shard, the shadow's copy is a
    stale whole tensor, and shapes are all a shadow needs."""
    live = {id(p) for p in root.parameters()}  # a module both hold stays as it is
    for shadow in shadow_modules(root):
        for m in shadow.modules():
            for name, t in list(m._parameters.items()):
                if t is not None and not t.is_meta and id(t) not in live:
                    m._parameters[name] = nn.Parameter(t.detach().to("meta"), t.requires_grad)


def covered(path: str, keep: set[str]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keep)


def _ancestor(path: str, keep) -> bool:
    return any(k.startswith(path + ".") for k in keep)


def absent_paths(
    root: nn.Module, keep: set[str], through: frozenset = frozenset(), prefix: str = ""
) -> list[str]:
    """The submodules :func:`prune` replaces with :class:`Absent` (the same
    arguments), without changing anything."""
    paths = []
    for name, child in root.named_children():
        path = f"{prefix}{name}"
        if covered(path, keep):
            continue
        if _ancestor(path, keep) or _ancestor(path, through):
            paths += absent_paths(child, keep, through, path + ".")
        else:
            paths.append(path)
    return paths


def logged_modules(root: nn.Module, absent: set[str]) -> dict[str, str]:
    """The module paths whose outputs the pipeline replay logs
    (:func:`annot.runtime.runners.replay.install_output_log`), each with its key, the
    module's first path (a module reached by several paths is one module):
    every path some rank holds as a placeholder (``absent``) and, inside one
    that holds block lists (``nn.ModuleList``, ``nn.ModuleDict``), the modules
    down to the blocks (its children, the children of the modules above each
    list, the lists' elements). A placeholder whose output is not plain data (a
    ``ModelOutput``) runs its shadow on meta, where those answer from the log."""
    named = dict(root.named_modules(remove_duplicate=False))
    first: dict[int, str] = {}
    for path, m in named.items():
        first.setdefault(id(m), path)
    out = set(absent)
    for p in absent:
        lists = [
            q
            for q, m in named[p].named_modules(prefix=p, remove_duplicate=False)
            if isinstance(m, (nn.ModuleList, nn.ModuleDict))
        ]
        depth = p.count(".") + 1
        above = {".".join(q.split(".")[:k]) for q in lists for k in range(depth, q.count(".") + 2)}
        for a in above:
            out.update(f"{a}.{name}" for name, _ in named[a].named_children())
    return {path: first[id(named[path])] for path in sorted(out)}


def prune(
    root: nn.Module,
    keep: set[str],
    prefix: str = "",
    *,
    shadows: bool = False,
    through: frozenset = frozenset(),
) -> None:
    """Replace every submodule not in (or above) ``keep`` with :class:`Absent`
    (holding the module as its meta shadow when ``shadows``). Modules above a
    path in ``through`` (the boundaries this rank's stages begin or end at)
    stay too: their forwards make the calls that cross those boundaries."""
    for path in absent_paths(root, keep, through, prefix):
        parent, _, name = path[len(prefix) :].rpartition(".")
        holder = root.get_submodule(parent)
        holder._modules[name] = Absent(path, holder._modules[name] if shadows else None)
    _prune_parameters(root, keep, prefix, shadows, through)


def _prune_parameters(
    root: nn.Module, keep: set[str], prefix: str, shadows: bool, through: frozenset
) -> None:
    for name, child in root.named_children():
        path = f"{prefix}{name}"
        if not isinstance(child, Absent) and not covered(path, keep):
            _prune_parameters(child, keep, path + ".", shadows, through)
    for name in list(root._parameters):
        if not covered(f"{prefix}{name}", keep):
            p = root._parameters[name]
            if shadows and p is not None:  # a meta tensor: shapes for the replay
                del root._parameters[name]
                root.__dict__[name] = NotHeld.of(p, f"{prefix}{name}")
            else:
                root._parameters[name] = None  # a parameter of another stage's module
