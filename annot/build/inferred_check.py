"""Hints read off the sources are checked on the model's first call, on its
own inputs, before anything trains on them.

For each class the inferred hints split (an attention, an MLP), the first
module of it this rank holds runs twice on a copy of the inputs that call
gives it, in eval mode and without gradients, before the call itself: as
this rank's tp shard, and whole, the single-device module rebuilt from the
shard's gathered weights. Outputs that
differ mean the reading of the source was wrong in a way shapes do not show
(heads mixed, a width reduced across the split): the call is refused on every
tp rank alike with a :class:`HintError` naming the class, the hints and the
fix, before backward. Nothing ever trains on a wrong split.

    install(built, whole, report)      # at build, before torch.compile
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only

from annot.core.errors import HintError

__all__ = ["install", "split_owners"]

log = logging.getLogger("annot")


def split_owners(found, model: nn.Module) -> dict[tuple, list[str]]:
    """The modules whose forward shows a split
    (:attr:`annot.plan.inferred_hints.Inferred.splits`: the Col and Row Linears
    under one module, BERT's attention above its self-attention and output),
    grouped by what they are: their class, and for an ``nn.Sequential`` the
    classes of its steps (every Sequential is one class)."""
    named = dict(model.named_modules())
    out: dict[tuple, list[str]] = {}
    for path in found.splits:
        m = named[path]
        steps = tuple(type(c) for c in m.children()) if isinstance(m, nn.Sequential) else ()
        out.setdefault((type(m), steps), []).append(path)
    return out


def _held(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The module at ``path`` where this rank holds it (a pipeline stage's), else None."""
    from annot.runtime.runners.placeholder import Absent

    mod: Optional[nn.Module] = root
    for part in path.split(".") if path else ():
        mod = getattr(mod, part, None)
        if not isinstance(mod, nn.Module) or isinstance(mod, Absent):
            return None
    return mod if mod is not None and next(mod.parameters(), None) is not None else None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not want.is_floating_point():
        return bool(torch.equal(got, want))
    rtol, atol = (1e-3, 1e-4) if want.dtype == torch.float32 else (3e-2, 3e-2)
    finite = want[torch.isfinite(want)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return bool(
        torch.allclose(
            got.float(), want.float(), rtol=rtol, atol=atol * max(scale, 1.0), equal_nan=True
        )
    )


def _same(got, want) -> bool:
    """Every output the two runs give alike: the first tensor always; the rest
    where their shapes agree (an attention's per-head weights are this rank's)."""
    g, w = _tensors(got), _tensors(want)
    if not g or not w or g[0].shape != w[0].shape:
        return bool(not g and not w)
    return all(_close(a, b) for a, b in zip(g, w) if a.shape == b.shape)


def _whole_copy(mod: nn.Module, twin: nn.Module, device) -> nn.Module:
    """A real copy of ``twin`` (meta) on ``device`` with ``mod``'s buffers (a
    causal mask, a rotary table: never sharded by Col / Row); its weights are
    loaded by the caller."""
    whole = copy.deepcopy(twin).to_empty(device=device)
    held = dict(mod.named_buffers())
    with torch.no_grad():
        for name, b in whole.named_buffers():
            if name in held and held[name].shape == b.shape:
                b.copy_(held[name])
    return whole


def _random_like(full: dict, names: set) -> dict:
    """Random values, the same on every rank, for the parameters among
    ``full``: a check on the weights as built could pass by accident (a
    projection initialized to zero gives zero whatever the split)."""
    g = torch.Generator().manual_seed(20261128)
    return {
        k: (torch.randn(v.shape, generator=g) * 0.1).to(v.device, v.dtype)
        for k, v in full.items()
        if k in names and v.is_floating_point()
    }


_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, slice)


def _inputs(args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """A detached copy of a call's inputs for the check, or None where that
    cannot be made. A keyword argument holding state (a KV cache: anything
    but tensors and plain values) is left out: the check's runs must not
    change what the real call sees, and on the first call a cache is empty."""
    if not all(isinstance(x, _PLAIN) for x in tree_leaves(args)):
        return None
    kw = {k: v for k, v in kwargs.items() if all(isinstance(x, _PLAIN) for x in tree_leaves(v))}
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kw))


_OK, _UNCHECKED, _WRONG = 2, 1, 0  # all-reduced with MIN: the worst rank's answer


def _compare(mod: nn.Module, twin: nn.Module, inputs, ctx, random: bool) -> tuple[int, str]:
    """Run ``mod`` (this rank's shard) and ``twin`` whole on copies of
    ``inputs``, in eval mode, the RNG and every training flag put back after."""
    from annot.runtime.tp.state_dict import full_state_dict, load_full_state_dict

    device = next(mod.parameters()).device
    flags = {m: m.training for m in mod.modules()}
    # collective over the tp group; copied (a replicated tensor comes back as itself)
    full = {k: v.detach().clone() for k, v in full_state_dict(mod).items()}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            weights = {**full, **_random_like(full, {n for n, _ in mod.named_parameters()})}
            whole = _whole_copy(mod, twin, device)
            whole.load_state_dict(
                {k: v for k, v in weights.items() if k in whole.state_dict()}, strict=False
            )
            if random:
                load_full_state_dict(mod, weights, strict=False)
            mod.eval()
            whole.eval()
            a, k = _inputs(*inputs) or inputs
            got = mod(*inputs[0], **inputs[1])
            want = whole(*a, **k)
            return (_OK if _same(got, want) else _WRONG), ""
    except Exception as exc:  # noqa: BLE001 (every tp rank answers; the caller refuses)
        return _UNCHECKED, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if random:
            load_full_state_dict(mod, full, strict=False)
        for m, flag in flags.items():
            m.training = flag


def _check(mod: nn.Module, twin: nn.Module, args, kwargs, built, name: str, path: str, found):
    from annot.runtime import process_groups

    ctx = built.ctx
    device = next(mod.parameters()).device
    inputs = _inputs(args, kwargs)
    with process_groups.use(ctx), torch.no_grad():
        if inputs is None:
            status, why = _UNCHECKED, "a positional input holds state annot cannot copy"
        else:  # (a model sharded over dp by FSDP2: checked on its weights as they are)
            status, why = _compare(mod, twin, inputs, ctx, random=built.fsdp is None)
        code = torch.tensor([status], device=device)
        if ctx.tp_group is not None and dist.is_initialized():
            dist.all_reduce(code, op=dist.ReduceOp.MIN, group=ctx.tp_group)
    mine = "\n  ".join(f"{k!r}: {v!r}," for k, v in found.hints.items())
    if code.item() == _WRONG:
        raise HintError(
            f"the tp hints annot read off the source of {name} do not compute what the "
            f"module computes: '{path}' at tp={ctx.mesh.tp} gives other outputs than the whole "
            f"module on this call's inputs. Nothing trained. Give hints= yourself (these "
            f"were inferred; review and fix them):\n  {mine}\nor tp=1"
        )
    if code.item() == _UNCHECKED:
        raise HintError(
            f"annot read tp hints off the source of {name} but cannot check them at '{path}' "
            f"on this call ({why or 'another tp rank could not'}), and does not train on "
            f"hints it has not checked. Give hints= yourself (these were inferred):\n  {mine}"
        )
    found.checked.append(path)
    log.info("annot: inferred hints of %s checked at '%s' on the first call", name, path)


def install(built, whole: nn.Module, report) -> None:
    """Check the inferred hints (``report.inferred``) on ``built``'s first call:
    a forward pre-hook on the first module of each kind they split, which runs
    it sharded and whole on a copy of its inputs before the real call (eagerly
    under ``torch.compile``). A refusal stays: every later call raises it too.
    A module inside a sequence-parallel block sees a sequence shard, which the
    whole module cannot run on alone: refused here, before any call."""
    found = report.inferred
    handles: dict[str, Any] = {}
    busy: list[str] = []  # the check running now (a module inside it waits for its own call)
    for (cls, _), paths in split_owners(found, whole).items():
        held = [(p, m) for p in paths for m in [_held(built.module, p)] if m is not None]
        if not held:
            continue  # other pipeline stages': checked there
        path, mod = held[0]
        if any(path == b or path.startswith(b + ".") for b in report.sequence_blocks):
            raise HintError(
                f"annot read tp hints off the source of {cls.__qualname__}, but '{path}' runs "
                "on sequence shards (sequence_parallel=), where they cannot be checked. Give "
                "hints= yourself (`annot hints` prints these), or sequence_parallel=False"
            )
        state: dict[str, Any] = {"error": None}

        @torch.compiler.disable
        def hook(m, args, kwargs, name=cls.__qualname__, path=path, mod=mod, state=state):
            if state["error"] is not None:
                raise state["error"]
            if m is not mod or busy or any(t.is_meta for t in _tensors((args, kwargs))):
                return  # a copy, inside a check's own run, or a run for shapes (the pre-flight)
            busy.append(path)
            try:
                _check(m, whole.get_submodule(path), args, kwargs, built, name, path, found)
            except HintError as exc:
                state["error"] = exc
                raise
            finally:
                busy.pop()
            handles.pop(path).remove()

        handles[path] = mod.register_forward_pre_hook(hook, with_kwargs=True)
