"""Reading an annot checkpoint safely, for :mod:`annot.io.dcp`: the names of
its files, the checks :func:`open_checkpoint` makes before anything is
loaded (completion marker, sizes, CRC-32s, metadata, info), and
:class:`SafeReader`, DCP's file reader given metadata read without
``pickle.load``.

Safe. DCP pickles its ``.metadata``; it is read here with an unpickler that
only builds DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths,
and refuses anything else (nothing in it can run code). Data files are read
by DCP with ``torch.load(weights_only=True)``; pickled byte entries are
refused; ``annot-info.pt`` is read with ``weights_only=True`` (so ``extra``
must be plain data: numbers, strings, tensors, lists, tuples, dicts).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from annot.core.errors import CheckpointError

__all__ = [
    "FORMAT",
    "INFO",
    "MARKER",
    "METADATA",
    "Opened",
    "SafeReader",
    "crc32",
    "open_checkpoint",
]

FORMAT = "annot.checkpoint/1"
MARKER = "annot-complete.json"  # written last: its presence means complete
INFO = "annot-info.pt"
METADATA = ".metadata"  # DCP's


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
            "written by annot.save"
        )


def _read_metadata(file: str) -> Metadata:
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{file}: corrupt DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{file}: not DCP metadata (a {type(md).__name__})")
    return md


def crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


@dataclass
class Opened:
    """A checkpoint whose marker, sizes, metadata and info have been checked."""

    path: str
    files: dict[str, dict]  # name -> {"size": int, "crc32": int}
    metadata: Metadata
    info: dict
    crc_checked: set = field(default_factory=set)

    def check_crc(self, name: str) -> None:
        """Check one file's CRC-32 against the marker (once per file)."""
        if name in self.crc_checked:
            return
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: {name} is not listed in {MARKER}")
        crc = crc32(os.path.join(self.path, name))
        if crc != entry["crc32"]:
            raise CheckpointError(
                f"{os.path.join(self.path, name)}: corrupt: CRC-32 {crc:#010x}, the marker "
                f"recorded {entry['crc32']:#010x}; the file changed after the save"
            )
        self.crc_checked.add(name)

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


def open_checkpoint(path: str) -> Opened:
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
    opened = Opened(path, files, None, {})  # type: ignore[arg-type]
    opened.check_crc(METADATA)
    opened.check_crc(INFO)
    opened.metadata = _read_metadata(os.path.join(path, METADATA))
    _check_metadata(opened)
    opened.info = _read_info(os.path.join(path, INFO))
    return opened


def _check_metadata(ck: Opened) -> None:
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
            info.offset >= 0 and info.length >= 0 and info.offset + info.length <= entry["size"]
        ):
            raise CheckpointError(
                f"{where}: {index.fqn} lies outside {info.relative_path} ({entry['size']} bytes)"
            )


_INFO_KEYS = ("format", "step", "extra", "mesh", "order", "aliases", "optimizer")


def _read_info(file: str) -> dict:
    try:
        info = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT or set(info) != set(_INFO_KEYS):
        raise CheckpointError(f"{file}: not an {FORMAT} info file")
    return info


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, given metadata already read safely (never
    ``pickle.load``) and checking each data file's CRC-32 before reading it."""

    def __init__(self, ck: Opened):
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
            self._ck.check_crc(name)
        return super().read_data(plan, planner)
