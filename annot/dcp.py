"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): saved
on one mesh, loaded into any other, or into the plain single-device model.

    annot.save(model, opt, "ckpt/step_100", step=100, extra={"epoch": 3})
    info = annot.load(model, opt, "ckpt/step_100")  # any mesh; info["step"] == 100
    model_sd, opt_sd = annot.checkpoint.load_full("ckpt/step_100")  # no torch.distributed
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

Atomic. Rank 0 creates ``<path>.tmp-<id>`` and writes ``annot-info.pt``
(step, extra, names, optimizer groups) there; every rank writes its chunks
into it through ``dcp.save``; after DCP's last collective each rank records
its own files' sizes and CRC-32s, and rank 0 writes the completion marker
``annot-complete.json`` last, then renames the directory to ``path`` (an
older checkpoint there is moved aside first, removed after). A crash before
that leaves no new ``path``; a directory without the marker, with a
truncated or altered file, or with corrupt metadata is refused with
:class:`~annot.errors.CheckpointError`. ``path`` must be on a file system
every rank sees (as DCP's ``FileSystemWriter`` assumes).

Safe. DCP pickles its ``.metadata``; it is read here with an unpickler that
only builds DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths,
and refuses anything else (nothing in it can run code). Data files are read
by DCP with ``torch.load(weights_only=True)``; pickled byte entries are
refused; ``annot-info.pt`` is read with ``weights_only=True`` (so ``extra``
must be plain data: numbers, strings, tensors, lists, tuples, dicts).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import shutil
import uuid
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from annot.errors import CheckpointError

__all__ = ["save", "load", "load_full"]

FORMAT = "annot.checkpoint/1"
MARKER = "annot-complete.json"  # written last: its presence means complete
INFO = "annot-info.pt"
METADATA = ".metadata"  # DCP's

Layout = tuple[int, int, int]  # (dim, chunks, tp), as in annot.runtime.state_dict


# --------------------------------------------------------------------------- #
# A tp shard as DCP chunks of the full tensor.
# --------------------------------------------------------------------------- #


class _Shard:
    """This rank's shard ``local`` of a tensor of full shape ``full``: the full
    tensor cut along ``dim`` into ``chunks`` equal blocks, of each of which
    this rank holds the ``rank``-th of ``tp`` slices (the layout of
    ``annot.runtime.tp_comm.split_local``). Speaks DCP's chunk protocol."""

    def __init__(self, local: torch.Tensor, layout: Layout, rank: int):
        dim, chunks, tp = layout
        dim %= local.dim()
        full = list(local.shape)
        full[dim] *= tp
        self.full = torch.Size(full)
        n = local.shape[dim] // chunks  # this rank's length in each block
        block = self.full[dim] // chunks
        self.pieces: dict[torch.Size, torch.Tensor] = {}
        for c in range(chunks):
            offsets = [0] * local.dim()
            offsets[dim] = c * block + rank * n
            self.pieces[torch.Size(offsets)] = local.narrow(dim, c * n, n)
        self.properties = TensorProperties.create_from_tensor(local)

    def size(self) -> torch.Size:
        return self.full

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=p.size()) for o, p in self.pieces.items()]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=p.size()),
                    properties=self.properties,
                    size=self.full,
                ),
            )
            for o, p in self.pieces.items()
        ]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        try:
            return self.pieces[torch.Size(index.offset)]
        except (KeyError, TypeError):
            raise CheckpointError(f"{index.fqn}: no local chunk at offset {index.offset}") from None


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.piece(index) if isinstance(obj, _Shard) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner's _init_state_dict would replace values it does not
        # know (our _Shard) with None; our buffers are allocated already.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.piece(index) if isinstance(obj, _Shard) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        # DCP would torch.load(weights_only=False) these: code could run.
        raise CheckpointError(
            f"{read_item.dest_index.fqn}: stored as pickled bytes; annot checkpoints hold "
            "only tensors and never unpickle data"
        )


# --------------------------------------------------------------------------- #
# Reading a checkpoint safely.
# --------------------------------------------------------------------------- #

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    _DCP_MD: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's ``Metadata`` and nothing else: ``find_class`` allows only
    the classes a real ``.metadata`` file names (found by logging them)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.where}: refusing to unpickle {module}.{name}: DCP metadata never holds it, so "
            "the file was crafted or damaged; nothing from it was run. Load only checkpoints "
            "written by annot.checkpoint.save"
        )


def _read_metadata(file: str) -> Metadata:
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means corrupt
        raise CheckpointError(f"{file}: corrupt DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{file}: not DCP metadata (a {type(md).__name__})")
    return md


def _crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


@dataclass
class _Opened:
    """A checkpoint whose marker, sizes, metadata and info have been checked."""

    path: str
    files: dict[str, dict]  # name -> {"size": int, "crc32": int}
    metadata: Metadata
    info: dict
    verified: set = field(default_factory=set)

    def verify(self, name: str) -> None:
        """Check one file's CRC-32 against the marker (once per file)."""
        if name in self.verified:
            return
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: {name} is not listed in {MARKER}")
        crc = _crc32(os.path.join(self.path, name))
        if crc != entry["crc32"]:
            raise CheckpointError(
                f"{os.path.join(self.path, name)}: corrupt: CRC-32 {crc:#010x}, the marker "
                f"recorded {entry['crc32']:#010x}; the file changed after the save"
            )
        self.verified.add(name)

    def tensor_md(self, key: str) -> Optional[TensorStorageMetadata]:
        md = self.metadata.state_dict_metadata.get(key)
        return md if isinstance(md, TensorStorageMetadata) else None


def _plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _open(path: str) -> _Opened:
    """Check ``path`` is a complete, intact annot checkpoint; read its metadata
    (safely) and info. Raises :class:`CheckpointError` otherwise."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no checkpoint there (not a directory)")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{path}: incomplete checkpoint: no completion marker {MARKER} (the save did not "
            "finish, or this is not an annot checkpoint); load an earlier checkpoint"
        )
    try:
        with open(marker, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        ok = manifest.get("format") == FORMAT and isinstance(files, dict)
        ok = ok and all(
            _plain_name(n)
            and isinstance(e, dict)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("crc32"), int)
            for n, e in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{marker}: corrupt completion marker ({e})") from e
    if not ok:
        raise CheckpointError(f"{marker}: not an {FORMAT} completion marker")
    for name, entry in files.items():
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None:
            raise CheckpointError(f"{file}: missing (listed in {MARKER})")
        if size != entry["size"]:
            raise CheckpointError(
                f"{file}: truncated or altered: {size} bytes, the save wrote {entry['size']}"
            )
    for name in (METADATA, INFO):
        if name not in files:
            raise CheckpointError(f"{marker}: does not list {name}")
    opened = _Opened(path, files, None, {})  # type: ignore[arg-type]
    opened.verify(METADATA)
    opened.verify(INFO)
    opened.metadata = _read_metadata(os.path.join(path, METADATA))
    _check_metadata(opened)
    opened.info = _read_info(os.path.join(path, INFO))
    return opened


def _check_metadata(ck: _Opened) -> None:
    md, where = ck.metadata, os.path.join(ck.path, METADATA)
    entries = md.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
        for k, v in entries.items()
    ):
        raise CheckpointError(f"{where}: malformed state_dict_metadata")
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{where}: malformed storage_data")
    for index, info in md.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)):
            raise CheckpointError(f"{where}: malformed storage_data entry {index!r}")
        entry = ck.files.get(info.relative_path) if _plain_name(info.relative_path) else None
        if entry is None:
            raise CheckpointError(
                f"{where}: {index.fqn} points at {info.relative_path!r}, which is not a file of "
                "this checkpoint"
            )
        if not (isinstance(info.offset, int) and isinstance(info.length, int)) or not (
            0 <= info.offset and 0 <= info.length and info.offset + info.length <= entry["size"]
        ):
            raise CheckpointError(
                f"{where}: {index.fqn} lies outside {info.relative_path} ({entry['size']} bytes)"
            )


_INFO_KEYS = ("format", "step", "extra", "mesh", "order", "aliases", "optimizer")


def _read_info(file: str) -> dict:
    try:
        info = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refusals and corrupt zips alike
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT or set(info) != set(_INFO_KEYS):
        raise CheckpointError(f"{file}: not an {FORMAT} info file")
    return info


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, given metadata already read safely (never
    ``pickle.load``) and checking each data file's CRC-32 before reading it."""

    def __init__(self, ck: _Opened):
        super().__init__(ck.path)
        self._ck = ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = copy.deepcopy(self._ck.metadata)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[i.storage_index].relative_path for i in plan.items}):
            self._ck.verify(name)
        return super().read_data(plan, planner)


# --------------------------------------------------------------------------- #
# What this rank holds, by canonical (single-device) name.
# --------------------------------------------------------------------------- #


@dataclass
class _Target:
    module: nn.Module
    plan: Any  # annot.runtime.stages.PipelinePlan or None
    tp: int
    tp_rank: int
    distributed: bool
    rank: int
    mesh: Optional[tuple[int, int, int]]

    @staticmethod
    def of(model: nn.Module) -> _Target:
        from annot.parallel_model import ParallelModel

        if isinstance(model, ParallelModel):
            ctx = model.ctx
            m = ctx.mesh
            return _Target(
                model.module, model.pipeline, m.tp, ctx.tp_rank, ctx.distributed,
                ctx.rank, (m.dp, m.pp, m.tp),
            )  # fmt: skip
        if isinstance(model, nn.Module):
            from annot.runtime.mesh import current

            ctx = current()
            on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            return _Target(
                model, None, ctx.mesh.tp if ctx else 1, ctx.tp_rank if ctx else 0, on,
                dist.get_rank() if on else 0, None,
            )  # fmt: skip
        raise CheckpointError(
            f"expected the model (an annot.ParallelModel or an nn.Module), got {type(model).__name__}"
        )

    def stored(self, t: torch.Tensor, layout: Optional[Layout]) -> Any:
        return t if layout is None else _Shard(t, layout, self.tp_rank)


@dataclass
class _View:
    tensors: dict[str, torch.Tensor]  # canonical name -> this rank's tensor
    layouts: dict[str, Layout]  # canonical name -> layout, for sharded ones
    aliases: dict[str, str]  # other name -> canonical name
    param_names: dict[int, str]  # id(parameter) -> canonical name


def _view(target: _Target) -> _View:
    from annot.runtime.state_dict import shard_layouts

    by_id = shard_layouts(target.module)
    tie = {n: t.names[0] for t in getattr(target.plan, "ties", ()) for n in t.names}
    groups: dict[int, list[str]] = {}
    local: dict[int, torch.Tensor] = {}
    for key, t in target.module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
        local[id(t)] = t
    view = _View({}, {}, {}, {})
    for tid, names in groups.items():
        canon = next((tie[n] for n in names if n in tie), names[0])
        t = local[tid]
        if t.is_meta:
            raise CheckpointError(f"{canon} is on the meta device; materialise the model first")
        view.tensors[canon] = t.detach()
        layout = by_id.get(tid)
        if layout is not None:
            if layout[2] != target.tp:
                raise CheckpointError(
                    f"{canon} is sharded for tp={layout[2]} but the mesh has tp={target.tp}"
                )
            view.layouts[canon] = layout
        for n in [*names, *(k for k, v in tie.items() if v == canon)]:
            if n != canon:
                view.aliases[n] = canon
        if isinstance(t, nn.Parameter):
            view.param_names[tid] = canon
    return view


def _full_shape(t: torch.Tensor, layout: Optional[Layout]) -> tuple[int, ...]:
    shape = list(t.shape)
    if layout is not None:
        shape[layout[0]] *= layout[2]
    return tuple(shape)


def _param_name(view: _View, p: torch.Tensor, gi: int) -> str:
    name = view.param_names.get(id(p))
    if name is None:
        raise CheckpointError(
            f"optimizer param group {gi} holds a {tuple(p.shape)} parameter that is not in the "
            "model; build the optimizer from model.parameters()"
        )
    return name


# --------------------------------------------------------------------------- #
# Collectives (skipped in a single process).
# --------------------------------------------------------------------------- #


def _all_gather(target: _Target, obj: Any) -> list[Any]:
    if not target.distributed:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _exchange(target: _Target, err: Optional[BaseException], payload: Any, what: str) -> list:
    """Every rank's ``payload``; raises on every rank if any rank failed (so
    none is left waiting in a later collective)."""
    got = _all_gather(target, (None if err is None else str(err), payload))
    if err is not None:
        raise err
    for r, (e, _) in enumerate(got):
        if e is not None:
            raise CheckpointError(f"{what}: rank {r} failed: {e}")
    return [p for _, p in got]


def _from_rank0(target: _Target, fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0; every rank gets its result or raises its error."""
    result = err = None
    if target.rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - the others must hear of any failure
            err = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    if target.distributed:
        box = [(result, err)]
        dist.broadcast_object_list(box, src=0)
        result, err = box[0]
    if err is not None:
        raise CheckpointError(f"{what}: {err}" if target.rank != 0 else err)
    return result


def _dcp_error(e: CheckpointException, what: str) -> CheckpointError:
    parts = [f"rank {r}: {exc}" for r, (exc, _) in sorted(e.failures.items())]
    return CheckpointError(f"{what}: " + "; ".join(parts))


# --------------------------------------------------------------------------- #
# save
# --------------------------------------------------------------------------- #


def _collect(target: _Target, optimizer) -> tuple[dict[str, Any], dict]:
    """This rank's DCP state dict and its part of the info file."""
    view = _view(target)
    state: dict[str, Any] = {
        f"model/{n}": target.stored(t, view.layouts.get(n)) for n, t in view.tensors.items()
    }
    info: dict = {"order": list(view.tensors), "aliases": view.aliases, "optimizer": None}
    if optimizer is None:
        return state, info
    groups, keys, values = [], {}, {}
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            name = _param_name(view, p, gi)
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


def _check_replaceable(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or (
        os.listdir(path) and not os.path.isfile(os.path.join(path, MARKER))
    ):
        raise CheckpointError(
            f"{path}: exists and is not an annot checkpoint; refusing to replace it. Pick a new "
            "path or remove it"
        )


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _own_files(tmp: str, rank: int) -> dict[str, dict]:
    """Size and CRC-32 of the data files this rank wrote (DCP names them ``__<rank>_*``)."""
    prefix = f"__{rank}_"
    return {
        n: {"size": os.path.getsize(os.path.join(tmp, n)), "crc32": _crc32(os.path.join(tmp, n))}
        for n in sorted(os.listdir(tmp))
        if n.startswith(prefix)
    }


def _seal(tmp: str, known: dict[str, dict], info: dict) -> None:
    """Write the completion marker, last: every file's size and CRC-32."""
    files = {}
    for n in sorted(os.listdir(tmp)):
        file = os.path.join(tmp, n)
        if n == MARKER or not os.path.isfile(file):
            continue
        files[n] = known.get(n) or {"size": os.path.getsize(file), "crc32": _crc32(file)}
    manifest = {"format": FORMAT, "step": info["step"], "mesh": info["mesh"], "files": files}
    part = os.path.join(tmp, MARKER + ".part")
    _write_file(part, json.dumps(manifest, indent=1, sort_keys=True).encode())
    os.rename(part, os.path.join(tmp, MARKER))
    _fsync_dir(tmp)


def _publish(tmp: str, path: str) -> None:
    old = None
    if os.path.lexists(path):
        _check_replaceable(path)
        old = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    target = _Target.of(model)
    final = os.path.abspath(os.fspath(path))
    err = state = part = None
    try:
        state, part = _collect(target, optimizer)
    except CheckpointError as e:
        err = e
    parts = _exchange(target, err, part, f"save({final!r})")
    info = {"format": FORMAT, "step": step, "extra": extra, "mesh": target.mesh}
    info.update(_merge(parts))
    buf = io.BytesIO()
    torch.save(info, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - what weights_only refuses
        raise CheckpointError(
            "save: extra= (or an optimizer option) is not plain data that can be loaded without "
            f"unpickling code: {type(e).__name__}: {str(e).splitlines()[0]}. Use numbers, "
            "strings, tensors, lists, tuples and dicts"
        ) from e

    def start() -> str:
        _check_replaceable(final)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        os.makedirs(tmp)
        _write_file(os.path.join(tmp, INFO), buf.getvalue())
        return tmp

    tmp = _from_rank0(target, start, f"save({final!r})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when run in a single process
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                planner=_SavePlanner(),
                no_dist=not target.distributed,
            )
    except CheckpointException as e:
        if target.rank == 0:  # every rank is past DCP's last collective: nothing writes now
            shutil.rmtree(tmp, ignore_errors=True)
        raise _dcp_error(e, f"save({final!r}) failed; nothing was published there") from None
    known = {}
    for own in _all_gather(target, _own_files(tmp, target.rank)):
        known.update(own)
    _from_rank0(target, lambda: (_seal(tmp, known, info), _publish(tmp, final)), f"save({final!r})")
    return final


# --------------------------------------------------------------------------- #
# load
# --------------------------------------------------------------------------- #


def _prepare(target: _Target, optimizer, ck: _Opened) -> tuple[dict, Callable[[], None], set]:
    """Fresh buffers for everything this rank loads, checked against the
    checkpoint; the function that copies them into the model and optimizer
    (run only after every rank read everything); the names this rank holds."""
    view = _view(target)
    dest: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    problems: list[str] = []
    for name, t in view.tensors.items():
        layout = view.layouts.get(name)
        md = ck.tensor_md(f"model/{name}")
        if md is None:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(md.size) != _full_shape(t, layout):
            problems.append(
                f"{name}: the checkpoint has shape {tuple(md.size)}, the model expects "
                f"{_full_shape(t, layout)}"
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
                name = _param_name(view, p, gi)
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
                    if layout is not None and tuple(md.size) == _full_shape(p, layout):
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
                t.copy_(fresh)
        for p, st in states:
            if st:
                optimizer.state[p] = st
            else:
                optimizer.state.pop(p, None)
        for group, opts in zip(optimizer.param_groups if optimizer else (), options):
            group.update(copy.deepcopy(opts))

    return dest, commit, set(view.tensors)


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
    target = _Target.of(model)
    final = os.path.abspath(os.fspath(path))
    err = ck = dest = commit = names = None
    try:
        ck = _open(final)
        dest, commit, names = _prepare(target, optimizer, ck)
    except CheckpointError as e:
        err = e
    held = set().union(*_exchange(target, err, names, f"load({final!r})"))
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
                storage_reader=_SafeReader(ck),
                planner=_LoadPlanner(),
                no_dist=not target.distributed,
            )
    except CheckpointException as e:
        raise _dcp_error(
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
    ck = _open(final)
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
            dcp.load(dest, storage_reader=_SafeReader(ck), planner=_LoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise _dcp_error(e, f"load_full({final!r}) failed") from None
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
