"""Send a pytree of tensors and plain values from one pipeline stage to another.

The receiver never assumes a shape: each message carries a small header
(structure, dtypes, shapes, requires_grad, the non-tensor leaves), so the set of
values and their shapes may change on every call::

    handle = send_pytree({"h": h, "mask": m, "n": 3}, dst=2, what="activations",
                         stage=0, microbatch=5)          # asynchronous
    ...                                                  # overlap
    handle.wait()                                        # RankFailure on a fault

    obj = recv_pytree(src=0, what="activations", stage=1, microbatch=5)

Gradients go back the same way: the receiving stage sends
``[t.grad for t in tensors_requiring_grad(inputs)]`` and the sending stage
calls ``torch.autograd.backward(tensors_requiring_grad(outputs), grads)``
(skipping pairs whose gradient is None). The pytree codec (:func:`flatten`,
:func:`unflatten`, :func:`tensors_requiring_grad`) is :mod:`annot.runtime.pipeline.p2p_codec`.

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

Lanes: a channel (one direction, one peer, one group) keeps the sizes and the
header both ends agreed from its previous transfer, so a message of another
kind between two alike (the pipeline's step outputs after its activations)
would make the next one a two-part transfer with a new header. Such traffic
goes on a lane of its own (``send_pytree(..., lane=1)`` and the same lane on
the receiving side): lanes keep their agreements apart, and a lane is the
message tag of its sends and receives. Under gloo, which matches a receive
to a send by tag, a lane's messages are therefore matched apart from the
other lanes' (a receive posted ahead on lane 1 never takes a lane-0
message); NCCL ignores tags and matches a pair's messages in the order they
were posted, so there both ends must post them in the same order across
lanes too.

Under gloo, a receiver that knows a message will come may post the receive of
its first part ahead (:func:`post_recv`, then ``recv_pytree(..., posted=)``):
both ends know its size from the channel's previous transfer, and gloo's send
then writes at once instead of waiting for the receiver to ask. Not under
NCCL, which runs a pair's sends and receives in order on one stream: a
receive posted before this rank's own send to the peer can deadlock.

The receiver checks the preamble (magic, version, size bounds) and the header
(dtypes, shapes, that they add up to the payload size) before it posts the next
receive: gloo aborts the process on a message larger than the posted buffer and
silently corrupts on a smaller one, so only sizes that were validated are ever
posted. A bad message raises :class:`annot.core.errors.PipelineError` naming the
label, the source rank and the expected vs received values.

Received tensors are views of the payload buffer with their own version
counters (in-place ops on one do not disturb autograd on another), contiguous,
on the receiver's device, with ``requires_grad`` as sent. Sends and receives
between two ranks must be posted in the same order on both sides, from one
thread. gloo and NCCL: the comm device is CUDA for NCCL (header included, as
NCCL moves only device tensors), CPU otherwise; tensors on other devices are
copied to it.
"""

from __future__ import annotations

import collections
import functools
import json
import struct
from collections.abc import Sequence
from typing import Any, Optional, cast

import numpy as np
import torch
import torch.distributed as dist

from annot.core.errors import PipelineError, RankFailure
from annot.runtime.faults import failures as faults
from annot.runtime.faults.comm_wait import wait_work
from annot.runtime.faults.store import connect_store, report_failure
from annot.runtime.pipeline.p2p_codec import (
    DTYPES,
    Malformed,
    flatten,
    matcher,
    rebuilder,
    simple_signature,
    unflatten,
)

__all__ = ["Handle", "PostedRecv", "post_recv", "recv_pytree", "send_pytree"]

MAGIC = int.from_bytes(b"annotP2P", "big")
VERSION = 5  # 5: a lane is its messages' tag; 4: lanes, a steady layout agreed from the last
PREAMBLE = struct.Struct("<8q")  # MAGIC, VERSION, header bytes, payload bytes, tagged, tag[3]
# Size of the first message of a transfer (preamble + header when it fits).
FIRST_BYTES = 4096
# The first message grows to fit what the channel carried last (both sides
# compute the same size from the previous transfer), up to this bound.
MAX_FIRST_BYTES = 8 << 20


class _Channel:
    """One direction to one peer in one group: what both ends agreed from the
    channel's previous transfer, and what the receiver prepared from the
    header it checked then (steady shapes: each later message is one receive
    into a fresh buffer, a preamble check, and views of the buffer)."""

    __slots__ = (
        "backend",
        "comm",
        "expect",
        "first",
        "header",
        "hlen",
        "inline",
        "parsed",
        "rebuild",
        "steady",
        "tag",
        "views",
    )

    def __init__(self, group: Any, lane: int) -> None:
        self.tag = lane  # the message tag of the channel's sends and receives
        self.first = FIRST_BYTES  # bytes of the next first message
        self.hlen = 0  # receiver: the previous header's length (sizes the next first message)
        self.header: Optional[bytes] = None  # sender: the previous header
        # sender: the previous message's layout, when a message like it is sent steady
        self.steady: Optional[_Steady] = None
        self.parsed: Optional[tuple] = None  # receiver: (tree, metas, offsets, payload bytes)
        # receiver, from the checked header: (dtype, shape, strides, requires_grad, offset) per
        # tensor, and p2p_codec.rebuilder's function (None: unflatten each time)
        self.views: list[tuple] = []
        self.rebuild: Any = None
        # receiver: the preamble's first words of a steady message (the checked
        # header repeated, the payload inline at PREAMBLE.size), when one is
        # rebuilt directly; None otherwise. ``inline``: ``views`` with the
        # offsets from the first message's start
        self.expect: Optional[tuple] = None
        self.inline: list[tuple] = []
        self.comm, self.backend = _comm(group)
        connect_store()  # now, while every rank is alive (posts catch their own errors)


_CHANNELS: dict[tuple, _Channel] = {}


def _channel_key(direction: str, peer: int, group: Any, lane: int) -> tuple:
    return (direction, peer, id(group) if group is not None else 0, lane)


def _channel(direction: str, peer: int, group: Any, lane: int) -> _Channel:
    key = _channel_key(direction, peer, group, lane)
    ch = _CHANNELS.get(key)
    if ch is None:
        ch = _CHANNELS[key] = _Channel(group, lane)
    return ch


def _next_first(hlen: int, plen: int) -> int:
    """The first-message size both ends use for the channel's next transfer:
    enough for this one's header and payload (steady shapes: one message), or
    for its header alone where the payload could not fit (it goes apart: a
    first message padded to the bound would move megabytes of zeros)."""
    need = -(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN
    if need + plen <= MAX_FIRST_BYTES:
        need += plen
    return min(MAX_FIRST_BYTES, max(FIRST_BYTES, -(-need // FIRST_BYTES) * FIRST_BYTES))


def reset_channels() -> None:
    """Forget the channel sizes and headers (both ends must do it at the same
    point), and each channel's comm device and backend (after a new process
    group), with their pooled send buffers."""
    _CHANNELS.clear()


ALIGN = 16
MAX_HEADER_BYTES = 16 << 20
MAX_PAYLOAD_BYTES = 1 << 40

# -- layout -----------------------------------------------------------------


def _layout(metas: list) -> tuple[list[Optional[int]], int]:
    """Byte offset of each tensor in the payload (None for empty ones) and the
    payload size; the same rule on both sides."""
    offsets: list[Optional[int]] = []
    cursor = 0
    for dtype_name, shape, _ in metas:
        nbytes = DTYPES[dtype_name].itemsize * _numel(shape)
        if nbytes == 0:
            offsets.append(None)
            continue
        cursor = -(-cursor // ALIGN) * ALIGN
        offsets.append(cursor)
        cursor += nbytes
    return offsets, cursor


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _comm(group: Any) -> tuple[torch.device, str]:
    backend = str(dist.get_backend(group))
    if "nccl" in backend.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), backend
    return torch.device("cpu"), backend


def _pack(tensors: list, offsets: list, total: int, comm: torch.device) -> Optional[torch.Tensor]:
    if total == 0:
        return None
    live = [(t, o) for t, o in zip(tensors, offsets) if o is not None]
    if len(live) == 1 and live[0][0].device == comm:  # no copy
        return _bytes(live[0][0].detach().contiguous())
    buf = torch.empty(total, dtype=torch.uint8, device=comm)
    for t, off in live:
        _copy_into(buf, off, t.detach())
    return buf


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


# -- send -------------------------------------------------------------------


def _op(verb: str, what: str) -> str:
    return f"{verb} {what}" if what else verb


# Encoded headers of the simple messages (p2p_codec.simple_signature): steady
# shapes skip flatten, json and the layout.
_ENCODED: collections.OrderedDict[tuple, tuple[bytes, list, int]] = collections.OrderedDict()
_MAX_ENCODED = 64


def _encode(
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
    where = f" ({_op('send', what)} to rank {dst})"
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
    offsets, total = _layout(metas)
    if simple is not None:
        if len(_ENCODED) >= _MAX_ENCODED:  # (a plain value changing every message)
            _ENCODED.popitem(last=False)
        _ENCODED[simple[0]] = raw, offsets, total
    return raw, tensors, offsets, total


# A message's labels for fault messages: (what, stage, microbatch, peer,
# peer_stage, timeout_s). Posts and waits catch their own errors and build the
# RankFailure only then (faults.failure), instead of entering a guard each.
Labels = tuple


def _failure(exc: Exception, verb: str, labels: Labels) -> RankFailure:
    what, stage, microbatch, peer, peer_stage, timeout_s = labels
    return faults.failure(
        exc,
        _op(verb, what),
        stage=stage,
        microbatch=microbatch,
        peer=peer,
        peer_stage=peer_stage,
        timeout_s=timeout_s,
    )


def _wait(work: Any, backend: str, verb: str, labels: Labels) -> None:
    """``wait_work`` with the labels' timeout; a failure becomes RankFailure."""
    timeout = faults.default_timeout(labels[5])
    try:
        wait_work(work, timeout, backend=backend)
    except RankFailure:
        raise
    except Exception as exc:
        raise _failure(exc, verb, labels) from exc


class Handle:
    """An asynchronous send: keeps its buffers alive until :meth:`wait`. A lone
    contiguous tensor sent apart from the first message is sent from its own
    memory: do not modify it in place before ``wait()``."""

    def __init__(
        self,
        works: list,
        keep: tuple,
        labels: Labels,
        backend: str,
        reusable: Optional[tuple] = None,
    ):
        self._works = works
        self._keep = keep
        self._labels = labels
        self._backend = backend
        self._reusable = reusable  # (a _Steady, one of its buffers): back to it once sent

    def is_completed(self) -> bool:
        """True once every send finished (gloo reports completion only after
        :meth:`wait`)."""
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until the message is sent; RankFailure if the peer fails or does
        not receive it within the timeout. Idempotent."""
        labels = self._labels if timeout_s is None else (*self._labels[:5], timeout_s)
        while self._works:
            _wait(self._works[0], self._backend, "send", labels)
            self._works.pop(0)
        self._keep = ()
        if self._reusable is not None:
            steady, entry = self._reusable
            if len(steady.free) * steady.size < POOL_BYTES:
                steady.free.append(entry)
            self._reusable = None


def send_pytree(
    obj: Any,
    dst: int,
    *,
    group: Any = None,
    what: str = "",
    timeout_s: Optional[float] = None,
    stage: Optional[int] = None,
    microbatch: Optional[int] = None,
    peer_stage: Optional[int] = None,
    tag: Optional[tuple[int, int, int]] = None,
    lane: int = 0,
) -> Handle:
    """Start sending ``obj`` to global rank ``dst``; returns a :class:`Handle`
    to ``wait()`` on. ``what`` labels the message in errors (``"activations"``);
    ``stage``/``microbatch``/``peer_stage`` name this rank's stage, the
    microbatch and the destination's stage in fault messages, which read
    ``... waited in send activations of microbatch 3``: keep ``what`` short and
    pass the microbatch separately. ``tag``: three ints carried beside the
    object (``recv_pytree(..., tagged=True)`` returns them). ``lane``: the
    channel's lane (see the module docstring); the receiver passes the same.

    Unsupported values raise PipelineError before anything is sent; a peer that
    fails or hangs raises RankFailure (here or in ``wait()``)."""
    if tag is None:
        tagged: tuple = (0, 0, 0, 0)
    elif (
        type(tag) is tuple
        and len(tag) == 3
        and type(tag[0]) is int
        and type(tag[1]) is int
        and type(tag[2]) is int
    ):
        tagged = (1, *tag)
    else:
        where = f" ({_op('send', what)} to rank {dst})"
        raise PipelineError(f"tag= must be a tuple of three ints, got {tag!r:.80}{where}")
    labels = (what, stage, microbatch, dst, peer_stage, timeout_s)
    ch = _CHANNELS.get(_channel_key("send", dst, group, lane))  # (made after the refusals)
    steady = ch.steady if ch is not None else None
    if ch is not None and steady is not None:
        # Steady: like the channel's previous message (its header, not sent
        # again; its layout; a first message that holds it all, both ends agreed).
        found = steady.match(obj)
        if found is not None:
            entry = steady.take()
            buf, arr, places = entry
            PREAMBLE.pack_into(arr, 0, MAGIC, VERSION, 0, steady.total, *tagged)
            for place, t in zip(places, found):
                if place is not None:
                    place.copy_(t.detach())
            return _post([buf], dst, group, ch, labels, (steady, entry))
    simple = simple_signature(obj)  # (a simple message is always sendable)
    encoded = _encode(obj, what, dst, None) if simple is None else None  # refused here
    ch = _channel("send", dst, group, lane)
    comm, size = ch.comm, ch.first
    raw, tensors, offsets, total = encoded or _encode(obj, what, dst, simple)
    # The first message: the preamble, the header when it is new and fits, and
    # the payload too when that also fits (steady shapes: one message a
    # transfer, the tensors copied straight into it). Its size is what both
    # ends agreed from the channel's previous transfer.
    wire = b"" if raw == ch.header else raw  # empty: "the previous header"
    inline = len(wire) <= size - PREAMBLE.size
    prefix = PREAMBLE.pack(MAGIC, VERSION, len(wire), total, *tagged) + (wire if inline else b"")
    at = _inline_payload_at(len(wire), total, size) if inline else None
    pre = _first_message(prefix, size, comm, at, tensors, offsets)
    bufs = [pre]
    if at is None:
        if not inline:
            bufs.append(torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(comm))
        payload = _pack(tensors, offsets, total, comm)
        if payload is not None:
            bufs.append(payload)
    ch.first, ch.header = _next_first(len(raw), total), raw
    # Steady from now on if it is simple (its header then fits the next first
    # message) and the next first message holds its payload too.
    fits = PREAMBLE.size + total <= ch.first and comm.type == "cpu"
    ch.steady = _Steady(simple[0], ch.first, total, tensors, offsets) if simple and fits else None
    return _post(bufs, dst, group, ch, labels, None)


def _post(bufs: list, dst: int, group: Any, ch: _Channel, labels: Labels, reusable: Any) -> Handle:
    try:
        works = [dist.isend(b, dst=dst, group=group, tag=ch.tag) for b in bufs]
    except Exception as exc:
        raise _failure(exc, "send", labels) from exc
    return Handle(works, tuple(bufs), labels, ch.backend, reusable)


# A steady channel keeps at most this many bytes of free first messages (it
# holds as many as its sends in flight at once: GPipe's M of them).
POOL_BYTES = 64 << 20


class _Steady:
    """A sender channel's steady layout: the check of a message against the
    previous one's simple signature (:func:`~annot.runtime.pipeline.p2p_codec.matcher`),
    its payload size, and its first messages (CPU buffers, zeroed once, each
    with a typed view per non-empty tensor at its place), reused once their
    send completed (:meth:`Handle.wait` gives them back)."""

    __slots__ = ("free", "match", "places", "size", "total")

    def __init__(self, key: tuple, size: int, total: int, tensors: list, offsets: list):
        self.match = matcher(key)
        self.size, self.total = size, total
        self.places = [
            None if off is None else (PREAMBLE.size + off, t.dtype, tuple(t.shape))
            for t, off in zip(tensors, offsets)
        ]
        self.free: list[tuple] = []

    def take(self) -> tuple:
        """A free first message: (buffer, its numpy view, typed views)."""
        if self.free:
            return self.free.pop()
        buf = torch.zeros(self.size, dtype=torch.uint8)
        places = [
            None
            if place is None
            else buf[place[0] : place[0] + place[1].itemsize * _numel(place[2])]
            .view(place[1])
            .view(place[2])
            for place in self.places
        ]
        return buf, buf.numpy(), places


def _first_message(
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
                    _copy_into(buf, at + off, t.detach())
        return buf
    buf = torch.empty(size, dtype=torch.uint8)
    arr = buf.numpy()
    arr[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    if at is None:
        arr[len(prefix) :] = 0
    else:
        _write_tensors(arr, buf, len(prefix), at, tensors, offsets)
    return buf


def _write_tensors(
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
            src.dtype in _NUMPY_DTYPES
            and src.device.type == "cpu"
            and src.is_contiguous()
            and not (src.is_conj() or src.is_neg() or src._is_zerotensor())
        ):
            raw = src.numpy().reshape(-1).view(np.uint8)
            arr[start : start + raw.size] = raw
            cursor = start + raw.size
        else:
            cursor = _copy_into(buf, start, src)
    arr[cursor:] = 0


# dtypes numpy can view (the others, bfloat16 and float8, are copied by torch)
_NUMPY_DTYPES = frozenset(
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


def _copy_into(buf: torch.Tensor, start: int, t: torch.Tensor) -> int:
    """Copy ``t`` into ``buf``'s bytes from ``start`` (resolving conj/neg bits
    and strides); returns where it ends."""
    end = start + t.numel() * t.element_size()
    buf[start:end].view(t.dtype).view(t.shape).copy_(t)
    return end


# -- receive ----------------------------------------------------------------


class PostedRecv:
    """The receive of the channel's next message's first part, posted ahead
    by :func:`post_recv`; hand it to :func:`recv_pytree` (``posted=``)."""

    __slots__ = ("buf", "group", "lane", "src", "work")

    def __init__(self, src: int, group: Any, lane: int, buf: torch.Tensor, work: Any):
        self.src, self.group, self.lane, self.buf, self.work = src, group, lane, buf, work


def post_recv(
    src: int,
    *,
    group: Any = None,
    what: str = "",
    timeout_s: Optional[float] = None,
    stage: Optional[int] = None,
    microbatch: Optional[int] = None,
    peer_stage: Optional[int] = None,
    lane: int = 0,
) -> PostedRecv:
    """Post the receive of the next message's first part from ``src`` now,
    before it is needed; :func:`recv_pytree` (``posted=``) completes it.
    gloo only (see the module docstring).

    gloo moves a message only into a posted receive: a send that finds none
    announces itself, and its bytes leave when the receiver's reply reaches
    the sender's network thread, while a send that finds one writes at once.
    Post one per channel at a time, once the channel's previous message was
    received whole, and only when a message will come: gloo cannot take a
    posted receive back. The labels are :func:`recv_pytree`'s, for fault
    messages."""
    ch = _channel("recv", src, group, lane)
    buf = torch.empty(ch.first, dtype=torch.uint8, device=ch.comm)
    try:
        work = dist.irecv(buf, src=src, group=group, tag=ch.tag)
    except Exception as exc:
        labels = (what, stage, microbatch, src, peer_stage, timeout_s)
        raise _failure(exc, "post recv", labels) from exc
    return PostedRecv(src, group, lane, buf, work)


def _receive(nbytes: int, src: int, group: Any, ch: _Channel, labels: Labels) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8, device=ch.comm)
    try:
        work = dist.irecv(buf, src=src, group=group, tag=ch.tag)
    except Exception as exc:
        raise _failure(exc, "recv", labels) from exc
    _wait(work, ch.backend, "recv", labels)
    return buf


def recv_pytree(
    src: int,
    *,
    group: Any = None,
    device: Optional[torch.device] = None,
    what: str = "",
    timeout_s: Optional[float] = None,
    stage: Optional[int] = None,
    microbatch: Optional[int] = None,
    peer_stage: Optional[int] = None,
    tagged: bool = False,
    posted: Optional[PostedRecv] = None,
    lane: int = 0,
) -> Any:
    """Receive one object sent by :func:`send_pytree` from global rank ``src``
    (blocking, with the timeout). Tensors land on ``device`` (default: the comm
    device: CUDA under NCCL, CPU under gloo), as do ``torch.device`` leaves.
    ``tagged``: return ``(tag, obj)``, the tag None when the sender gave none.
    ``posted``: the receive :func:`post_recv` posted ahead for this message
    (the channel's next: nothing else is received from ``src`` in ``group``
    between the two calls). ``lane``: the sender's (see the module docstring).

    RankFailure if ``src`` (or a rank before it) fails or hangs; PipelineError
    if the message is not what the protocol promises."""
    ch = _channel("recv", src, group, lane)
    comm = ch.comm
    target = comm if device is None else torch.device(device)
    labels = (what, stage, microbatch, src, peer_stage, timeout_s)

    def reject(reason: str) -> PipelineError:
        return _rejected(reason, labels)

    size = ch.first
    if posted is None:
        first = _receive(size, src, group, ch, labels)
    else:
        if posted.src != src or posted.group is not group or posted.lane != lane:
            raise PipelineError(
                f"recv_pytree from rank {src} was given a receive posted for rank {posted.src}"
                + (" in another group" if posted.group is not group else "")
                + (f" on lane {posted.lane}, not {lane}" if posted.lane != lane else "")
            )
        if posted.buf.numel() != size or posted.work is None:
            raise PipelineError(
                f"recv_pytree from rank {src} was given a receive posted for another message"
                " of the channel (post_recv once per message, after the previous one)"
            )
        first, work = posted.buf, posted.work
        posted.work = None  # consumed
        _wait(work, ch.backend, "recv", labels)
    words = PREAMBLE.unpack_from(
        cast(Any, first.numpy() if comm.type == "cpu" else _host(first[: PREAMBLE.size]))
    )
    if words[:4] == ch.expect and (device is None or device == comm):
        # steady: the header checked when it came, the payload inline
        obj = ch.rebuild(_views(first, ch.inline))
        return ((words[5:] if words[4] else None), obj) if tagged else obj
    magic, version, hlen, plen, has_tag = words[:5]
    if magic != MAGIC:
        raise reject(
            f"bad preamble: expected magic {MAGIC:#x}, received {magic & (2**64 - 1):#x}"
            " (the sender is not send_pytree, or sends and receives are out of order)"
        )
    if version != VERSION:
        raise reject(f"protocol version mismatch: expected {VERSION}, received {version}")
    if not (hlen == 0 or 2 <= hlen <= MAX_HEADER_BYTES):
        raise reject(f"header length {hlen} is outside 2..{MAX_HEADER_BYTES} bytes")
    if not 0 <= plen <= MAX_PAYLOAD_BYTES:
        raise reject(f"payload length {plen} is outside 0..{MAX_PAYLOAD_BYTES} bytes")

    if hlen == 0:  # the channel's previous header, parsed and checked then
        if ch.parsed is None:
            raise reject("the sender repeats a previous header but none came on this channel")
        tree, metas, offsets, total = ch.parsed
    else:
        receive = functools.partial(_receive, src=src, group=group, ch=ch, labels=labels)
        tree, metas, offsets, total = _parse_header(first, hlen, size, receive, reject)
    if total != plen:
        raise reject(
            f"the header's tensors take {total} payload bytes but the preamble says {plen}"
        )

    at = _inline_payload_at(hlen, plen, size) if hlen <= size - PREAMBLE.size else None
    # the payload's bytes: in the first message from ``at`` (no copy), or received next
    payload = first
    if plen and at is None:
        payload, at = _receive(plen, src, group, ch, labels), 0
    base = payload.storage_offset() + (at or 0)
    if hlen:  # checked: the channel's header from now on
        ch.parsed, ch.hlen = (tree, metas, offsets, total), hlen
        ch.views = [
            (DTYPES[dtype_name], tuple(shape), _contiguous_strides(shape), requires_grad, off)
            for (dtype_name, shape, requires_grad), off in zip(metas, offsets)
        ]
        ch.rebuild = None  # until unflatten accepted the tree once
    ch.first = _next_first(ch.hlen, plen)
    ch.expect = None
    tensors = []
    storage = payload.untyped_storage()  # (read only where a tensor has bytes: plen > 0)
    for dtype, shape, strides, requires_grad, off in ch.views:
        if off is None:
            t = torch.empty(shape, dtype=dtype, device=target)
        else:
            # A fresh tensor on the buffer's storage: its own version counter.
            t = torch.empty(0, dtype=dtype, device=comm)
            t.set_(storage, (base + off) // dtype.itemsize, shape, strides)
            if target != comm:
                t = t.to(target)
        tensors.append(t.requires_grad_() if requires_grad else t)
    if ch.rebuild is not None:
        obj = ch.rebuild(tensors)
    else:
        try:
            obj = unflatten(tree, tensors, device=target)
        except PipelineError as err:
            raise reject(str(err)) from None
        ch.rebuild = rebuilder(tree)  # the tree is checked: rebuild it directly from now on
    if ch.rebuild is not None and PREAMBLE.size + total <= ch.first:
        # the next message like this one is steady: its payload inline in the
        # first message (what the sender's steady path sends), its views from
        # the buffer's start
        ch.expect = (MAGIC, VERSION, 0, total)
        ch.inline = [
            (dtype, shape, strides, requires_grad, None if off is None else PREAMBLE.size + off)
            for dtype, shape, strides, requires_grad, off in ch.views
        ]
    if not tagged:
        return obj
    return (tuple(words[5:]) if has_tag else None), obj


def _views(buf: torch.Tensor, views: list) -> list[torch.Tensor]:
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


def _contiguous_strides(shape: list) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _rejected(reason: str, labels: Labels) -> PipelineError:
    """The error for a message that is not what the protocol promises,
    reported to the fault store first (the sender then names this rank)."""
    what, stage, microbatch, src = labels[:4]
    label = f" ({what})" if what else ""
    message = f"recv_pytree from rank {src}{label}: {reason}"
    me = dist.get_rank()
    report_failure(
        me, stage, _op("recv", what), microbatch, f"PipelineError: {message}", reporter=me
    )
    return PipelineError(
        message + "\n  Both ranks must run the same annot version and post their sends and"
        " receives between them in the same order (from one thread)."
    )


def _host(buf: torch.Tensor) -> Any:
    """A buffer-protocol view (CPU) or copy (other devices) of ``buf``'s bytes."""
    return buf.numpy() if buf.device.type == "cpu" else buf.cpu().numpy()


def _parse_header(first, hlen: int, size: int, receive, reject) -> tuple:
    """The header of ``hlen`` bytes (inline in ``first`` or received next),
    checked: ``(tree, metas, offsets, payload bytes)``."""
    if hlen <= size - PREAMBLE.size:
        raw = _host(first[PREAMBLE.size : PREAMBLE.size + hlen]).tobytes()
    else:
        raw = _host(receive(hlen)).tobytes()
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise reject(f"the {hlen}-byte header is not valid UTF-8 JSON ({err})") from None
    try:
        metas = _check_header(header)
    except Malformed as bad:
        raise reject(f"malformed header: {bad}") from None
    offsets, total = _layout(metas)
    return header["tree"], metas, offsets, total


def _inline_payload_at(hlen: int, plen: int, size: int) -> Optional[int]:
    """Where a payload of ``plen`` bytes sits inside a first message of ``size``
    bytes after a ``hlen``-byte header (16-byte aligned), or None when it does
    not fit."""
    at = -(-(PREAMBLE.size + hlen) // ALIGN) * ALIGN
    return at if plen and at + plen <= size else None


def _check_header(header: Any) -> list:
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
        if _numel(shape) * dtype.itemsize > MAX_PAYLOAD_BYTES:
            raise Malformed(f"tensor {i}: shape {shape} is larger than the payload limit")
    return metas
