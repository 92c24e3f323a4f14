"""Pre-flight: each rank's model runs once on meta tensors before it trains.

A hint that cannot work at tp > 1 shows up as a shape error deep in a rank's
traceback: a ``Col()`` / ``Row()`` pair swapped, a head count left global, a
per-head tensor built for all heads outside the sharded module (Bloom's ALiBi,
T5's relative-position bias). The pre-flight finds it first. It runs this
rank's model on the sample's shapes on the meta device (no FLOPs, and no
communication: a tp collective on a meta tensor only shapes its result) and,
when that fails where the single-device model runs, refuses the model with a
:class:`HintError` naming the module that failed and the hints around it.

It runs at the end of :func:`annot.parallelize` when a sample is known
(``sample=``, or a tiny input made from a transformers config), otherwise on
the model's first call, with that call's shapes. Every tp rank has the same
shapes, so every rank refuses alike, before any collective. In a pipeline
each rank runs its tp rank's shard of *every* stage (copied before the build
keeps its own stages), so all stages refuse alike too, and the dropout sites
are known wherever a stage runs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from annot.core.errors import AnnotError, HintError

__all__ = ["check_hooks_see_whole", "hints_near", "preflight", "user_hooks"]

log = logging.getLogger("annot")


def _failure(
    root: nn.Module, args: tuple, kwargs: dict, ctx, record=None, shapes=None
) -> Optional[tuple[str, Exception]]:
    """``(path of the innermost module running, the exception)`` when one meta
    forward of ``root(*args, **kwargs)`` fails; None when it runs. ``record``: a
    mode that forward runs under (the dropout recorder). ``shapes``: filled
    with each module's input and output shapes at its first call, by path."""
    from annot.runtime import process_groups
    from annot.runtime.runners.shape_run import shape_run

    names = {id(m): path for path, m in root.named_modules()}
    stack: list[str] = []

    def enter(mod, args) -> None:
        stack.append(names[id(mod)])

    def leave(mod, args, out) -> None:  # returns None: the output stays
        path = stack.pop()
        if shapes is not None and path not in shapes:
            shapes[path] = tree_map_only(torch.Tensor, lambda t: tuple(t.shape), (args, out))

    handles = []
    for m in root.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with process_groups.use(ctx), record if record is not None else contextlib.nullcontext():
            shape_run(lambda: root(*args, **kwargs), ())
    except AnnotError:
        raise  # annot's own refusal says what to do already
    except Exception as exc:  # noqa: BLE001 - any failure is reported below
        return (stack[-1] if stack else ""), exc
    finally:
        for h in handles:
            h.remove()
    return None


def user_hooks(model: nn.Module) -> dict[str, list[str]]:
    """The forward hooks and pre-hooks users put on ``model``'s modules other
    than the layers tp splits (those are given the whole tensors:
    :mod:`annot.runtime.tp.user_hooks`), by module path."""
    from annot.runtime.tp.user_hooks import is_annots, split_side

    found: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if split_side(m) is not None:
            continue
        kinds = [
            kind
            for kind, hooks in (("pre-hook", m._forward_pre_hooks), ("hook", m._forward_hooks))
            if any(not is_annots(h) for h in hooks.values())
        ]
        if kinds:
            found[path] = kinds
    return found


def check_hooks_see_whole(
    hooked: dict[str, list[str]], mine: dict, theirs: dict, ref: nn.Module
) -> None:
    """Refuse a user's hook on a module whose inputs or outputs are a tp shard
    here (its shapes differ from the single-device model's): an activation
    between a column- and a row-parallel layer, say. The hook was written for
    the whole tensor; annot cannot tell which dimension to gather."""
    from annot.core.errors import IntegrationError

    for path, kinds in hooked.items():
        if path in mine and path in theirs and mine[path] != theirs[path]:
            cls = type(ref.get_submodule(path)).__name__
            (args, out), (ref_args, ref_out) = mine[path], theirs[path]
            raise IntegrationError(
                f"a forward {' and '.join(kinds)} on {path or '<root>'!r} ({cls}): under tp "
                f"that module sees this rank's shard (inputs {args}, output {out}; on one "
                f"device {ref_args}, {ref_out}), and the hook was written for the whole "
                "tensors. Register it on the module around the tp region (a block's "
                "tensors are whole), or on the layer tp splits (annot gives it the whole "
                "tensors)"
            )


def _twin(model: nn.Module) -> nn.Module:
    """A meta copy of ``model`` to run: forward's side effects (a cached tensor
    attribute moved to the input's device, GPT-J's ``embed_positions``) land on
    the copy, and only annot's own hooks run (a user's hooks never see the
    pre-flight)."""
    from annot.runtime.init.deferred import meta_copy
    from annot.runtime.tp.user_hooks import is_annots

    twin = meta_copy(model)
    for m in twin.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks.items() if not is_annots(h)]:
                del hooks[key]
    return twin


@contextlib.contextmanager
def _training(model: nn.Module):
    """``model`` in training mode for a while, each module's own flag restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def hints_near(path: str, ref: nn.Module, specs: dict, paths: dict) -> list[str]:
    """The hints at the innermost module on ``path`` (itself or an ancestor)
    that has any, one line each: the specs given by path under it and the
    per-rank sizes its class names."""
    parts = path.split(".") if path else []
    for n in range(len(parts), -1, -1):
        at = ".".join(parts[:n])
        prefix = f"{at}." if at else ""
        lines = [f"{p}: {s!r}" for p, s in paths.items() if p.startswith(prefix)]
        try:
            spec = specs.get(type(ref.get_submodule(at)))
        except AttributeError:
            spec = None
        if spec is not None and spec.local:
            lines.append(f"{at or '<root>'}: Local({', '.join(map(repr, spec.local))})")
        if lines:
            return lines[:8]
    return []


def preflight(
    local: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    ref: nn.Module,
    ctx,
    specs: dict,
    paths: dict,
    whole: Optional[nn.Module] = None,
    split_forwards: tuple[str, ...] = (),
    inferred: bool = False,
) -> dict:
    """Refuse ``local`` (this rank's model) when a meta forward on ``args`` and
    ``kwargs`` fails where the single-device ``ref`` runs; see the module
    docstring. Returns the dropout sites that see a tp shard, for
    :class:`annot.runtime.tp.dropout.ShardedDropout` (both models run in
    training mode for it, so every dropout shows).

    In a pipeline ``local`` holds only this rank's stages: ``whole`` is the tp
    shard of every stage (this tp rank's, copied before the stages were cut
    out), which runs instead, so every rank checks the whole model and finds
    the same sites. ``split_forwards``: the forwards (``"LlamaModel.forward"``)
    the pipeline runs as stage methods the rewriter made (other lines), so a
    site in a module of those classes cannot be keyed: refused. ``inferred``:
    the hints were read off the sources (the refusal says so)."""
    from annot.runtime.tp.dropout import sharded_sites
    from annot.runtime.tp.reshape import ReshapeRecorder, check_head_splits, column_chunks

    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    hooked = user_hooks(whole if whole is not None else local)
    twin = _twin(whole if whole is not None else local).train()
    mine = ReshapeRecorder(twin)
    mine_shapes: Optional[dict] = {} if hooked else None
    failed = _failure(twin, args, kwargs, ctx, mine, mine_shapes)
    if failed is None and not mine.reshapes and not any(c.p for c in mine.calls) and not hooked:
        return {}  # nothing to compare: no failure, no reshape, no dropout, no hook
    theirs = ReshapeRecorder(ref)
    theirs_shapes: Optional[dict] = {} if hooked else None
    with _training(ref):
        ref_failed = _failure(ref, args, kwargs, None, theirs, theirs_shapes)
    if failed is None and ref_failed is None and hooked:
        check_hooks_see_whole(hooked, mine_shapes or {}, theirs_shapes or {}, ref)
    if failed is None:
        if ref_failed is not None:
            log.warning(
                "annot: tp pre-flight: the single-device model does not run on meta tensors "
                "(%s), so annot cannot check how forward splits tp shards into heads, and "
                "dropout inside tp regions draws per-rank masks, not the single-device ones",
                ref_failed[1],
            )
            return {}
        check_head_splits(mine.reshapes, theirs.reshapes, ctx.mesh.tp, column_chunks(twin))
        sites = sharded_sites(mine.calls, theirs.calls, ctx.mesh.tp)
        # by the bare class name, as the split names it (a class defined in another
        # class too; two classes of one name both count: refused rather than unkeyed)
        split = {f.split(".")[-2]: f for f in split_forwards}
        for path, file, line in sites:
            where = split.get(type(ref.get_submodule(path)).__name__)
            if where is not None:
                raise HintError(
                    f"tp pre-flight: dropout at {file}:{line} in {where} gets a tp shard, and "
                    "the pipeline runs that forward as stage methods, so annot cannot draw "
                    "this rank's part of the single-device mask there. Move the dropout into "
                    "a submodule (an nn.Dropout, or the block that calls it), set its p to 0, "
                    "or cut the stages at run time: parallelize(..., runner='replay')"
                )
        return sites
    where, exc = failed
    if ref_failed is not None:
        log.debug("annot: pre-flight skipped: the single-device model fails on meta too (%s)", exc)
        return {}
    tp = ctx.mesh.tp
    try:  # (the model that failed: this rank's stage may not hold the module)
        cls = type((whole if whole is not None else local).get_submodule(where)).__name__
    except AttributeError:
        cls = "?"
    near = hints_near(where, ref, specs, paths)
    shown = "\n".join(f"    {line}" for line in near) or "    (no hints there)"
    raise HintError(
        f"tp pre-flight: at tp={tp}, this rank's model fails in {where or '<root>'!r} ({cls}) "
        f"on meta tensors of the sample's shapes, where the single-device model runs:\n"
        f"    {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
        f"The hints there:\n{shown}\n"
        "Check them: a Col()/Row() pair in the wrong order, a size that each rank holds "
        "1/tp of but forward reads whole (name it in Local(...) / @shard(local=...); a size "
        "read from a config the module holds by its path: Local('config.n_head')), or a "
        "per-head tensor built for all heads outside the sharded module (shard what builds it, "
        "or slice it with Heads(...) where it enters)."
        + (
            " annot read these hints off the source (nothing was hinted): print them with "
            "`annot hints FILE:CLASS`, correct them and pass them as hints=..."
            if inferred
            else ""
        )
    ) from exc
