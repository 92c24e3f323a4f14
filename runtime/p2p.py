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
(skipping pairs whose gradient is None).

Wire format: one message is one to three sends on the pair, in this order:

1. preamble, ``uint8[size]``: ``int64[4] = [MAGIC, VERSION, header bytes,
   payload bytes]`` followed by the header itself when it fits in the rest
   (the usual case), and by the payload too when that also fits. It is the
   only message the receiver posts blind. Its size is 4 KiB for a channel's
   first transfer, then whatever the previous transfer on that channel needed
   (rounded up to 4 KiB, at most 8 MiB): both ends compute it from the sizes of
   the previous transfer, so with steady shapes a transfer is one message;
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
posted. A bad message raises :class:`annot.errors.PipelineError` naming the
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
import dataclasses
import json
import struct
import sys
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from annot.errors import PipelineError
from annot.runtime import faults

__all__ = ["Handle", "flatten", "recv_pytree", "send_pytree", "tensors_requiring_grad", "unflatten"]

MAGIC = int.from_bytes(b"annotP2P", "big")
VERSION = 2
# Size of the first message of a transfer (preamble + header when it fits).
FIRST_BYTES = 4096
# The first message grows to fit what the channel carried last (both sides
# compute the same size from the previous transfer), up to this bound.
MAX_FIRST_BYTES = 8 << 20
_CHANNELS: dict[tuple, int] = {}


def _channel(direction: str, peer: int, group: Any) -> tuple:
    return (direction, peer, id(group) if group is not None else 0)


def _next_first(hlen: int, plen: int) -> int:
    """The first-message size both ends use for the channel's next transfer:
    enough for this one's header and payload (steady shapes: one message)."""
    need = -(-(32 + hlen) // ALIGN) * ALIGN + plen
    return min(MAX_FIRST_BYTES, max(FIRST_BYTES, -(-need // FIRST_BYTES) * FIRST_BYTES))


def reset_channels() -> None:
    """Forget the channel sizes (both ends must do it at the same point)."""
    _CHANNELS.clear()


ALIGN = 16
MAX_HEADER_BYTES = 16 << 20
MAX_PAYLOAD_BYTES = 1 << 40

_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex128 complex64 complex32 bool"
    " int8 int16 int32 int64 uint8 uint16 uint32 uint64"
    " float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu"
)
# Byte-addressable dtypes only (no quantized, bit or sub-byte shells).
_DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES.split() if hasattr(torch, n)}
_SUPPORTED = (
    "tensors, None, bool, int, float, str, torch.dtype, torch.device, torch.Size, slices"
    " of ints, Ellipsis, and tuples, lists, dicts (str or int keys), namedtuples and dataclasses of those"
)


# -- flatten / unflatten ----------------------------------------------------


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _type_ref(cls: type) -> Optional[str]:
    """``module:qualname`` if the class can be found again by that name."""
    return (
        f"{cls.__module__}:{cls.__qualname__}"
        if _lookup(cls.__module__, cls.__qualname__) is cls
        else None
    )


def _lookup(module: str, qualname: str) -> Any:
    """Find an already imported class by name (never imports anything)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part.startswith("<"):
            return None
        obj = getattr(obj, part, None)
    return obj


def _hint(x: Any) -> str:
    if isinstance(x, (set, frozenset)):
        return " Sort it into a list or tuple."
    if isinstance(x, np.ndarray) or type(x).__module__ == "numpy":
        return " Convert it with torch.from_numpy(...) or .item()."
    if isinstance(x, torch.Tensor):
        return " Send a plain dense tensor (.to_dense(), .full_tensor(), .to_local())."
    if callable(x):
        return " Code never crosses a process boundary: compute it on the stage that uses it."
    return " Convert it to those types before the boundary, or keep it on one stage."


def _unsupported(x: Any, path: str, why: str = "") -> PipelineError:
    why = why or f"a pipeline boundary carries only {_SUPPORTED}."
    return PipelineError(f"cannot send {path} of type {_type_name(x)}: {why}{_hint(x)}")


def flatten(obj: Any, *, root: str = "obj") -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into a JSON-able structure and its tensors (depth first,
    dicts in insertion order, dataclass fields in declaration order): the
    inverse of :func:`unflatten`. Raises PipelineError naming the path of the
    first value that cannot cross a pipeline boundary (e.g. ``obj['cache'][1]``)."""
    tensors: list[torch.Tensor] = []
    tree = _flatten(obj, root, tensors, set())
    return tree, tensors


def _flatten(x: Any, path: str, tensors: list, active: set) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
            raise _unsupported(x, path, "only plain dense (strided) tensors can be sent.")
        if x.dtype not in _DTYPES.values():
            raise _unsupported(x, path, f"dtype {x.dtype} cannot be sent (quantized or sub-byte).")
        if x.is_meta:
            raise _unsupported(x, path, "a meta tensor has no data to send.")
        tensors.append(x)
        return {"k": "T", "i": len(tensors) - 1}
    if x is None or type(x) in (bool, int, str, float):
        return x
    if isinstance(x, torch.dtype):
        return {"k": "dtype", "v": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"k": "device", "v": str(x)}
    if type(x) is torch.Size:
        return {"k": "size", "v": list(x)}
    if type(x) is slice and all(v is None or type(v) is int for v in (x.start, x.stop, x.step)):
        return {"k": "slice", "v": [x.start, x.stop, x.step]}
    if x is Ellipsis:
        return {"k": "ellipsis"}
    if id(x) in active:
        raise _unsupported(x, path, "it contains itself (a reference cycle).")
    active.add(id(x))
    try:
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):
            ref = _type_ref(type(x))
            if ref is None:
                raise _unsupported(
                    x,
                    path,
                    "the receiver cannot find this namedtuple class by name; define it at module level.",
                )
            return {
                "k": "nt",
                "type": ref,
                "v": [_flatten(v, f"{path}.{f}", tensors, active) for f, v in zip(x._fields, x)],
            }
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            ref = _type_ref(type(x))
            if ref is None:
                raise _unsupported(
                    x,
                    path,
                    "the receiver cannot find this dataclass by name; define it at module level.",
                )
            return {
                "k": "dc",
                "type": ref,
                "v": [
                    [f.name, _flatten(getattr(x, f.name), f"{path}.{f.name}", tensors, active)]
                    for f in dataclasses.fields(x)
                ],
            }
        if type(x) in (tuple, list):
            kind = "tuple" if type(x) is tuple else "list"
            return {
                "k": kind,
                "v": [_flatten(v, f"{path}[{i}]", tensors, active) for i, v in enumerate(x)],
            }
        if type(x) in (dict, collections.OrderedDict):
            items = []
            for key, v in x.items():
                if type(key) not in (str, int):
                    raise _unsupported(
                        key, f"key {key!r} of {path}", "dict keys must be str or int."
                    )
                items.append([key, _flatten(v, f"{path}[{key!r}]", tensors, active)])
            return {"k": "dict" if type(x) is dict else "odict", "v": items}
    finally:
        active.discard(id(x))
    raise _unsupported(x, path)


class _Bad(Exception):
    """A received structure is malformed (turned into a PipelineError)."""


def unflatten(tree: Any, tensors: list, *, device: Optional[torch.device] = None) -> Any:
    """Rebuild the object from :func:`flatten`'s output. ``torch.device`` leaves
    become ``device`` (default: torch's default device): a device never crosses
    as-is. Validates the structure (it may come from the network)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    used = [0] * len(tensors)
    try:
        obj = _unflatten(tree, tensors, device, used)
    except RecursionError:
        raise PipelineError("the structure is nested too deeply to rebuild") from None
    except _Bad as bad:
        raise PipelineError(f"malformed structure: {bad}") from None
    if any(n != 1 for n in used):
        raise PipelineError(f"malformed structure: tensor uses {used} (each must appear once)")
    return obj


def _items(node: dict) -> list:
    v = node.get("v")
    if not isinstance(v, list):
        raise _Bad(f"{node.get('k')!r} node without a list of values")
    return v


def _resolve_type(node: dict, want: str) -> type:
    ref = node.get("type")
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise _Bad(f"bad type reference {ref!r}")
    module, qualname = ref.split(":")
    cls = _lookup(module, qualname)
    ok = isinstance(cls, type) and (
        (want == "nt" and issubclass(cls, tuple) and hasattr(cls, "_fields"))
        or (want == "dc" and dataclasses.is_dataclass(cls))
    )
    if not ok:
        raise _Bad(
            f"class {ref} is not a loaded {'namedtuple' if want == 'nt' else 'dataclass'} on"
            f" this rank; import {module} on every rank before the pipeline runs"
        )
    return cls


def _unflatten(node: Any, tensors: list, device: torch.device, used: list) -> Any:
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is not dict:
        raise _Bad(f"unexpected {type(node).__name__} node")
    kind = node.get("k")

    def rec(n: Any) -> Any:
        return _unflatten(n, tensors, device, used)

    if kind == "T":
        i = node.get("i")
        if type(i) is not int or not 0 <= i < len(tensors):
            raise _Bad(f"tensor index {i!r} out of range (0..{len(tensors) - 1})")
        used[i] += 1
        return tensors[i]
    if kind == "dtype":
        dt = _DTYPES.get(node.get("v"))
        if dt is None:
            raise _Bad(f"unknown dtype {node.get('v')!r}")
        return dt
    if kind == "device":
        return device
    if kind == "size":
        v = _items(node)
        if not all(type(d) is int for d in v):
            raise _Bad("torch.Size with non-int entries")
        return torch.Size(v)
    if kind == "slice":
        v = _items(node)
        if len(v) != 3 or not all(d is None or type(d) is int for d in v):
            raise _Bad("slice with entries other than three ints or None")
        return slice(*v)
    if kind == "ellipsis":
        return Ellipsis
    if kind in ("tuple", "list"):
        values = [rec(v) for v in _items(node)]
        return tuple(values) if kind == "tuple" else values
    if kind in ("dict", "odict"):
        out = {} if kind == "dict" else collections.OrderedDict()
        for pair in _items(node):
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                raise _Bad("dict item is not a [str|int key, value] pair")
            out[pair[0]] = rec(pair[1])
        return out
    if kind == "nt":
        cls = _resolve_type(node, "nt")
        values = [rec(v) for v in _items(node)]
        if len(values) != len(cls._fields):
            raise _Bad(f"{cls.__qualname__} has {len(cls._fields)} fields, received {len(values)}")
        return cls._make(values)
    if kind == "dc":
        cls = _resolve_type(node, "dc")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for pair in _items(node):
            if not (isinstance(pair, list) and len(pair) == 2 and pair[0] in fields):
                raise _Bad(f"{cls.__qualname__} has no field {pair!r:.60}")
            values[pair[0]] = rec(pair[1])
        if set(values) != set(fields):
            raise _Bad(f"{cls.__qualname__} fields {sorted(fields)} != received {sorted(values)}")
        obj = cls(**{k: v for k, v in values.items() if fields[k].init})
        for k, v in values.items():
            if not fields[k].init:
                object.__setattr__(obj, k, v)
        return obj
    raise _Bad(f"unknown node kind {kind!r}")


def tensors_requiring_grad(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` with ``requires_grad``, in :func:`flatten` order:
    the same order on the sending and the receiving stage, so gradients sent
    back as a list line up with the tensors that produced them."""
    return [t for t in flatten(obj)[1] if t.requires_grad]


# -- layout -----------------------------------------------------------------


def _layout(metas: list) -> tuple[list[Optional[int]], int]:
    """Byte offset of each tensor in the payload (None for empty ones) and the
    payload size; the same rule on both sides."""
    offsets: list[Optional[int]] = []
    cursor = 0
    for dtype_name, shape, _ in metas:
        nbytes = _DTYPES[dtype_name].itemsize * _numel(shape)
        if nbytes == 0:
            offsets.append(None)
            continue
        cursor = -(-cursor // ALIGN) * ALIGN
        offsets.append(cursor)
        cursor += nbytes
    return offsets, cursor


def _numel(shape: list) -> int:
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
        raw = _bytes(t.detach().contiguous())
        buf[off : off + raw.numel()].copy_(raw)
    return buf


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


# -- send -------------------------------------------------------------------


def _op(verb: str, what: str) -> str:
    return f"{verb} {what}" if what else verb


class Handle:
    """An asynchronous send: keeps its buffers alive until :meth:`wait`. A lone
    contiguous tensor is sent from its own memory: do not modify it in place
    before ``wait()``."""

    def __init__(self, works: list, keep: tuple, guard_kwargs: dict, backend: str):
        self._works = works
        self._keep = keep
        self._guard = guard_kwargs
        self._backend = backend

    def is_completed(self) -> bool:
        """True once every send finished (gloo reports completion only after
        :meth:`wait`)."""
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Block until the message is sent; RankFailure if the peer fails or does
        not receive it within the timeout. Idempotent."""
        kwargs = dict(self._guard)
        if timeout_s is not None:
            kwargs["timeout_s"] = timeout_s
        with faults.guard(**kwargs) as timeout:
            while self._works:
                faults.wait_work(self._works[0], timeout, backend=self._backend)
                self._works.pop(0)
        self._keep = ()


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
) -> Handle:
    """Start sending ``obj`` to global rank ``dst``; returns a :class:`Handle`
    to ``wait()`` on. ``what`` labels the message in errors (``"activations"``);
    ``stage``/``microbatch``/``peer_stage`` name this rank's stage, the
    microbatch and the destination's stage in fault messages, which read
    ``... waited in send activations of microbatch 3``: keep ``what`` short and
    pass the microbatch separately.

    Unsupported values raise PipelineError before anything is sent; a peer that
    fails or hangs raises RankFailure (here or in ``wait()``)."""
    where = f" ({_op('send', what)} to rank {dst})"
    try:
        tree, tensors = flatten(obj)
    except PipelineError as err:
        raise PipelineError(f"{err}{where}") from None
    comm, backend = _comm(group)
    metas = [
        [str(t.dtype).removeprefix("torch."), list(t.shape), bool(t.requires_grad)] for t in tensors
    ]
    header = {"v": VERSION, "what": what, "tree": tree, "tensors": metas}
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise PipelineError(
            f"the header of {what or 'this message'} is {len(raw)} bytes, over the"
            f" {MAX_HEADER_BYTES}-byte limit{where}: send fewer, larger tensors or plain values"
        )
    offsets, total = _layout(metas)
    payload = _pack(tensors, offsets, total, comm)
    # The first message: 4 int64 words, the header when it fits, and the payload
    # too when that also fits (steady shapes: one message a transfer). Its size
    # is what both ends agreed from the channel's previous transfer.
    key = _channel("send", dst, group)
    size = _CHANNELS.get(key, FIRST_BYTES)
    inline = len(raw) <= size - 32
    prefix = struct.pack("<4q", MAGIC, VERSION, len(raw), total) + (raw if inline else b"")
    pre = torch.empty(size, dtype=torch.uint8, device=comm)
    pre[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    head = None
    if inline:
        at = _inline_payload_at(len(raw), total, size)
        if at is not None and payload is not None:
            pre[at : at + total].copy_(payload)
            payload = None
    else:
        head = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(comm)
    _CHANNELS[key] = _next_first(len(raw), total)
    guard_kwargs = dict(
        op=_op("send", what),
        stage=stage,
        microbatch=microbatch,
        peer=dst,
        peer_stage=peer_stage,
        timeout_s=timeout_s,
    )
    bufs = [b for b in (pre, head, payload) if b is not None]
    with faults.guard(**guard_kwargs):
        works = [dist.isend(b, dst=dst, group=group) for b in bufs]
    return Handle(works, tuple(bufs), guard_kwargs, backend)


# -- receive ----------------------------------------------------------------


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
) -> Any:
    """Receive one object sent by :func:`send_pytree` from global rank ``src``
    (blocking, with the timeout). Tensors land on ``device`` (default: the comm
    device: CUDA under NCCL, CPU under gloo), as do ``torch.device`` leaves.

    RankFailure if ``src`` (or a rank before it) fails or hangs; PipelineError
    if the message is not what the protocol promises."""
    comm, backend = _comm(group)
    target = comm if device is None else torch.device(device)
    op = _op("recv", what)
    guard_kwargs = dict(op=op, stage=stage, microbatch=microbatch, peer=src, peer_stage=peer_stage)

    def receive(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=dtype, device=comm)
        with faults.guard(timeout_s=timeout_s, **guard_kwargs) as timeout:
            faults.wait_work(dist.irecv(buf, src=src, group=group), timeout, backend=backend)
        return buf

    def reject(reason: str) -> PipelineError:
        label = f" ({what})" if what else ""
        message = f"recv_pytree from rank {src}{label}: {reason}"
        me = dist.get_rank()
        faults.report_failure(me, stage, op, microbatch, f"PipelineError: {message}", reporter=me)
        return PipelineError(
            message + "\n  Both ranks must run the same annot version and post their sends and"
            " receives between them in the same order (from one thread)."
        )

    key = _channel("recv", src, group)
    size = _CHANNELS.get(key, FIRST_BYTES)
    first = receive(size, torch.uint8)
    magic, version, hlen, plen = struct.unpack("<4q", first[:32].cpu().numpy().tobytes())
    if magic != MAGIC:
        raise reject(
            f"bad preamble: expected magic {MAGIC:#x}, received {magic & (2**64 - 1):#x}"
            " (the sender is not send_pytree, or sends and receives are out of order)"
        )
    if version != VERSION:
        raise reject(f"protocol version mismatch: expected {VERSION}, received {version}")
    if not 2 <= hlen <= MAX_HEADER_BYTES:
        raise reject(f"header length {hlen} is outside 2..{MAX_HEADER_BYTES} bytes")
    if not 0 <= plen <= MAX_PAYLOAD_BYTES:
        raise reject(f"payload length {plen} is outside 0..{MAX_PAYLOAD_BYTES} bytes")

    if hlen <= size - 32:
        raw = first[32 : 32 + hlen].cpu().numpy().tobytes()
    else:
        raw = receive(hlen, torch.uint8).cpu().numpy().tobytes()
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise reject(f"the {hlen}-byte header is not valid UTF-8 JSON ({err})") from None
    try:
        metas = _check_header(header)
    except _Bad as bad:
        raise reject(f"malformed header: {bad}") from None
    offsets, total = _layout(metas)
    if total != plen:
        raise reject(
            f"the header's tensors take {total} payload bytes but the preamble says {plen}"
        )

    at = _inline_payload_at(hlen, plen, size) if hlen <= size - 32 else None
    if plen and at is not None:
        payload = first[at : at + plen]  # a view: no copy
    else:
        payload = receive(plen, torch.uint8) if plen else None
    _CHANNELS[key] = _next_first(hlen, plen)
    tensors = []
    for (dtype_name, shape, requires_grad), off in zip(metas, offsets):
        dtype = _DTYPES[dtype_name]
        if off is None:
            t = torch.empty(shape, dtype=dtype, device=target)
        else:
            # A fresh tensor on the buffer's storage: its own version counter.
            t = torch.empty(0, dtype=dtype, device=comm)
            base = (
                payload.storage_offset() + off
            )  # bytes (the payload may sit in the first message)
            t.set_(payload.untyped_storage(), base // dtype.itemsize, shape)
            if target != comm:
                t = t.to(target)
        tensors.append(t.requires_grad_(requires_grad))
    try:
        return unflatten(header["tree"], tensors, device=target)
    except PipelineError as err:
        raise reject(str(err)) from None


def _inline_payload_at(hlen: int, plen: int, size: int) -> Optional[int]:
    """Where a payload of ``plen`` bytes sits inside a first message of ``size``
    bytes after a ``hlen``-byte header (16-byte aligned), or None when it does
    not fit."""
    at = -(-(32 + hlen) // ALIGN) * ALIGN
    return at if plen and at + plen <= size else None


def _check_header(header: Any) -> list:
    if not isinstance(header, dict) or header.get("v") != VERSION or "tree" not in header:
        raise _Bad(f"expected an object with v={VERSION} and a tree")
    metas = header.get("tensors")
    if not isinstance(metas, list):
        raise _Bad("no tensor list")
    for i, meta in enumerate(metas):
        if not (isinstance(meta, list) and len(meta) == 3):
            raise _Bad(f"tensor {i}: expected [dtype, shape, requires_grad], received {meta!r:.80}")
        dtype_name, shape, requires_grad = meta
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise _Bad(f"tensor {i}: unknown dtype {dtype_name!r:.40}")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and 0 <= d <= MAX_PAYLOAD_BYTES for d in shape)
        ):
            raise _Bad(f"tensor {i}: bad shape {shape!r:.80}")
        if type(requires_grad) is not bool or (
            requires_grad and not (dtype.is_floating_point or dtype.is_complex)
        ):
            raise _Bad(f"tensor {i}: requires_grad={requires_grad!r} for {dtype_name}")
        if _numel(shape) * dtype.itemsize > MAX_PAYLOAD_BYTES:
            raise _Bad(f"tensor {i}: shape {shape} is larger than the payload limit")
    return metas
