"""``annot.save_pretrained``: the parallel model as a Hugging Face checkpoint
directory, in the single-device names, that plain transformers (and any
mesh of :func:`annot.from_pretrained`) loads.

    annot.save_pretrained(model, "out/")   # on every rank

Steps:

1. every rank arrives (a collective under annot's timeout: a call made on
   one rank alone raises :class:`~annot.core.errors.RankFailure` naming the
   call, instead of hanging);
2. the ranks tell each other what they hold (names, full shapes, dtypes,
   ties across stages); every rank makes the same plan: one name per tensor
   as transformers stores it (:func:`annot.io.hf_names.save_names`), written by
   the first pipeline stage that holds it, in files of at most
   ``max_shard_size`` bytes, each file written by one stage;
3. rank 0 makes ``<path>.tmp-<id>``; each stage streams its files: for each
   tensor its ranks gather the whole tensor (over tp, and over dp for
   FSDP2's chunks), and its first rank writes it and drops it
   (:class:`annot.io.safetensors_files.StreamWriter`): no rank holds more
   than its own part plus the tensor being written;
4. rank 0 writes the index (when there are several files), ``config.json``
   and ``generation_config.json`` (a transformers model), copies the files
   that were beside the weights the model was read from (tokenizer, chat
   template), and renames the directory into place: ``path`` is complete or
   absent. An existing ``path`` is replaced only with ``overwrite=True``.

A PEFT model (LoRA adapters on a transformers model) saves its adapters as
``PeftModel.save_pretrained`` does: ``adapter_model.safetensors`` in PEFT's
names and ``adapter_config.json``, which ``PeftModel.from_pretrained`` reads
(:mod:`annot.hf.lora`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from annot.core.errors import CheckpointError

__all__ = ["save_pretrained"]


@dataclass(frozen=True)
class Planned:
    """One stored tensor: its stored and model names, dtype, full shape, the
    pipeline rank that writes it and the file it goes to."""

    stored: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    writer: int
    file: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def save_pretrained(
    model: Any,
    path: Union[str, os.PathLike],
    *,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> str:
    """Write ``model`` (an :class:`~annot.parallel_model.ParallelModel`) to the
    directory ``path`` in the Hugging Face layout: safetensors in the
    single-device names (files past ``max_shard_size`` bytes, e.g. ``"500MB"``,
    split with a ``model.safetensors.index.json``), ``config.json`` and
    ``generation_config.json`` for a transformers model, and the files beside
    the weights of the directory :func:`annot.from_pretrained` read.

    Every rank calls it together (like :func:`annot.save`); a call on some
    ranks only fails on them after ``ANNOT_TIMEOUT_S`` with
    :class:`~annot.core.errors.RankFailure`, naming the call. ``path`` appears
    only once complete; an existing ``path`` is refused unless
    ``overwrite=True``, which replaces it. Returns the absolute path.
    """
    from annot.io.dcp_adapter import Target, exchange, from_rank0
    from annot.parallel_model import ParallelModel, unwrap

    model = unwrap(model)
    if not isinstance(model, ParallelModel):
        raise CheckpointError(
            f"save_pretrained: expected the model annot.parallelize or annot.from_pretrained "
            f"returned, got {type(model).__name__}; a plain transformers model saves itself "
            "with model.save_pretrained(path)"
        )
    final = os.path.abspath(os.fspath(path))
    what = f"save_pretrained({final!r})"
    limit = _size_bytes(max_shard_size)
    target = Target.of(model)
    _arrive(model.ctx, what)
    err = part = None
    try:
        part = _holdings(model)
    except CheckpointError as e:
        err = e
    parts = exchange(target, err, part, what)
    planned = _plan(model, parts, limit)

    def start() -> str:
        if os.path.lexists(final) and not overwrite:
            raise CheckpointError(
                f"{final}: exists; save_pretrained does not replace it unless asked: pass "
                "overwrite=True, or pick a new path"
            )
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        os.makedirs(tmp)
        return tmp

    tmp = from_rank0(target, start, what)
    err = None
    try:
        _write_own_files(model, planned, tmp)
    except (CheckpointError, OSError) as e:
        err = e if isinstance(e, CheckpointError) else CheckpointError(f"{what}: {e}")
    try:
        exchange(target, err, None, what)
    except CheckpointError:
        if target.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    from_rank0(target, lambda: _finish(model, planned, tmp, final), what)
    return final


def _size_bytes(size: Union[int, str]) -> int:
    """``5GB`` / ``500MB`` / ``10KiB`` / an int, in bytes (transformers' units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), re.IGNORECASE)
    if m is None:
        raise CheckpointError(
            f"save_pretrained: max_shard_size={size!r}; expected bytes or a size like '5GB'"
        )
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def _arrive(ctx, what: str) -> None:
    """Step 1: wait, under annot's timeout, until every rank is in the call."""
    if not ctx.distributed:
        return
    import torch.distributed as dist

    from annot.runtime.faults.comm_wait import wait_work
    from annot.runtime.faults.failures import guard

    with guard(what, comm=True) as timeout_s:
        work = dist.all_reduce(torch.ones(1, device=ctx.device), async_op=True)
        wait_work(work, timeout_s)


def _holdings(model) -> dict:
    """What this rank holds: its pipeline rank and its state dict's names,
    grouped by tensor, each group with its full shape and dtype."""
    from annot.runtime.ep.shards import expert_degree
    from annot.runtime.process_groups import use
    from annot.runtime.tp.state_dict import full_shape, shard_layouts

    with use(model.ctx):
        layouts = shard_layouts(model.module)
    groups: dict[int, list[str]] = {}
    specs: dict[int, tuple] = {}
    for name, t in model.module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        specs[id(t)] = (full_shape(t, layouts.get(id(t)), expert_degree(t)), t.dtype)
    return {
        "pp_rank": model.ctx.pp_rank,
        "groups": [(names, *specs[i]) for i, names in groups.items()],
    }


def _plan(model, parts: list[dict], limit: float) -> list[Planned]:
    """Step 2, the same on every rank: each stored tensor, its writer and file."""
    from annot.hf.lora import adapter_names, peft_base
    from annot.io.hf_names import save_names

    ties = [list(t.names) for t in getattr(model.pipeline, "ties", ())]
    merged: list[list[str]] = []
    where: dict[str, int] = {}  # name -> index in merged
    info: dict[int, tuple] = {}  # index -> (shape, dtype, first pp rank)
    for part in sorted(parts, key=lambda p: p["pp_rank"]):
        for names, shape, dtype in part["groups"]:
            tie = next((t for t in ties if set(names) & set(t)), None)
            known = next((where[n] for n in (tie or names) if n in where), None)
            if known is None:
                known = len(merged)
                merged.append([])
                info[known] = (shape, dtype, part["pp_rank"])
            for n in [*names, *(tie or [])]:
                if n not in where:
                    where[n] = known
                    merged[known].append(n)
    source = model.report.pretrained if model.report is not None else None
    if peft_base(model.module) is not None:  # a PEFT model: its adapters, as PEFT stores them
        names = adapter_names(model.module, [n for group in merged for n in group])
        limit = math.inf  # one file a stage, joined into one by rank 0 (_finish)
    else:
        names = save_names(model.module, merged, source.loaded_as if source else None)
    planned = [
        Planned(stored, name, info[where[name]][1], info[where[name]][0], info[where[name]][2])
        for name, stored in names.items()
    ]
    planned.sort(key=lambda p: p.writer)  # stable: state-dict order within a stage
    return _into_files(planned, limit)


def _into_files(planned: list[Planned], limit: float) -> list[Planned]:
    """Files of at most ``limit`` bytes (a larger tensor alone in its file),
    each written by one pipeline rank."""
    files: list[list[Planned]] = []
    size = 0
    for p in planned:
        if not files or files[-1][-1].writer != p.writer or (size + p.nbytes > limit and size):
            files.append([])
            size = 0
        files[-1].append(p)
        size += p.nbytes
    n = len(files)
    out = []
    for i, group in enumerate(files):
        file = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        out += [Planned(p.stored, p.name, p.dtype, p.shape, p.writer, file) for p in group]
    return out


def _write_own_files(model, planned: list[Planned], tmp: str) -> None:
    """Step 3: this stage's tensors, gathered whole one at a time; its first
    rank (dp 0, tp 0) writes them."""
    from annot.io.safetensors_files import StreamWriter
    from annot.runtime.ep.shards import expert_degree
    from annot.runtime.process_groups import use
    from annot.runtime.tp.state_dict import shard_layouts, whole

    ctx = model.ctx
    mine = [p for p in planned if p.writer == ctx.pp_rank]
    writes = ctx.dp_rank == 0 and ctx.tp_rank == 0
    state = model.module.state_dict(keep_vars=True)
    with use(ctx):
        layouts = shard_layouts(model.module)
        writer: Optional[StreamWriter] = None
        for p in mine:
            if writes and (writer is None or writer.path != os.path.join(tmp, p.file)):
                if writer is not None:
                    writer.close()
                specs = [(q.stored, q.dtype, q.shape) for q in mine if q.file == p.file]
                writer = StreamWriter(os.path.join(tmp, p.file), specs, {"format": "pt"})
            t = state[p.name]
            value = whole(t, layouts.get(id(t)), expert_degree(t), p.name)
            if writer is not None:
                writer.write(p.stored, value)
            del value
        if writer is not None:
            writer.close()


def _finish(model, planned: list[Planned], tmp: str, final: str) -> None:
    """Step 4 (rank 0): index, configs, the files beside the source's
    weights; then the rename into place."""
    from annot.hf.lora import peft_base, write_adapter_config
    from annot.io.dcp_publish import replace_dir, write_file
    from annot.io.hf_files import INDEX, beside_weights

    files = sorted({p.file for p in planned})
    if peft_base(model.module) is not None:  # PEFT's layout: one adapter file and its config
        _join(tmp, files, "adapter_model.safetensors")
        write_adapter_config(model.module, tmp)
        replace_dir(tmp, final)
        return
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(p.nbytes for p in planned)},
            "weight_map": {p.stored: p.file for p in planned},
        }
        write_file(os.path.join(tmp, INDEX), json.dumps(index, indent=2, sort_keys=True).encode())
    _write_configs(model.module, planned, tmp)
    source = model.report.pretrained if model.report is not None else None
    if source is not None and source.directory is not None:
        for name in beside_weights(source.directory):
            if not os.path.exists(os.path.join(tmp, name)):
                shutil.copy2(os.path.join(source.directory, name), os.path.join(tmp, name))
    replace_dir(tmp, final)


def _join(tmp: str, files: list[str], into: str) -> None:
    """The tensors of ``files`` (in ``tmp``) in one file ``into``, the others
    removed (PEFT reads one adapter file; each pipeline stage wrote its own)."""
    from safetensors.torch import load_file, save_file

    tensors: dict = {}
    for f in files:
        tensors.update(load_file(os.path.join(tmp, f)))
        os.remove(os.path.join(tmp, f))
    save_file(tensors, os.path.join(tmp, into), metadata={"format": "pt"})


def _write_configs(module, planned: list[Planned], tmp: str) -> None:
    """``config.json`` (with the saved dtype and the class as its
    architecture) and ``generation_config.json``, as transformers writes them."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    floats = [p.dtype for p in planned if p.dtype.is_floating_point]
    if floats:
        config.dtype = str(floats[0]).removeprefix("torch.")
    config.architectures = [type(module).__name__]
    config.save_pretrained(tmp)
    can_generate = getattr(module, "can_generate", None)
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(tmp)
