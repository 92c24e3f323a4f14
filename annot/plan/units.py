"""A model's units for the automatic split at any depth: every block of its
block lists and, inside a block, each part with weights, plus the weighted
modules outside the blocks, in the order forward calls them (:func:`units`);
the coarser levels (:func:`coarser`: whole blocks), and what each unit
multiplies by (:attr:`Unit.work`). :mod:`annot.plan.module_units` measures and
plans them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from annot.plan.stage_points import never_called

__all__ = [
    "Unit",
    "begin_where_possible",
    "block_paths",
    "call_order",
    "coarser",
    "unit_groups",
    "units",
]


_BLOCKS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class Unit:
    """A run of module calls that a stage boundary may begin: ``path`` is the
    module whose call begins it (a block, a part of a block, a leaf);
    ``owns`` the modules whose weights it holds."""

    path: str
    params: int
    owns: tuple[str, ...] = ()
    # the parameters its forward multiplies by, a proxy for its FLOPs per token:
    # an embedding's table (looked up) counts zero, a tied weight counts in every
    # unit that multiplies by it (``params`` counts it once, for memory)
    work: int = 0
    # where its call sits: 0 outside the blocks or at a block, 1 a block's part
    # (attention | MLP), 2 a part's part (``self_attn.o_proj``)
    level: int = 0


def call_order(calls: list[tuple[str, ...]]) -> list[str]:
    """Module paths in the order forward first calls them, from
    :func:`annot.runtime.runners.stage_modules.record_calls`; every path of a shared module is
    listed at its first call."""
    return list(dict.fromkeys(p for paths in calls for p in paths))


def block_paths(model: nn.Module) -> set[str]:
    """The paths of the model's blocks: the elements of its outermost block
    lists (``nn.ModuleList`` / ``nn.Sequential`` of two or more)."""
    named = dict(model.named_modules(remove_duplicate=False))
    lists = [p for p, m in named.items() if isinstance(m, _BLOCKS) and len(m) >= 2]
    outer = [p for p in lists if not any(p.startswith(q + ".") for q in lists if q != p)]
    return {f"{p}.{c}" if p else c for p in outer for c, _ in named[p].named_children()}


def units(model: nn.Module, order: Optional[list[str]] = None, depth: int = 1) -> list[Unit]:
    """The candidate units of ``model`` in call order (``order`` from
    :func:`call_order`; default: registration order). Without ``order`` a
    block is one unit: the order its parts are registered in need not be the
    order its forward calls them (Whisper's decoder layer registers
    ``self_attn`` before the norm it calls first), and a stage that began
    at a part by registration would be refused at the first forward.

    ``depth``: how far inside a block units go. 1: its parts (attention |
    MLP); 2: also the parts of those parts that forward called in ``order``
    (``self_attn.o_proj``, ``mlp.down_proj``), where a part holds no weight of
    its own and calls its parts directly (not through a module list: experts
    called per routed token are no place for a boundary)."""
    named = dict(model.named_modules(remove_duplicate=False))
    blocks = block_paths(model)
    rank = {p: i for i, p in enumerate(order or [])}
    paths = sorted(named, key=lambda p: (rank.get(p, len(rank)), list(named).index(p)))
    counted: set[int] = set()
    worked: set[int] = set()  # modules whose work a unit counts already
    out: list[Unit] = []

    def block_of(path: str) -> str:
        """The block ``path`` is a part of: its parent, or the first ancestor
        above module lists / dicts (T5Block.layer[i], x-transformers' norms)."""
        parent = path.rpartition(".")[0]
        while parent and parent not in blocks and never_called(named[parent]):
            parent = parent.rpartition(".")[0]
        return parent

    def level(path: str) -> int:
        """0 for a block, 1 for its parts, 2 for their parts, ... (a part that
        forward never calls, only its parts, is no level of its own)."""
        n = 0
        while path not in blocks:
            n += order is None or path in rank
            path = block_of(path)
        return n

    def inside(path: str) -> bool:
        return any(path == b or path.startswith(b + ".") for b in blocks)

    def weighted(m: nn.Module) -> bool:
        return next(m.parameters(), None) is not None

    @functools.cache
    def descends(path: str) -> bool:
        """Whether the units inside ``path`` are its parts rather than itself."""
        m = named[path]
        has_parts = any(weighted(c) for c in m.children())
        if path in blocks:
            return has_parts and (order is not None or never_called(m))
        return (
            has_parts
            and order is not None
            and (level(path) < depth or path not in rank)  # (a part never called itself)
            and descends(block_of(path))
            and next(m.parameters(recurse=False), None) is None
            and not isinstance(m, _BLOCKS)
            and all(f"{path}.{n}" in rank for n, c in m.named_children() if weighted(c))
        )

    for path in paths:
        m = named[path]
        in_block = inside(path)
        if in_block:
            if descends(path):
                continue  # its parts are the units; the first one begins at it
            if path not in blocks:
                container = block_of(path)
                deep = container not in blocks and container != path.rpartition(".")[0]
                if not descends(container) or deep or not weighted(m):
                    continue  # a block taken whole, reached through a list, or no weights
        elif next(m.parameters(recurse=False), None) is None or path == "":
            continue
        if never_called(m) or (isinstance(m, _BLOCKS) and path not in blocks and not in_block):
            continue  # never called (a list, a dict), or a container outside the blocks
        n = 0
        for p in m.parameters():
            if id(p) not in counted:
                counted.add(id(p))
                n += p.numel()
        lvl = level(path) if in_block else 0
        out.append(Unit(path, n, (path,), _work(m, worked), lvl))
    # a unit that is the first part of a block (or of a part) begins at it
    fixed: list[Unit] = []
    begun: set[str] = set()
    for u in out:
        path, container = u.path, block_of(u.path)
        while container not in begun and inside(container):
            begun.add(container)
            if never_called(named[container]) or (order is not None and container not in rank):
                break  # no call of it begins anything
            path = container
            if container in blocks:
                break
            container = block_of(container)
        u = dataclasses.replace(u, path=path, level=level(path) if inside(path) else 0)
        if fixed and fixed[-1].path == u.path:  # one call begins both: one unit
            fixed[-1] = _joined(fixed[-1], u)
        else:
            fixed.append(u)
    return fixed


def coarser(found: list[Unit], level: int) -> list[Unit]:
    """``found`` with every unit deeper than ``level`` inside its block joined
    to the unit before it: the units of :func:`units` at ``depth=level``."""
    return [functools.reduce(_joined, (found[i] for i in g)) for g in unit_groups(found, level)]


def unit_groups(found: list[Unit], level: int) -> list[list[int]]:
    """The indices of ``found`` that each unit of ``coarser(found, level)`` joins."""
    out: list[list[int]] = []
    for i, u in enumerate(found):
        if out and u.level > level:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def begin_where_possible(found: list[Unit], stranded: dict[str, str]) -> list[Unit]:
    """``found`` with each unit whose call would strand a tensor joined to the
    unit before it."""
    out: list[Unit] = []
    for u in found:
        if out and u.path in stranded:
            out[-1] = _joined(out[-1], u)
        else:
            out.append(u)
    return out


def _joined(a: Unit, b: Unit) -> Unit:
    return Unit(a.path, a.params + b.params, a.owns + b.owns, a.work + b.work, a.level)


_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def _work(module: nn.Module, worked: set[int]) -> int:
    """The parameters ``module``'s forward multiplies by (see :attr:`Unit.work`),
    leaving out the modules in ``worked`` (counted by an enclosing unit), which
    it then joins."""
    seen: dict[int, int] = {}
    for m in module.modules():
        if id(m) in worked:
            continue
        worked.add(id(m))
        if not isinstance(m, _LOOKUPS):
            for p in m.parameters(recurse=False):
                seen[id(p)] = p.numel()
    return sum(seen.values())
