"""Writing a file so that a reader never sees half of it: the one copy used by
the CLI's ``-o``/``--in-place``, the JIT cache and the cost caches."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Union

__all__ = ["atomic_write"]


def atomic_write(dest: Union[str, os.PathLike], data: Union[str, bytes]) -> None:
    """Write ``data`` (text as UTF-8) to ``dest`` through a temporary file in the
    same directory, then ``os.replace``: readers see the old file or the new one,
    never half, and two processes writing the same cache entry do not mix.
    Creates the parent directory; keeps an existing file's permission bits."""
    dest = os.fspath(dest)
    if isinstance(data, str):
        data = data.encode("utf-8")
    parent = os.path.dirname(dest) or "."
    os.makedirs(parent, exist_ok=True)
    try:
        mode = os.stat(dest).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
