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

The wire format (preamble, header, payload; steady transfers in one message)
and the checks of what arrives are :mod:`annot.runtime.pipeline.p2p_wire`.

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

Received tensors are views of the payload buffer with their own version
counters (in-place ops on one do not disturb autograd on another), contiguous,
on the receiver's device, with ``requires_grad`` as sent. Sends and receives
between two ranks must be posted in the same order on both sides, from one
thread. gloo and NCCL: the comm device is CUDA for NCCL (header included, as
NCCL moves only device tensors), CPU otherwise; tensors on other devices are
copied to it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from annot.core.errors import PipelineError, RankFailure
from annot.runtime.faults import failures as faults
from annot.runtime.faults.comm_wait import wait_work
from annot.runtime.faults.store import connect_store, report_failure
from annot.runtime.pipeline.p2p_codec import (
    DTYPES,
    matcher,
    rebuilder,
    simple_signature,
    unflatten,
)
from annot.runtime.pipeline.p2p_wire import (
    FIRST_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    PREAMBLE,
    VERSION,
    contiguous_strides,
    encode_header,
    first_message,
    host_bytes,
    inline_payload_at,
    next_first,
    numel,
    pack_payload,
    parse_header,
    steady_views,
)

__all__ = ["Handle", "PostedRecv", "post_recv", "recv_pytree", "send_pytree"]


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


def reset_channels() -> None:
    """Forget the channel sizes and headers (both ends must do it at the same
    point), and each channel's comm device and backend (after a new process
    group), with their pooled send buffers."""
    _CHANNELS.clear()


# -- layout -----------------------------------------------------------------


def _comm(group: Any) -> tuple[torch.device, str]:
    backend = str(dist.get_backend(group))
    if "nccl" in backend.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), backend
    return torch.device("cpu"), backend


# -- send -------------------------------------------------------------------


def _op(verb: str, what: str) -> str:
    return f"{verb} {what}" if what else verb


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
    encoded = encode_header(obj, what, dst, None) if simple is None else None  # refused here
    ch = _channel("send", dst, group, lane)
    comm, size = ch.comm, ch.first
    raw, tensors, offsets, total = encoded or encode_header(obj, what, dst, simple)
    # The first message: the preamble, the header when it is new and fits, and
    # the payload too when that also fits (steady shapes: one message a
    # transfer, the tensors copied straight into it). Its size is what both
    # ends agreed from the channel's previous transfer.
    wire = b"" if raw == ch.header else raw  # empty: "the previous header"
    inline = len(wire) <= size - PREAMBLE.size
    prefix = PREAMBLE.pack(MAGIC, VERSION, len(wire), total, *tagged) + (wire if inline else b"")
    at = inline_payload_at(len(wire), total, size) if inline else None
    pre = first_message(prefix, size, comm, at, tensors, offsets)
    bufs = [pre]
    if at is None:
        if not inline:
            bufs.append(torch.frombuffer(bytearray(wire), dtype=torch.uint8).to(comm))
        payload = pack_payload(tensors, offsets, total, comm)
        if payload is not None:
            bufs.append(payload)
    ch.first, ch.header = next_first(len(raw), total), raw
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
            else buf[place[0] : place[0] + place[1].itemsize * numel(place[2])]
            .view(place[1])
            .view(place[2])
            for place in self.places
        ]
        return buf, buf.numpy(), places


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
    first = _first_part(src, group, lane, ch, labels, posted)
    words = PREAMBLE.unpack_from(
        cast(Any, first.numpy() if comm.type == "cpu" else host_bytes(first[: PREAMBLE.size]))
    )
    if words[:4] == ch.expect and (device is None or device == comm):
        # steady: the header checked when it came, the payload inline
        obj = ch.rebuild(steady_views(first, ch.inline))
    else:
        obj = _unpack(first, words, src, group, ch, labels, target)
    if not tagged:
        return obj
    return (tuple(words[5:]) if words[4] else None), obj


def _first_part(
    src: int, group: Any, lane: int, ch: _Channel, labels: Labels, posted: Optional[PostedRecv]
) -> torch.Tensor:
    """The message's first part: received now, or by the receive posted ahead."""
    if posted is None:
        return _receive(ch.first, src, group, ch, labels)
    if posted.src != src or posted.group is not group or posted.lane != lane:
        raise PipelineError(
            f"recv_pytree from rank {src} was given a receive posted for rank {posted.src}"
            + (" in another group" if posted.group is not group else "")
            + (f" on lane {posted.lane}, not {lane}" if posted.lane != lane else "")
        )
    if posted.buf.numel() != ch.first or posted.work is None:
        raise PipelineError(
            f"recv_pytree from rank {src} was given a receive posted for another message"
            " of the channel (post_recv once per message, after the previous one)"
        )
    first, work = posted.buf, posted.work
    posted.work = None  # consumed
    _wait(work, ch.backend, "recv", labels)
    return first


def _check_preamble(words: tuple, reject) -> None:
    magic, version, hlen, plen = words[:4]
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


def _unpack(
    first: torch.Tensor, words: tuple, src: int, group: Any, ch: _Channel, labels: Labels, target
) -> Any:
    """A message that is not the channel's steady one: preamble and header
    checked, the payload taken from the first part or received next, the
    tensors made on ``target``; the channel remembers what the next may reuse."""

    def reject(reason: str) -> PipelineError:
        return _rejected(reason, labels)

    _check_preamble(words, reject)
    hlen, plen = words[2], words[3]
    size = ch.first
    if hlen == 0:  # the channel's previous header, parsed and checked then
        if ch.parsed is None:
            raise reject("the sender repeats a previous header but none came on this channel")
        tree, metas, offsets, total = ch.parsed
    else:
        receive = functools.partial(_receive, src=src, group=group, ch=ch, labels=labels)
        tree, metas, offsets, total = parse_header(first, hlen, size, receive, reject)
    if total != plen:
        raise reject(
            f"the header's tensors take {total} payload bytes but the preamble says {plen}"
        )
    at = inline_payload_at(hlen, plen, size) if hlen <= size - PREAMBLE.size else None
    # the payload's bytes: in the first message from ``at`` (no copy), or received next
    payload = first
    if plen and at is None:
        payload, at = _receive(plen, src, group, ch, labels), 0
    if hlen:  # checked: the channel's header from now on
        ch.parsed, ch.hlen = (tree, metas, offsets, total), hlen
        ch.views = [
            (DTYPES[dtype_name], tuple(shape), contiguous_strides(shape), requires_grad, off)
            for (dtype_name, shape, requires_grad), off in zip(metas, offsets)
        ]
        ch.rebuild = None  # until unflatten accepted the tree once
    ch.first = next_first(ch.hlen, plen)
    ch.expect = None
    base = int(payload.storage_offset()) + (at or 0)
    tensors = _payload_tensors(ch.views, payload, base, target)
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
    return obj


def _payload_tensors(views: list, payload: torch.Tensor, base: int, target) -> list:
    """Each tensor of the message: a fresh tensor on the payload's storage (its
    own version counter) at ``base`` + its offset, moved to ``target``; new and
    empty where it has no bytes."""
    comm = payload.device
    storage = payload.untyped_storage()  # (read only where a tensor has bytes)
    tensors = []
    for dtype, shape, strides, requires_grad, off in views:
        if off is None:
            t = torch.empty(shape, dtype=dtype, device=target)
        else:
            t = torch.empty(0, dtype=dtype, device=comm)
            t.set_(storage, (base + off) // dtype.itemsize, shape, strides)
            if target != comm:
                t = t.to(target)
        tensors.append(t.requires_grad_() if requires_grad else t)
    return tensors


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
