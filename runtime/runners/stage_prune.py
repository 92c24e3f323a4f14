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

import torch.nn as nn

from annot.runtime.runners.placeholder import Absent, NotHeld, shadow_modules

__all__ = ["absent_paths", "covered", "forget_real_weights", "prune"]


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
    (:func:`annot.runtime.runners.placeholder.install_output_log`), each with its key, the
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
