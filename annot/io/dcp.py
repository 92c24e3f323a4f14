"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): saved
on one mesh, loaded into any other, or into the plain single-device model.

    annot.save(model, opt, "ckpt/step_100", step=100, extra={"epoch": 3})
    info = annot.load(model, opt, "ckpt/step_100")  # any mesh; info["step"] == 100
    model_sd, opt_sd = annot.load_full("ckpt/step_100")  # no torch.distributed
    plain.load_state_dict(model_sd)
    plain_opt.load_state_dict(opt_sd)

Layout. The checkpoint is the single-device model's state dict, cut into
chunks: one DCP entry per tensor of the plain model, keyed by its plain name
(``model/h.0.attn.c_attn.weight``) with the full shape in the metadata; the
optimizer's state is keyed by parameter *name* (``optim/<name>/exp_avg``),
never by index, and shares its parameter's layout. A rank declares its tp
shard of a tensor as the chunks of the full tensor it covers (a
``Col(chunks=3)`` QKV shard is three chunks, one per q, k, v block), so each
rank writes its own bytes and nothing is gathered. Identical chunks (dp
replicas, replicated tensors on every tp rank, a tied weight held by two
pipeline stages under one canonical name) have the same DCP index and are
written once (DCP's save-plan dedup). Loading asks DCP for the chunks the new
shard covers and DCP reads the overlapping parts of whatever chunks were
saved: tp=2 -> tp=1, tp=4, pp=1 or a single process.

Memory. No full tensor is ever built on a rank. Saving copies at most one
chunk at a time (DCP's writer stages each item to CPU as it writes it).
Loading reads into fresh buffers the size of this rank's shards (model and
optimizer state: one extra copy of what the rank holds; plus one stored
chunk at a time while reading) and copies them into the live tensors only
after every rank has read and verified everything, so a failed load leaves
the model and optimizer unchanged. Verifying reads each data file a rank
needs once more, whole (its CRC-32), before DCP reads the parts it needs.
``load_full`` holds the whole model and optimizer state, as the
single-device model does.

Atomic (:mod:`annot.io.dcp_publish`): ``path`` appears only once the save is
complete; an incomplete, truncated, altered or corrupt checkpoint is refused
with :class:`~annot.core.errors.CheckpointError`. Safe (:mod:`annot.io.dcp_read`):
nothing read from a checkpoint can run code.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from annot.core.errors import CheckpointError
from annot.io.dcp_adapter import (
    LoadPlanner,
    SavePlanner,
    Target,
    all_gather,
    dcp_error,
    exchange,
    from_rank0,
    full_shape,
    param_name,
    view_of,
)
from annot.io.dcp_publish import check_replaceable, own_files, publish, seal, write_file
from annot.io.dcp_read import FORMAT, INFO, Opened, SafeReader, open_checkpoint
from annot.runtime.fsdp import copy_full_into, shard_like

__all__ = ["save", "load", "load_full"]


# --------------------------------------------------------------------------- #
# save
# --------------------------------------------------------------------------- #


def _collect(target: Target, optimizer) -> tuple[dict[str, Any], dict]:
    """This rank's DCP state dict and its part of the info file."""
    view = view_of(target)
    state: dict[str, Any] = {
        f"model/{n}": target.stored(t, view.layouts.get(n)) for n, t in view.tensors.items()
    }
    info: dict = {"order": list(view.tensors), "aliases": view.aliases, "optimizer": None}
    if optimizer is None:
        return state, info
    groups: list[dict[str, Any]] = []
    keys: dict[str, list[str]] = {}  # param name -> its state's keys
    values: dict[str, dict[str, Any]] = {}  # param name -> its non-tensor state
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            name = param_name(view, p, gi)
            names.append(name)
            st = optimizer.state.get(p, {})
            keys[name] = list(st)
            for k, v in st.items():
                if not isinstance(k, str) or "/" in k:
                    raise CheckpointError(f"optimizer state key {k!r} of {name}: expected a name")
                if isinstance(v, torch.Tensor):
                    layout = view.layouts.get(name) if v.shape == p.shape else None
                    state[f"optim/{name}/{k}"] = target.stored(v.detach(), layout)
                else:
                    values.setdefault(name, {})[k] = v
        options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({"options": options, "names": names})
    info["optimizer"] = {"groups": groups, "keys": keys, "values": values}
    return state, info


def _merge(parts: list[dict]) -> dict:
    """One info dict from every rank's part (pipeline ranks hold different
    names; ranks are in (dp, pp, tp) order, so names come in stage order)."""
    order = list(dict.fromkeys(n for p in parts for n in p["order"]))
    aliases = {k: v for p in parts for k, v in p["aliases"].items()}
    opts = [p["optimizer"] for p in parts]
    if all(o is None for o in opts):
        return {"order": order, "aliases": aliases, "optimizer": None}
    if any(o is None for o in opts) or len({len(o["groups"]) for o in opts}) != 1:
        raise CheckpointError(
            "the ranks passed different optimizers (None on some, or different numbers of "
            "param groups); build the same optimizer on every rank"
        )
    pos = {n: i for i, n in enumerate(order)}
    groups = []
    for gi, g in enumerate(opts[0]["groups"]):
        names = dict.fromkeys(n for o in opts for n in o["groups"][gi]["names"])
        groups.append({"options": g["options"], "names": sorted(names, key=pos.__getitem__)})
    optim = {
        "groups": groups,
        "keys": {k: v for o in opts for k, v in o["keys"].items()},
        "values": {k: v for o in opts for k, v in o["values"].items()},
    }
    return {"order": order, "aliases": aliases, "optimizer": optim}


def save(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    path: str | os.PathLike,
    *,
    step: Optional[int] = None,
    extra: Any = None,
) -> str:
    """Save ``model`` (and ``optimizer``, or ``None``) to the directory ``path``.

    Every rank calls it together. Each writes only its own shards, in the
    single-device layout, so :func:`load` can read it into any mesh and
    :func:`load_full` into the plain model. ``step`` and ``extra`` (plain
    data) come back from :func:`load`. An existing checkpoint at ``path`` is
    replaced; ``path`` appears only once the save is complete. Returns the
    absolute path.
    """
    target = Target.of(model)
    final = os.path.abspath(os.fspath(path))
    err = state = part = None
    try:
        state, part = _collect(target, optimizer)
    except CheckpointError as e:
        err = e
    parts = exchange(target, err, part, f"save({final!r})")
    info = {"format": FORMAT, "step": step, "extra": extra, "mesh": target.mesh}
    info.update(_merge(parts))
    buf = io.BytesIO()
    torch.save(info, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            "save: extra= (or an optimizer option) is not plain data that can be loaded without "
            f"unpickling code: {type(e).__name__}: {str(e).splitlines()[0]}. Use numbers, "
            "strings, tensors, lists, tuples and dicts"
        ) from e

    def start() -> str:
        check_replaceable(final)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        os.makedirs(tmp)
        write_file(os.path.join(tmp, INFO), buf.getvalue())
        return tmp

    tmp = from_rank0(target, start, f"save({final!r})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when run in a single process
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                planner=SavePlanner(),
                no_dist=not target.distributed,
            )
    except CheckpointException as e:
        if target.rank == 0:  # every rank is past DCP's last collective: nothing writes now
            shutil.rmtree(tmp, ignore_errors=True)
        raise dcp_error(e, f"save({final!r}) failed; nothing was published there") from None
    known = {}
    for own in all_gather(target, own_files(tmp, target.rank)):
        known.update(own)

    def seal_and_publish() -> None:
        seal(tmp, known, info)
        publish(tmp, final)

    from_rank0(target, seal_and_publish, f"save({final!r})")
    return final


# --------------------------------------------------------------------------- #
# load
# --------------------------------------------------------------------------- #


def _prepare(target: Target, optimizer, ck: Opened) -> tuple[dict, Callable[[], None], set]:
    """Fresh buffers for everything this rank loads, checked against the
    checkpoint; the function that copies them into the model and optimizer
    (run only after every rank read everything); the names this rank holds."""
    view = view_of(target)
    dest: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    for name, t in view.tensors.items():
        layout = view.layouts.get(name)
        md = ck.tensor_md(f"model/{name}")
        if md is None:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(md.size) != full_shape(t, layout):
            problems.append(
                f"{name}: the checkpoint has shape {tuple(md.size)}, the model expects "
                f"{full_shape(t, layout)}"
            )
        else:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            dest[f"model/{name}"] = target.stored(fresh, layout)
            copies.append((t, fresh))
    states: list[tuple[torch.Tensor, dict]] = []
    options: list[dict] = []
    saved = ck.info["optimizer"]
    if optimizer is not None and saved is None:
        problems.append("the checkpoint has no optimizer state (saved with optimizer=None)")
    elif optimizer is not None:
        if len(saved["groups"]) != len(optimizer.param_groups):
            problems.append(
                f"the optimizer has {len(optimizer.param_groups)} param groups, the "
                f"checkpoint's has {len(saved['groups'])}"
            )
        for gi, (group, sg) in enumerate(zip(optimizer.param_groups, saved["groups"])):
            options.append(sg["options"])
            names = set(sg["names"])
            for p in group["params"]:
                name = param_name(view, p, gi)
                if name not in names:
                    problems.append(
                        f"{name}: not in param group {gi} of the checkpoint's optimizer"
                    )
                    continue
                st, old = {}, optimizer.state.get(p, {})
                layout = view.layouts.get(name)
                for k in saved["keys"].get(name, []):
                    if k in saved["values"].get(name, {}):
                        st[k] = copy.deepcopy(saved["values"][name][k])
                        continue
                    md = ck.tensor_md(f"optim/{name}/{k}")
                    if md is None:
                        problems.append(f"optimizer state {name}/{k}: not in the checkpoint")
                        continue
                    if layout is not None and tuple(md.size) == full_shape(p, layout):
                        fresh = torch.empty(p.shape, dtype=md.properties.dtype, device=p.device)
                        dest[f"optim/{name}/{k}"] = target.stored(fresh, layout)
                    else:  # replicated (a scalar step lives on the CPU, like torch's)
                        device = old[k].device if isinstance(old.get(k), torch.Tensor) else (
                            torch.device("cpu") if len(md.size) == 0 else p.device
                        )  # fmt: skip
                        fresh = torch.empty(md.size, dtype=md.properties.dtype, device=device)
                        dest[f"optim/{name}/{k}"] = fresh
                    st[k] = fresh
                states.append((p, st))
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 8 else ""
        )
        raise CheckpointError(f"{ck.path}: does not fit this model: {shown}")

    def commit() -> None:
        with torch.no_grad():
            for t, fresh in copies:
                copy_full_into(t, fresh)  # FSDP2: this dp rank's shard
        for p, st in states:
            if st:
                optimizer.state[p] = {
                    k: shard_like(p, v) if _like_param(v, p) else v for k, v in st.items()
                }
            else:
                optimizer.state.pop(p, None)
        for group, opts in zip(optimizer.param_groups if optimizer else (), options):
            group.update(copy.deepcopy(opts))

    return dest, commit, set(view.tensors)


def _like_param(v: Any, p: torch.Tensor) -> bool:
    """An optimizer state shaped like its parameter (Adam's moments)."""
    return isinstance(v, torch.Tensor) and v.shape == p.shape


def load(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], path: str | os.PathLike
) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``, or
    ``None``), whatever mesh it was saved from. Every rank calls it together.

    Returns ``{"step": ..., "extra": ...}`` as given to :func:`save`. Raises
    :class:`CheckpointError` (on every rank) for an incomplete, corrupt,
    unsafe or mismatched checkpoint; the model and optimizer are then
    unchanged. The optimizer must hold the model's parameters in the same
    param groups as the saved one (their order within a group may differ).
    """
    target = Target.of(model)
    final = os.path.abspath(os.fspath(path))
    err: Optional[CheckpointError] = None
    ck: Optional[Opened] = None
    dest: Optional[dict] = None
    commit: Optional[Callable[[], None]] = None
    names: Optional[set] = None
    try:
        ck = open_checkpoint(final)
        dest, commit, names = _prepare(target, optimizer, ck)
    except CheckpointError as e:
        err = e
    held = set().union(*exchange(target, err, names, f"load({final!r})"))
    # exchange raised on every rank if one failed: this one opened and prepared
    assert ck is not None
    assert dest is not None
    assert commit is not None
    unexpected = [n for n in ck.info["order"] if n not in held]
    if unexpected:
        raise CheckpointError(
            f"{final}: holds tensors the model does not have: {unexpected[:8]}; it was saved "
            "from a different model or configuration"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                dest,
                storage_reader=SafeReader(ck),
                planner=LoadPlanner(),
                no_dist=not target.distributed,
            )
    except CheckpointException as e:
        raise dcp_error(
            e, f"load({final!r}) failed; the model and optimizer are unchanged"
        ) from None
    commit()
    return {"step": ck.info["step"], "extra": ck.info["extra"]}


def load_full(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    """The checkpoint at ``path`` as single-device state dicts, in one process
    (no torch.distributed needed): ``(model_state, optimizer_state)`` for the
    plain model's ``load_state_dict`` and the plain optimizer's.

    ``optimizer_state`` is ``None`` if the checkpoint has none. Its parameter
    indices follow the saved param groups, each in the model's parameter order
    (the order of an optimizer built from ``model.parameters()``, or from
    groups filtered out of ``model.named_parameters()`` in order).
    """
    final = os.path.abspath(os.fspath(path))
    ck = open_checkpoint(final)
    info = ck.info
    optim = info["optimizer"]
    wanted = [f"model/{n}" for n in info["order"]]
    if optim is not None:
        for g in optim["groups"]:
            for n in g["names"]:
                values = optim["values"].get(n, {})
                wanted += [f"optim/{n}/{k}" for k in optim["keys"].get(n, []) if k not in values]
    dest = {}
    for key in wanted:
        md = ck.tensor_md(key)
        if md is None:
            raise CheckpointError(f"{final}: {key} is listed in {INFO} but not stored")
        dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(dest, storage_reader=SafeReader(ck), planner=LoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise dcp_error(e, f"load_full({final!r}) failed") from None
    model_state = {n: dest[f"model/{n}"] for n in info["order"]}
    for alias, canon in info["aliases"].items():
        model_state[alias] = model_state[canon]
    if optim is None:
        return model_state, None
    state: dict[int, dict] = {}
    groups = []
    i = 0
    for g in optim["groups"]:
        ids = []
        for n in g["names"]:
            values = optim["values"].get(n, {})
            st = {
                k: copy.deepcopy(values[k]) if k in values else dest[f"optim/{n}/{k}"]
                for k in optim["keys"].get(n, [])
            }
            if st:
                state[i] = st
            ids.append(i)
            i += 1
        groups.append({**copy.deepcopy(g["options"]), "params": ids})
    return model_state, {"state": state, "param_groups": groups}
