"""Publishing a checkpoint atomically, for :func:`annot.io.dcp.save`: the
completion marker written last (:func:`seal`), then the rename into place
(:func:`publish`).

Atomic. Rank 0 creates ``<path>.tmp-<id>`` and writes ``annot-info.pt``
(step, extra, names, optimizer groups) there; every rank writes its chunks
into it through ``dcp.save``; after DCP's last collective each rank records
its own files' sizes and CRC-32s, and rank 0 writes the completion marker
``annot-complete.json`` last, then renames the directory to ``path`` (an
older checkpoint there is moved aside first, removed after). A crash before
that leaves no new ``path``; a directory without the marker, with a
truncated or altered file, or with corrupt metadata is refused with
:class:`~annot.core.errors.CheckpointError`. ``path`` must be on a file system
every rank sees (as DCP's ``FileSystemWriter`` assumes).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

from annot.core.errors import CheckpointError
from annot.io.dcp_read import FORMAT, MARKER, crc32

__all__ = ["check_replaceable", "own_files", "publish", "replace_dir", "seal", "write_file"]


def check_replaceable(path: str) -> None:
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


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def own_files(tmp: str, rank: int) -> dict[str, dict]:
    """Size and CRC-32 of the data files this rank wrote (DCP names them ``__<rank>_*``)."""
    prefix = f"__{rank}_"
    return {
        n: {"size": os.path.getsize(os.path.join(tmp, n)), "crc32": crc32(os.path.join(tmp, n))}
        for n in sorted(os.listdir(tmp))
        if n.startswith(prefix)
    }


def seal(tmp: str, known: dict[str, dict], info: dict) -> None:
    """Write the completion marker, last: every file's size and CRC-32."""
    files = {}
    for n in sorted(os.listdir(tmp)):
        file = os.path.join(tmp, n)
        if n == MARKER or not os.path.isfile(file):
            continue
        files[n] = known.get(n) or {"size": os.path.getsize(file), "crc32": crc32(file)}
    manifest = {"format": FORMAT, "step": info["step"], "mesh": info["mesh"], "files": files}
    part = os.path.join(tmp, MARKER + ".part")
    write_file(part, json.dumps(manifest, indent=1, sort_keys=True).encode())
    os.rename(part, os.path.join(tmp, MARKER))
    _fsync_dir(tmp)


def publish(tmp: str, path: str) -> None:
    """Move the sealed checkpoint ``tmp`` to ``path``, replacing an annot
    checkpoint there (anything else is refused)."""
    if os.path.lexists(path):
        check_replaceable(path)
    replace_dir(tmp, path)


def replace_dir(tmp: str, path: str) -> None:
    """Rename the finished directory ``tmp`` to ``path``; whatever is at
    ``path`` is moved aside first and removed after, so ``path`` holds the
    old or the new one at every moment."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
