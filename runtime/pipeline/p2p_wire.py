"""The wire format of :mod:`annot.runtime.pipeline.p2p`: what the bytes of one
message are, and the rules both ends compute alike from them.

Wire format: one message is one to three sends on the pair, in this order:

1. preamble, ``uint8[size]``: ``int64[8] = [MAGIC, VERSION, header bytes,
   payload bytes, tagged, tag0, tag1, tag2]`` followed by the header itself when
   it fits in the rest (the usual case), and by the payload too when that also
   fits. It is the only message the receiver posts blind. Its size is 4 KiB for
   a channel's first transfer, then whatever the previous transfer on that
   channel needed (rounded up to 4 KiB, at most 8 MiB): both ends compute it
   from the sizes of the previous transfer, so with steady shapes a transfer is
   one message. ``header bytes`` is 0 when the header is byte for byte the
   channel's previous one (steady shapes: the receiver reuses the header it
   parsed and checked then, and when the payload is inline, the views it
   made from it; the sender, finding the channel's previous simple signature
   (:func:`~annot.runtime.pipeline.p2p_codec.simple_signature`) again by
   :func:`~annot.runtime.pipeline.p2p_codec.matcher`, skips encoding altogether and
   copies the tensors into their places in one of the channel's first
   messages, given back when the send completed; a payload too large for a
   first message is never sent this way). The tag is three ints the caller
   may attach (``send_pytree(..., tag=)``; the pipeline's ``(direction,
   stage, microbatch)``), so a message's key does not make its header differ;
2. header, ``uint8[header bytes]``, only when it did not fit in the preamble:
   UTF-8 JSON, never pickle (nothing received is ever executed or imported):
   the tree with its plain leaves, and each tensor's dtype, shape and
   requires_grad;
3. payload, ``uint8[payload bytes]``: the bytes of every non-empty tensor, each
   starting at a multiple of 16 bytes, all dtypes in one buffer (so one send
   per message, not one per tensor or per dtype); absent when there are none.

The receiver checks the preamble (magic, version, size bounds) and the header
(dtypes, shapes, that they add up to the payload size) before it posts the next
receive: gloo aborts the process on a message larger than the posted buffer and
silently corrupts on a smaller one, so only sizes that were validated are ever
posted. A bad message raises :class:`annot.core.errors.PipelineError` naming the
label, the source rank and the expected vs received values.
"""

from __future__ import annotations

import collections
import json
import struct
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from annot.core.errors import PipelineError
from annot.runtime.pipeline.p2p_codec import DTYPES, Malformed, flatten

__all__ = [
    "ALIGN",
    "FIRST_BYTES",
    "MAGIC",
    "MAX_FIRST_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_PAYLOAD_BYTES",
    "PREAMBLE",
    "VERSION",
    "check_header",
    "contiguous_strides",
    "copy_into",
    "encode_header",
    "first_message",
    "host_bytes",
    "inline_payload_at",
    "next_first",
    "numel",
    "pack_payload",
    "parse_header",
    "payload_layout",
    "steady_views",
    "write_tensors",
]

MAGIC = int.from_bytes(b"annotP2P", "big")
VERSION = 5  # 5: a lane is its messages' tag; 4: lanes, a steady layout agreed from the last
PREAMBLE = struct.Struct("<8q")  # MAGIC, VERSION, header bytes, payload bytes, tagged, tag[3]
# Size of the first message of a transfer (preamble + header when it fits).
FIRST_BYTES = 4096
# The first message grows to fit what the channel carried last (both sides
# compute the same size from the previous transfer), up to this bound.
MAX_FIRST_BYTES = 8 << 20
ALIGN = 16
MAX_HEADER_BYTES = 16 << 20
MAX_PAYLOAD_BYTES = 1 << 40


def next_first(hlen: int, plen: int) -> int:
    """The first-message size both ends use for the channel's next transfer:
    enough for this one's header and payload (steady shapes: one message), or
    for its header alone where the payload could not fit (it goes apart: a
    first message padded to the bound would move megabytes of zeros)."""
    need = -(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN
    if need + plen <= MAX_FIRST_BYTES:
        need += plen
    return min(MAX_FIRST_BYTES, max(FIRST_BYTES, -(-need // FIRST_BYTES) * FIRST_BYTES))


def payload_layout(metas: list) -> tuple[list[Optional[int]], int]:
    """Byte offset of each tensor in the payload (None for empty ones) and the
    payload size; the same rule on both sides."""
    offsets: list[Optional[int]] = []
    cursor = 0
    for dtype_name, shape, _ in metas:
        nbytes = DTYPES[dtype_name].itemsize * numel(shape)
        if nbytes == 0:
            offsets.append(None)
            continue
        cursor = -(-cursor // ALIGN) * ALIGN
        offsets.append(cursor)
        cursor += nbytes
    return offsets, cursor


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# Encoded headers of the simple messages (p2p_codec.simple_signature): steady
# shapes skip flatten, json and the layout.
_ENCODED: collections.OrderedDict[tuple, tuple[bytes, list, int]] = collections.OrderedDict()
_MAX_ENCODED = 64


def encode_header(
    obj: Any, what: str, dst: int, simple: Optional[tuple]
) -> tuple[bytes, list, list, int]:
    """``obj``'s header bytes, its tensors, their payload offsets and the
    payload size (errors name the message and ``dst``); ``simple`` is its
    simple signature or None."""
    if simple is not None:
        hit = _ENCODED.get(simple[0])
        if hit is not None:
            _ENCODED.move_to_end(simple[0])  # least recently used first out
        if hit is not None:
            return hit[0], simple[1], hit[1], hit[2]
    where = f" (send{' ' + what if what else ''} to rank {dst})"
    try:
        tree, tensors = flatten(obj)
    except PipelineError as err:
        raise PipelineError(f"{err}{where}") from None
    metas = [
        [str(t.dtype).removeprefix("torch."), list(t.shape), bool(t.requires_grad)] for t in tensors
    ]
    # No label in the header: F and B on one channel may then reuse each other's.
    header = {"v": VERSION, "tree": tree, "tensors": metas}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise PipelineError(
            f"the header of {what or 'this message'} is {len(raw)} bytes, over the"
            f" {MAX_HEADER_BYTES}-byte limit{where}: send fewer, larger tensors or plain values"
        )
    offsets, total = payload_layout(metas)
    if simple is not None:
        if len(_ENCODED) >= _MAX_ENCODED:  # (a plain value changing every message)
            _ENCODED.popitem(last=False)
        _ENCODED[simple[0]] = raw, offsets, total
    return raw, tensors, offsets, total


def steady_views(buf: torch.Tensor, views: list) -> list[torch.Tensor]:
    """The tensors of a steady message in ``buf`` (a fresh first message):
    each a fresh tensor on its storage (its own version counter), or new and
    empty where it has no bytes."""
    storage = buf.untyped_storage()
    tensors = []
    for dtype, shape, strides, requires_grad, off in views:
        if off is None:
            t = torch.empty(shape, dtype=dtype, device=buf.device)
        else:
            t = torch.empty(0, dtype=dtype, device=buf.device)
            t.set_(storage, off // dtype.itemsize, shape, strides)
        tensors.append(t.requires_grad_() if requires_grad else t)
    return tensors


def contiguous_strides(shape: list) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def host_bytes(buf: torch.Tensor) -> Any:
    """A buffer-protocol view (CPU) or copy (other devices) of ``buf``'s bytes."""
    return buf.numpy() if buf.device.type == "cpu" else buf.cpu().numpy()


def parse_header(first, hlen: int, size: int, receive, reject) -> tuple:
    """The header of ``hlen`` bytes (inline in ``first`` or received next),
    checked: ``(tree, metas, offsets, payload bytes)``."""
    if hlen <= size - PREAMBLE.size:
        raw = host_bytes(first[PREAMBLE.size : PREAMBLE.size + hlen]).tobytes()
    else:
        raw = host_bytes(receive(hlen)).tobytes()
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise reject(f"the {hlen}-byte header is not valid UTF-8 JSON ({err})") from None
    try:
        metas = check_header(header)
    except Malformed as bad:
        raise reject(f"malformed header: {bad}") from None
    offsets, total = payload_layout(metas)
    return header["tree"], metas, offsets, total


def inline_payload_at(hlen: int, plen: int, size: int) -> Optional[int]:
    """Where a payload of ``plen`` bytes sits inside a first message of ``size``
    bytes after a ``hlen``-byte header (16-byte aligned), or None when it does
    not fit."""
    at = -(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN
    return at if plen and at + plen <= size else None


def check_header(header: Any) -> list:
    if not isinstance(header, dict) or header.get("v") != VERSION or "tree" not in header:
        raise Malformed(f"expected an object with v={VERSION} and a tree")
    metas = header.get("tensors")
    if not isinstance(metas, list):
        raise Malformed("no tensor list")
    for i, meta in enumerate(metas):
        if not (isinstance(meta, list) and len(meta) == 3):
            raise Malformed(
                f"tensor {i}: expected [dtype, shape, requires_grad], received {meta!r:.80}"
            )
        dtype_name, shape, requires_grad = meta
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise Malformed(f"tensor {i}: unknown dtype {dtype_name!r:.40}")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and 0 <= d <= MAX_PAYLOAD_BYTES for d in shape)
        ):
            raise Malformed(f"tensor {i}: bad shape {shape!r:.80}")
        if type(requires_grad) is not bool or (
            requires_grad and not (dtype.is_floating_point or dtype.is_complex)
        ):
            raise Malformed(f"tensor {i}: requires_grad={requires_grad!r} for {dtype_name}")
        if numel(shape) * dtype.itemsize > MAX_PAYLOAD_BYTES:
            raise Malformed(f"tensor {i}: shape {shape} is larger than the payload limit")
    return metas


# -- the payload: each non-empty tensor's bytes at its offset --------------------


def pack_payload(
    tensors: list, offsets: list, total: int, comm: torch.device
) -> Optional[torch.Tensor]:
    if total == 0:
        return None
    live = [(t, o) for t, o in zip(tensors, offsets) if o is not None]
    if len(live) == 1 and live[0][0].device == comm:  # no copy
        return as_bytes(live[0][0].detach().contiguous())
    buf = torch.empty(total, dtype=torch.uint8, device=comm)
    for t, off in live:
        copy_into(buf, off, t.detach())
    return buf


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


def write_tensors(
    arr: np.ndarray, buf: torch.Tensor, cursor: int, at: int, tensors: list, offsets: list
) -> None:
    """Copy each non-empty tensor to ``buf`` (``arr``: its numpy view) at
    ``at`` + its offset, and zero the bytes from ``cursor`` that no tensor
    covers: numpy where it can view the tensor's bytes, torch for the rest."""
    for t, off in zip(tensors, offsets):
        if off is None:
            continue
        start = at + off
        arr[cursor:start] = 0
        src = t.detach()
        if (
            src.dtype in NUMPY_DTYPES
            and src.device.type == "cpu"
            and src.is_contiguous()
            and not (src.is_conj() or src.is_neg() or src._is_zerotensor())
        ):
            raw = src.numpy().reshape(-1).view(np.uint8)
            arr[start : start + raw.size] = raw
            cursor = start + raw.size
        else:
            cursor = copy_into(buf, start, src)
    arr[cursor:] = 0


# dtypes numpy can view (the others, bfloat16 and float8, are copied by torch)
NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.complex128,
        torch.complex64,
        torch.bool,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    }
)


def copy_into(buf: torch.Tensor, start: int, t: torch.Tensor) -> int:
    """Copy ``t`` into ``buf``'s bytes from ``start`` (resolving conj/neg bits
    and strides); returns where it ends."""
    end = start + t.numel() * t.element_size()
    buf[start:end].view(t.dtype).view(t.shape).copy_(t)
    return end


def first_message(
    prefix: bytes, size: int, comm: torch.device, at: Optional[int], tensors: list, offsets: list
) -> torch.Tensor:
    """The ``size``-byte first message on ``comm``: ``prefix``, then (``at``
    not None) each non-empty tensor at ``at`` + its offset (16-byte aligned, so
    a typed view of the bytes is valid), zeros elsewhere. On the CPU written
    through numpy (a few microseconds less than a torch op per piece)."""
    if comm.type != "cpu":
        buf = torch.zeros(size, dtype=torch.uint8, device=comm)
        buf[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
        if at is not None:
            for t, off in zip(tensors, offsets):
                if off is not None:
                    copy_into(buf, at + off, t.detach())
        return buf
    buf = torch.empty(size, dtype=torch.uint8)
    arr = buf.numpy()
    arr[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    if at is None:
        arr[len(prefix) :] = 0
    else:
        write_tensors(arr, buf, len(prefix), at, tensors, offsets)
    return buf
