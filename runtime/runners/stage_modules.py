"""Which modules each pipeline stage owns: the module calls a stage's range of
the forward makes (recorded on the meta device, or read off the stage split),
widened to every path that names the same module (aliases, slices of a
``ModuleList``), for :mod:`annot.runtime.pipeline.layout` and the runners."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch.nn as nn
from torch.overrides import TorchFunctionMode

from annot.runtime.runners.stage_prune import covered

__all__ = [
    "call_order_stage_modules",
    "expand_module_paths",
    "record_calls",
    "stage_calls",
    "with_aliases",
]

_SLICE = re.compile(r"^(?P<path>[\w.]+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


def call_order_stage_modules(
    root: nn.Module, boundaries: tuple[str, ...], calls: Optional[dict[int, set[str]]] = None
) -> dict[int, set[str]]:
    """Which module paths each stage of a replayed pipeline holds.

    ``calls``: the module paths each stage calls (:func:`stage_calls` of one
    meta forward). Modules it saw called go to every stage that called
    them (a module called by two stages is tied across them); the rest go by
    the order the model registers them: stage ``k`` from boundary ``k`` up to
    boundary ``k + 1``. Modules without parameters (activations, rotary
    tables) go with the stages that call them (so a block of another stage is
    one meta shadow, not a shell around its activation); where the probe did
    not see them called, with the stage of their position if they sit inside a
    module no boundary cuts (a block's activation), else on every stage (a
    rotary table the root's forward calls).

    A container's own parameters (``cls_token``, ``logit_scale``: raw
    parameters its forward reads directly, between the calls of its children)
    go, each, to the stages that read it in the probe (several: shared like a
    tied weight). Without a probe, or where it saw no read, one of a container
    that a boundary cuts (the root, a tower split in two) could be read on any
    of the stages its forward spans: it is held by every stage, its gradient
    summed over them; one of a container no boundary cuts goes with the stage
    of its position."""
    named = dict(root.named_modules(remove_duplicate=False))
    calls = calls or {}  # no probe: no module seen called
    called = set().union(*calls.values())
    n = len(boundaries) + 1
    out: dict[int, set[str]] = {s: set() for s in range(n)}
    stage = 0

    def in_one_stage(path: str) -> bool:
        """Whether a proper ancestor of ``path`` (not the root) holds no boundary below it."""
        parts = path.split(".")
        return any(
            not any(b.startswith(a + ".") for b in boundaries)
            for a in (".".join(parts[:i]) for i in range(1, len(parts)))
        )

    for path, m in named.items():
        while stage + 1 < n and (
            path == boundaries[stage] or path.startswith(boundaries[stage] + ".")
        ):
            stage += 1
        own = [k for k, p in m._parameters.items() if p is not None]
        callers = [s for s in out if path in calls[s]] if path in called else []
        if path and next(m.parameters(), None) is None:  # stateless or buffers only
            # with its callers where the probe saw it called (elsewhere the replay
            # runs it inside another stage's meta shadow)
            for s in callers or ([stage] if in_one_stage(path) else out):
                out[s].add(path)
        elif own and any(True for _ in m.children()):  # a container's raw parameters
            spans = not path or any(b.startswith(path + ".") for b in boundaries)
            for k in own:
                name = f"{path}.{k}" if path else k
                readers = [s for s in out if name in calls[s]] if name in called else []
                for s in readers or (list(out) if spans else [stage]):
                    out[s].add(name)
        elif own:
            for s in callers or [stage]:
                if path:
                    out[s].add(path)
    return out


def record_calls(root: nn.Module, sample: Any) -> list[tuple[str, ...]]:
    """Every module call of one forward of ``root`` on ``sample``, in order,
    each as the paths of the module called (a shared module has several): one
    meta forward (:func:`annot.runtime.runners.shape_run.shape_run`, no FLOPs). A module
    whose parameter another module's forward reads directly
    (``self.rel_embeddings.weight``, never called) counts as called there; a
    container's own parameter read directly (``self.logit_scale``) is listed
    by its own paths where it is read."""
    from annot.runtime.runners.shape_run import shape_run

    paths: dict[int, tuple[str, ...]] = {}
    for path, m in root.named_modules(remove_duplicate=False):
        paths[id(m)] = (*paths.get(id(m), ()), path)
    owner: dict[int, tuple[str, ...]] = {}
    for m in root.modules():
        container = any(True for _ in m.children())
        for k, p in m.named_parameters(recurse=False):
            here = (
                tuple(f"{q}.{k}" if q else k for q in paths[id(m)]) if container else paths[id(m)]
            )
            owner[id(p)] = here
    calls: list[tuple[str, ...]] = []
    handles = [
        m.register_forward_pre_hook(lambda module, args: calls.append(paths[id(module)]))
        for m in root.modules()
    ]
    try:
        with _ParameterReads(owner, calls):
            shape_run(root, sample)
    finally:
        for h in handles:
            h.remove()
    return calls


class _ParameterReads(TorchFunctionMode):
    """For :func:`record_calls`: an op on a parameter appends its module's paths
    to ``calls`` (once per run of reads: its own forward's ops add nothing new)."""

    def __init__(self, owner: dict[int, tuple[str, ...]], calls: list):
        super().__init__()
        self.owner = owner
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            paths = self.owner.get(id(a)) if isinstance(a, nn.Parameter) else None
            if paths is not None and (not self.calls or self.calls[-1] != paths):
                self.calls.append(paths)
        return func(*args, **kwargs)


def stage_calls(calls: list[tuple[str, ...]], boundaries: tuple[str, ...]) -> dict[int, set[str]]:
    """The module paths each stage calls, from :func:`record_calls`: stage ``k``
    begins at the first call of boundary ``k``."""
    out: dict[int, set[str]] = {s: set() for s in range(len(boundaries) + 1)}
    stage = 0
    for paths in calls:
        if stage < len(boundaries) and boundaries[stage] in paths:
            stage += 1
        out[stage].update(paths)
    return out


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = (
            obj[int(part)]
            if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential))
            else getattr(obj, part)
        )
    return obj


def expand_module_paths(root: nn.Module, uses: tuple[str, ...]) -> set[str]:
    """Module paths (``h.2``) for the uses the rewriter reported (``h[2:4]``,
    ``lm_head``, ``config``): each use is the longest prefix of its path that
    names a module, a parameter or a buffer (``scale.exp`` reads the raw
    parameter ``scale``); other attributes are dropped. ``model/layers[1:3]``
    (a nested split's) reads ``layers[1:3]`` of the submodule ``model``."""
    out: set[str] = set()
    for use in uses:
        under, slash, inner = use.partition("/")
        if slash:  # a nested split's use, relative to the submodule ``under``
            out.update(f"{under}.{p}" for p in expand_module_paths(_get(root, under), (inner,)))
            continue
        m = _SLICE.match(use)
        if m:
            seq = _get(root, m["path"])
            n = len(seq)
            start = int(m["start"]) if m["start"] else 0
            stop = int(m["stop"]) if m["stop"] else n
            for i in range(*slice(start, stop).indices(n)):
                out.add(f"{m['path']}.{i}")
            continue
        found = _state_prefix(root, use)
        if found is not None:
            out.add(found)
    return out


def with_aliases(root: nn.Module, stages: dict[int, set[str]]) -> dict[int, set[str]]:
    """Each stage's paths plus every other name of what it holds: a module
    registered under two paths is held under both; a module no stage holds
    whose parameters are all tied to held ones (T5's ``shared``, the weight of
    ``encoder.embed_tokens``; forward never calls it) goes with the stages
    holding them. So pruning drops no name of a tensor a stage uses."""
    named = list(root.named_modules(remove_duplicate=False))
    paths: dict[int, list[str]] = {}
    for path, m in named:
        paths.setdefault(id(m), []).append(path)
    out = {}
    cover = {}  # the same coverage in prefix form: keep and the aliases outside it
    for k, keep in stages.items():
        out[k], cover[k] = set(keep), set(keep)
        for path, m in named:
            if path and covered(path, keep):
                out[k].update(paths[id(m)])
                cover[k].update(p for p in paths[id(m)] if not covered(p, keep))
    anywhere = set().union(*cover.values())
    orphans = [
        (path, own)
        for path, m in named
        if path
        and (own := [p for p in m._parameters.values() if p is not None])
        and not any(m.children())
        and not covered(path, anywhere)
    ]
    if orphans:
        params = list(root.named_parameters(remove_duplicate=False))
        for k in out:
            held = {id(p) for name, p in params if covered(name, cover[k])}
            for path, own in orphans:
                if all(id(p) in held for p in own):
                    out[k].add(path)
    return out


def _state_prefix(root: nn.Module, use: str) -> Optional[str]:
    """The longest prefix of ``use`` that names a module, parameter or buffer."""
    obj: Any = root
    found = None
    parts = use.split(".")
    for i, part in enumerate(parts):
        if isinstance(obj, (nn.ModuleList, nn.Sequential)) and part.isdigit():
            obj = obj[int(part)] if int(part) < len(obj) else None
        elif isinstance(obj, nn.Module):
            obj = obj._modules.get(part, obj._parameters.get(part, obj._buffers.get(part)))
        else:
            obj = None
        if obj is None:
            break
        found = ".".join(parts[: i + 1])
    return found
