"""The safetensors file format, read by parts and written by streaming.

A safetensors file is ``<u64 little-endian n><n bytes of JSON header><data>``;
the header maps each tensor's name to its dtype, shape and byte range
``data_offsets = [begin, end)`` in the data (row-major, little-endian).

Reading (:func:`read_header`, :func:`read_box`). The header is checked
whole before anything is read: its length, its JSON, every entry's dtype,
shape and byte range (``end - begin`` equal to the shape's bytes, inside
the file), so a truncated file or a broken header is refused naming the
file, before any parameter changes. A rank then reads only the boxes it
holds (a box: a range on every dim of the full tensor) with ``os.preadv``
into the destination's own memory: one read per contiguous run of bytes
(a slice on dim 0 is one read; a slice on the last dim one read per row).
The destination is the tensor the rank trains (its tp slice, narrowed to
its FSDP2 chunk: any box, read in place), so a rank's memory grows by
exactly what it holds, and nothing of the file stays mapped.
(``safetensors.safe_open(...).get_slice(...)[:]`` answers a whole tensor
with a view of its map of the file instead: measured on the 852.6M Llama's
embedding and first four layers, 0.92 GiB, the peak RSS grows by 0.92 GiB
here and by 0.01 GiB there: its pages become resident as they are read.)

Writing (:class:`StreamWriter`). The header is written first from the
names, dtypes and shapes alone; then each tensor's bytes in header order,
one tensor at a time, so the writer holds only the tensor being written.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from annot.core.errors import CheckpointError

__all__ = ["DTYPES", "Entry", "Header", "StreamWriter", "read_box", "read_header"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and absolute byte offset."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class Header:
    """A file's checked header: ``entries`` by name, ``metadata`` (strings)."""

    path: str
    entries: dict[str, Entry]
    metadata: dict[str, str]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _broken(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a readable safetensors file: {why}; the file is damaged or was not "
        "written completely: copy or save it again"
    )


def read_header(path: str) -> Header:
    """The header of the safetensors file ``path``, checked against the file's
    size (see the module docstring); :class:`CheckpointError` names the file
    and what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _broken(path, f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise _broken(path, f"the header claims {n} bytes, the file has {size}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from None
    try:
        table = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _broken(path, f"its header is not JSON ({e})") from None
    if not isinstance(table, dict):
        raise _broken(path, "its header is not a JSON object")
    data = 8 + n
    metadata = table.pop("__metadata__", None) or {}
    entries: dict[str, Entry] = {}
    for name, described in table.items():
        entries[name] = _entry(path, name, described, data, size)
    return Header(path, entries, {str(k): str(v) for k, v in dict(metadata).items()})


def _entry(path: str, name: str, e: object, data: int, size: int) -> Entry:
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
        raise _broken(path, f"{name!r} lacks dtype, shape or data_offsets")
    dtype = DTYPES.get(e["dtype"])
    if dtype is None:
        raise _broken(path, f"{name!r} has dtype {e['dtype']!r}; annot reads {sorted(DTYPES)}")
    shape, span = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise _broken(path, f"{name!r} has shape {shape!r}")
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(b, int) for b in span)):
        raise _broken(path, f"{name!r} has data_offsets {span!r}")
    entry = Entry(dtype, tuple(shape), data + span[0])
    if span[1] - span[0] != entry.nbytes or span[0] < 0:
        raise _broken(
            path, f"{name!r} spans bytes {span} but its shape {shape} of {e['dtype']} needs "
            f"{entry.nbytes}"
        )  # fmt: skip
    if data + span[1] > size:
        raise _broken(
            path, f"{name!r} ends at byte {data + span[1]} but the file has {size} bytes "
            "(truncated)"
        )  # fmt: skip
    return entry


def _runs(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]):
    """``(element offset, element count, index into the box)`` of each
    contiguous run of the box ``offsets``/``sizes`` in a row-major tensor of
    ``shape``: the dims after the last partial one are whole, so each index
    of the dims before it (and including it) starts one run."""
    k = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=-1)
    inner = math.prod(shape[k + 1 :])
    if k < 0:
        yield 0, inner, 0
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    count = sizes[k] * inner
    outer = sizes[:k]
    for i, idx in enumerate(_indices(outer)):
        start = sum((offsets[d] + idx[d]) * strides[d] for d in range(k)) + offsets[k] * inner
        yield start, count, i


def _indices(sizes: tuple[int, ...]):
    if not sizes:
        yield ()
        return
    for head in range(sizes[0]):
        for rest in _indices(sizes[1:]):
            yield (head, *rest)


def read_box(
    fd: int, entry: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...], out: torch.Tensor
) -> None:
    """Read the box ``offsets``/``sizes`` of ``entry`` into ``out`` (a tensor
    of shape ``sizes``): straight into ``out``'s memory when it is
    contiguous, on the CPU and of the stored dtype, else through one buffer
    of the box's size."""
    if tuple(out.shape) != tuple(sizes):
        raise CheckpointError(f"read_box: out has shape {tuple(out.shape)}, the box {sizes}")
    if math.prod(sizes) == 0:
        return
    direct = out.is_contiguous() and out.device.type == "cpu" and out.dtype == entry.dtype
    buf = out if direct else torch.empty(sizes, dtype=entry.dtype)
    item = _itemsize(entry.dtype)
    raw = buf.view(-1).view(torch.uint8).numpy().data  # a memoryview of its bytes
    for start, count, i in _runs(offsets, sizes, entry.shape):
        _pread(fd, raw[i * count * item : (i + 1) * count * item], entry.offset + start * item)
    if not direct:
        out.copy_(buf)


def _pread(fd: int, into: memoryview, at: int) -> None:
    while len(into):
        got = os.preadv(fd, [into], at)
        if got <= 0:
            raise CheckpointError(f"read past the end of a file at byte {at} (it was truncated)")
        into, at = into[got:], at + got


class StreamWriter:
    """Write one safetensors file tensor by tensor: ``StreamWriter(path,
    [(name, dtype, shape), ...], metadata)`` writes the header; then
    :meth:`write` each tensor in that order; :meth:`close` checks that every
    one was written and syncs the file."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata):
        table: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        at = 0
        self.order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            if dtype not in _NAMES:
                raise CheckpointError(f"{name}: dtype {dtype} has no safetensors name")
            n = math.prod(shape) * _itemsize(dtype)
            table[name] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [at, at + n],
            }
            self.order.append((name, dtype, tuple(shape)))
            at += n
        header = json.dumps(table, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - the writer holds it until close()
        self.file.write(struct.pack("<Q", len(header)) + header)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self.order[self.next]
        if name != want or t.dtype != dtype or tuple(t.shape) != shape:
            raise CheckpointError(
                f"{self.path}: expected {want} {dtype} {shape} next, got {name} {t.dtype} "
                f"{tuple(t.shape)}"
            )
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            self.file.write(t.view(-1).view(torch.uint8).numpy().data)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            missing = [n for n, _, _ in self.order[self.next :]]
            raise CheckpointError(f"{self.path}: closed before writing {missing[:4]}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
