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

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only

from annot.core.errors import HintError

__all__ = ["install", "split_owners"]

log = logging.getLogger("annot")


def split_owners(found, model: nn.Module) -> dict[str, list[str]]:
    """``{class name: the paths of its modules whose forward shows a split}``
    (:attr:`annot.plan.inferred_hints.Inferred.splits`: the Col and Row Linears
    under one module, BERT's attention above its self-attention and output)."""
    named = dict(model.named_modules())
    out: dict[str, list[str]] = {}
    for path in found.splits:
        out.setdefault(type(named[path]).__qualname__, []).append(path)
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
    if got.shape != want.shape:
        return False
    rtol, atol = (1e-3, 1e-4) if want.dtype == torch.float32 else (3e-2, 3e-2)
    scale = want.abs().max().item() if want.numel() else 0.0
    return bool(torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol * max(scale, 1.0)))


def _whole_copy(mod: nn.Module, twin: nn.Module, device) -> nn.Module:
    """``twin`` (meta) made real on ``device`` with ``mod``'s gathered weights
    and its buffers (a causal mask, a rotary table: never sharded by Col/Row)."""
    from annot.runtime.tp.state_dict import full_state_dict

    full = full_state_dict(mod)  # collective over the tp group
    twin = twin.to_empty(device=device)
    twin.load_state_dict({k: v for k, v in full.items() if k in twin.state_dict()}, strict=False)
    held = dict(mod.named_buffers())
    for name, b in twin.named_buffers():
        if name in held and held[name].shape == b.shape:
            b.copy_(held[name])
    return twin


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


def _check(mod: nn.Module, twin: nn.Module, args, kwargs, ctx, name: str, path: str, found):
    from annot.runtime import process_groups

    device = next(mod.parameters()).device
    inputs = _inputs(args, kwargs)
    if inputs is None:
        found.notes.append(
            f"{path}: not checked on the first call (a positional input holds state)"
        )
        return
    with process_groups.use(ctx), torch.no_grad():
        whole = _whole_copy(mod, twin, device)
        modes = mod.training
        mod.eval()
        whole.eval()
        try:
            got = mod(*inputs[0], **inputs[1])
            a, k = _inputs(*inputs) or inputs
            want = whole(*a, **k)
        finally:
            mod.train(modes)
        g, w = _tensors(got)[:1], _tensors(want)[:1]  # the output (an attention's weights: not)
        ok = torch.tensor([0 if g and w and not _close(g[0], w[0]) else 1], device=device)
        if ctx.tp_group is not None and dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.tp_group)
    if not ok.item():
        mine = "\n  ".join(f"{k!r}: {v!r}," for k, v in found.hints.items())
        raise HintError(
            f"the tp hints annot read off the source of {name} do not compute what the "
            f"module computes: '{path}' at tp={ctx.mesh.tp} gives other outputs than the whole "
            f"module on this call's inputs. Nothing trained. Give hints= yourself (these "
            f"were inferred; review and fix them):\n  {mine}\nor tp=1"
        )
    found.checked.append(path)
    log.info("annot: inferred hints of %s checked at '%s' on the first call", name, path)


def install(built, whole: nn.Module, report) -> None:
    """Check the inferred hints (``report.inferred``) on ``built``'s first call:
    a one-shot forward pre-hook on the first module of each class they split,
    which runs it sharded and whole on a copy of its inputs before the real
    call (eagerly under ``torch.compile``). A module inside a sequence-parallel
    block sees a sequence shard, which the whole module cannot be run on alone:
    not checked, said in the notes."""
    found = report.inferred
    handles: dict[str, Any] = {}
    for name, paths in split_owners(found, whole).items():
        held = [(p, m) for p in paths for m in [_held(built.module, p)] if m is not None]
        if not held:
            continue  # other pipeline stages': checked there
        path, mod = held[0]
        if any(path == b or path.startswith(b + ".") for b in report.sequence_blocks):
            found.notes.append(f"{path}: not checked on the first call (sequence parallel)")
            continue

        @torch.compiler.disable
        def hook(m, args, kwargs, name=name, path=path, mod=mod) -> None:
            if m is not mod or any(t.is_meta for t in _tensors((args, kwargs))):
                return  # a copy, or a run for shapes (the pre-flight, a replay's shadow)
            handles.pop(path).remove()
            _check(m, whole.get_submodule(path), args, kwargs, built.ctx, name, path, found)

        handles[path] = mod.register_forward_pre_hook(hook, with_kwargs=True)
