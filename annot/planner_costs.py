"""The planner's step 3: what each segment costs.

:func:`segment_costs` counts the parameter, gradient and optimizer-state
bytes from the segments' modules (a parameter several segments use becomes a
shared group, charged once per stage that holds it; ``tp`` divides the
figures of ``@shard``-ed layers) and takes time, FLOPs, activation and sent
bytes from the measurement. :func:`profile` measures them:
:func:`annot.runtime.cost.profile_segments` over several rounds, each segment
keeping its median round, cached on disk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import torch.nn as nn

from annot.core.files import atomic_write
from annot.runtime.memory_model import OPTIMIZER_STATES

__all__ = ["STATES", "median_round", "profile", "segment_costs", "sharded_ids"]

STATES = OPTIMIZER_STATES  # optimizer states per element


def sharded_ids(model: nn.Module, paths: Optional[dict] = None) -> set[int]:
    """ids of the parameters a ``@shard`` spec, or a hint in ``paths`` (module
    or parameter path -> spec, e.g. from a transformers tp plan), splits
    (approximately: a Row layer's bias and Replicate entries stay whole)."""
    from annot.core.hints import get_shard_spec
    from annot.core.specs import Replicate, Row

    out: set[int] = set()

    def add(target: Any, s: Any) -> None:
        if isinstance(s, Replicate):
            return
        if isinstance(target, nn.Parameter):
            out.add(id(target))
        elif isinstance(target, nn.Module):
            for pname, p in target.named_parameters(recurse=False):
                if not (isinstance(s, Row) and pname == "bias"):
                    out.add(id(p))

    for m in model.modules():
        spec = get_shard_spec(type(m))
        for name, s in spec.specs.items() if spec is not None else ():
            add(getattr(m, name, None), s)
    if paths:
        named = {**dict(model.named_modules()), **dict(model.named_parameters())}
        for path, s in paths.items():
            add(named.get(path), s)
    return out


def segment_costs(
    model: nn.Module,
    names: Sequence[str],
    modules: Sequence[Sequence[nn.Module]],
    measured: Optional[Sequence[Any]],
    *,
    optimizer: str,
    cost: str,
    tp: int,
    sharded: Optional[set[int]] = None,
    setup: Any = None,
    dp: int = 1,
    pp: int = 1,
):
    """One SegmentCost per segment: parameter-side bytes counted here (shared
    parameters keyed by their name in the model), the rest from ``measured``.
    ``sharded``: the ids of the parameters tp splits (default: the ``@shard``
    hints', :func:`sharded_ids`). The bytes per parameter element are
    :func:`annot.runtime.memory_model.param_bytes`'s for ``setup`` (an
    :class:`annot.runtime.memory_model.Training`; default: ``optimizer`` in
    float32); ``optimizer`` counts the master copy with the optimizer state."""
    from annot.runtime.cost_segments import SegmentCost
    from annot.runtime.memory_model import Training, param_bytes

    if setup is None:
        setup = Training(optimizer=optimizer)

    qual = {id(p): n for n, p in model.named_parameters()}
    if tp == 1:
        sharded = set()
    elif sharded is None:
        sharded = sharded_ids(model)
    owned: list[dict[int, nn.Parameter]] = []
    for mods in modules:
        ps: dict[int, nn.Parameter] = {}
        for m in mods:
            for p in m.parameters():
                ps.setdefault(id(p), p)
        owned.append(ps)
    users: dict[int, int] = {}
    for ps in owned:
        for pid in ps:
            users[pid] = users.get(pid, 0) + 1
    out = []
    for j, ps in enumerate(owned):
        p_bytes = g_bytes = s_bytes = n_params = n_sharded = 0
        shared: dict[str, int] = {}
        shared_numel: dict[str, int] = {}
        for pid, p in ps.items():
            div = tp if pid in sharded else 1
            numel = math.ceil(p.numel() / div)
            held = param_bytes(numel, 1, p.requires_grad, setup, dp, pp)
            pb, gb, sb = held.weights, held.grads, held.master + held.optimizer
            p_bytes, g_bytes, s_bytes = p_bytes + pb, g_bytes + gb, s_bytes + sb
            n_params += numel
            n_sharded += p.numel() if div > 1 else 0
            if users[pid] > 1:
                key = qual.get(pid, f"{names[j]}:{pid}")
                shared[key] = pb + gb + sb
                shared_numel[key] = numel
        total = sum(p.numel() for p in ps.values())
        # the FLOPs of the sharded layers shrink by tp: approximated by their share of parameters
        scale = 1.0 - (n_sharded / total) * (1 - 1 / tp) if total and tp > 1 else 1.0
        buffers = {id(b): b.numel() * b.element_size() for m in modules[j] for b in m.buffers()}
        meas = measured[j] if measured is not None else None
        c = SegmentCost(
            name=names[j],
            params=p_bytes,
            n_params=n_params,
            grads=g_bytes,
            optimizer=s_bytes,
            buffers=sum(buffers.values()),
            activations=meas.activations if meas else 0,
            flops=int(meas.flops * scale) if meas else 0,
            forward_flops=int(meas.forward_flops * scale) if meas else 0,
            time=meas.time if meas else 0.0,
            output_bytes=meas.output_bytes if meas else 0,
            shared=shared,
            shared_numel=shared_numel,
        )
        value = {"time": c.time, "flops": float(c.flops), "params": float(c.params)}[cost]
        out.append(replace(c, cost=value))
    return out


def median_round(column: Sequence[Any]) -> Any:
    """A segment's measurement from the round of median time: the statistic
    both unit sources time by (:mod:`annot.module_units` keeps the median of its
    steps too), robust to a load spike in a round either way."""
    return sorted(column, key=lambda c: c.time)[(len(column) - 1) // 2]


def profile(segs, inputs, optimizer, progress, cache_dir, repeats: int, rounds: int) -> list:
    """annot.runtime.cost.profile_segments, ``rounds`` times over all the segments;
    each segment keeps its median round (:func:`median_round`; a round times
    the median of ``repeats`` runs). A burst of load elsewhere on the machine
    slows a few consecutive segments of one round; across rounds it lands on
    different ones. Cached as JSON
    in ``cache_dir`` under annot.runtime.cost_cache.cache_key (plus the round
    count)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from annot.runtime.cost import profile_segments
    from annot.runtime.cost_cache import cache_key
    from annot.runtime.cost_segments import SegmentCost

    path = None
    if cache_dir is not None:
        key = cache_key(segs, inputs, optimizer=optimizer, repeats=repeats)
        path = Path(cache_dir) / f"{key}-r{rounds}-median.json"
        try:
            data = json.loads(path.read_text())
            hit = [SegmentCost(**item) for item in data]
            if len(hit) == len(segs):
                return hit
        except (OSError, ValueError, TypeError):
            pass  # missing or unreadable: profile again
    runs = [
        profile_segments(segs, inputs, optimizer=optimizer, progress=progress, repeats=repeats)
        for _ in range(rounds)
    ]
    out = [median_round(column) for column in zip(*runs)]
    if path is not None:
        atomic_write(path, json.dumps([asdict(c) for c in out]))
    return out
