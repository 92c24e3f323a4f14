"""The op recorder behind deferred initialization (:mod:`annot.runtime.init.deferred`).

:class:`Recorder` is the ``TorchDispatchMode`` that ``build()`` runs under:
every new tensor is a meta tensor, every op that gives a storage values is
recorded (storages become versioned histories), random ops also run for
real as they come so the generator advances as in an eager build, and
:meth:`Recorder.value` replays the history a storage's version depends on.
:class:`HideMeta` makes ``t.is_meta`` read False for tensors being built.
A construction that cannot be replayed is refused with
:class:`DeferredInitError` naming the line in ``__init__``.
What the record holds, and which ops do what, is :mod:`annot.runtime.init.ops`.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from annot.core.errors import AnnotError
from annot.runtime.init.ops import (
    EMPTY,
    METADATA_INPLACE,
    OVERWRITE,
    SHAPE_ONLY,
    SNAPSHOT_NUMEL,
    UNSUPPORTED,
    Op,
    Ref,
    Storage,
    adopt,
    bind,
    geometry,
    is_random,
    on_device,
)
from annot.runtime.trees import tensors

__all__ = ["DeferredInitError", "Recorder", "HideMeta"]

_META = torch.device("meta")
_CPU = torch.device("cpu")

_IS_META = torch._C.TensorBase.__dict__["is_meta"]


class DeferredInitError(AnnotError):
    """A model's ``__init__`` does something deferred initialization cannot
    reproduce without building the full model; the message names the line."""


def _user_frame() -> str:
    """``file:line (code)`` of the innermost frame outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f != here and not f.startswith(torch_dir) and "contextlib" not in f:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "<unknown>"


class Recorder(TorchDispatchMode):
    """Meta tensors for ``build()``, a record of every op that gives values,
    random ops run for real as they come, values replayed on demand."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, Storage] = {}  # meta storage address -> record
        self.by_sid: list[Storage] = []
        self.busy = False  # inside __torch_dispatch__ (is_meta tells the truth)

    def record(self, t: torch.Tensor) -> Optional[Storage]:
        if not t.is_meta:
            return None
        return self.storages.get(t.untyped_storage()._cdata)

    def fail(self, what: str) -> DeferredInitError:
        return DeferredInitError(
            f"deferred init: {_user_frame()}: {what}. Deferred initialization builds the "
            "model on the meta device and records its ops; build this model eagerly if "
            "__init__ needs this"
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.busy = True
        try:
            return self.dispatch(func, args, kwargs or {})
        finally:
            self.busy = False

    # ------------------------------------------------------------------ #
    # Recording
    # ------------------------------------------------------------------ #
    def dispatch(self, func, args: tuple, kwargs: dict):
        name = func.overloadpacket.__name__
        inputs = tensors((args, kwargs))
        tracked = [t for t in inputs if self.record(t) is not None]
        if inputs and not tracked:
            if any(t.is_meta for t in inputs):
                raise self.fail(
                    f"{func} got a meta tensor that was not made inside build(); pass real "
                    "tensors (or none) to the model's constructor"
                )
            return func(*args, **kwargs)  # only real tensors from outside: run as is
        if name in UNSUPPORTED:
            raise self.fail(f"{func} changes a storage's size or layout, which cannot be replayed")
        if name in METADATA_INPLACE:
            return func(*args, **kwargs)  # views are re-read from each tensor at every op

        refs, writes, read, pure = self.operands(func, args, kwargs)

        def template(x):
            if isinstance(x, torch.Tensor):
                if id(x) in refs:
                    return refs[id(x)]
                return x.detach().clone() if x.numel() <= SNAPSHOT_NUMEL else x
            return x

        def to_meta(x):
            if isinstance(x, torch.Tensor) and not x.is_meta:
                return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
            if isinstance(x, torch.Generator):
                return None
            return x

        op_args, op_kwargs = tree_map(template, (args, kwargs))
        op = Op(
            func,
            op_args,
            op_kwargs,
            writes=writes,
            pure=frozenset(pure - read),
            creates=(),
            random=is_random(func.overloadpacket),
            empty=name in EMPTY,
            shape_only=name in SHAPE_ONLY,
        )
        sizes = {sid: self.by_sid[sid].meta.nbytes() for sid in writes}
        meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
        meta_args, meta_kwargs = on_device(func, meta_args, meta_kwargs, _META)
        ran = False
        try:
            out = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError):
            # The meta kernel needs values (.item(), data-dependent shapes): run it for real.
            real_out = self.execute(op, {}, first=True)
            out, ran = tree_map(to_meta, real_out), True
        for sid in writes:
            if self.by_sid[sid].meta.nbytes() != sizes[sid]:
                raise self.fail(f"{func} resizes a storage, which cannot be replayed")

        creates = self.new_storages(op, out)
        if not writes and not creates:
            return real_out if ran else out  # a view, metadata, or a value (.item())
        op.creates = tuple(creates)
        for sid in writes:
            self.by_sid[sid].versions.append(op)
        if op.random and not ran:
            self.execute(op, {}, first=True)  # advance the generator as eager does
        return out

    def operands(self, func, args: tuple, kwargs: dict) -> tuple[dict, dict, set, set]:
        """What ``func`` does with the recorded storages it is given: ``(refs``
        to each tensor's version, ``writes`` (storage -> the version it
        writes over), the storages it ``read``s, and those it overwrites
        whole without reading (``pure``)``)``."""
        name = func.overloadpacket.__name__
        refs: dict[int, Ref] = {}
        writes: dict[int, int] = {}
        read: set[int] = set()
        pure: set[int] = set()
        for arg, value in bind(func, args, kwargs):
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tensors(value):
                rec = self.record(t)
                if rec is None:
                    if is_write and not t.is_meta:
                        raise self.fail(
                            f"{func} writes values computed inside build() into a tensor made "
                            "outside it"
                        )
                    continue
                if t.dtype != rec.dtype:
                    raise self.fail(f"{func} views a {rec.dtype} storage as {t.dtype}")
                refs[id(t)] = Ref(rec.sid, len(rec.versions) - 1, geometry(t))
                whole = t.numel() == rec.numel and t.storage_offset() == 0 and t.is_contiguous()
                overwrite = whole and (
                    (name in OVERWRITE and arg.name == "self") or (arg.kwarg_only and is_write)
                )
                if is_write:
                    writes[rec.sid] = len(rec.versions) - 1
                    if overwrite:
                        pure.add(rec.sid)
                if not overwrite:
                    read.add(rec.sid)
        return refs, writes, read, pure

    def new_storages(self, op: Op, out: Any) -> list:
        """Record the storages ``op``'s outputs made: ``(sid, output index,
        geometry, numel)`` each."""
        creates = []
        for i, t in enumerate(tensors(out)):
            if t.is_meta and self.record(t) is None:
                st = t.untyped_storage()
                numel = st.nbytes() // t.element_size()
                rec = Storage(len(self.by_sid), t.dtype, numel, st, [op])
                self.storages[st._cdata] = rec
                self.by_sid.append(rec)
                creates.append((rec.sid, i, geometry(t), numel))
        return creates

    # ------------------------------------------------------------------ #
    # Replay
    # ------------------------------------------------------------------ #
    @contextlib.contextmanager
    def generator_state(self, op: Op, first: bool):
        gens = [g for g in tree_flatten((op.args, op.kwargs))[0] if isinstance(g, torch.Generator)]
        gen = gens[0] if gens else None
        if not op.random:
            yield
        elif first:  # the real run: note where the generators were
            op.rng = torch.get_rng_state()
            op.gen_state = gen.get_state() if gen is not None else None
            yield
        else:  # a replay: rewind, run, put the generators back
            assert op.rng is not None, "replayed before its first run"
            saved, gen_saved = torch.get_rng_state(), gen.get_state() if gen is not None else None
            torch.set_rng_state(op.rng)
            if gen is not None:
                assert op.gen_state is not None  # the first run had this generator too
                gen.set_state(op.gen_state)
            try:
                yield
            finally:
                torch.set_rng_state(saved)
                if gen is not None and gen_saved is not None:
                    gen.set_state(gen_saved)

    def execute(self, op: Op, memo: dict, first: bool = False) -> Any:
        """Run ``op`` for real; put the versions it makes into ``memo``."""
        buffers: dict[int, torch.Tensor] = {}
        used: set[int] = set()  # storages of the inputs, so no output aliases one

        def to_real(x):
            if not isinstance(x, Ref):
                return x
            if op.shape_only and x.sid not in op.writes:
                return torch.empty_strided(x.geom[0], x.geom[1], dtype=self.by_sid[x.sid].dtype)
            if x.sid in op.writes:
                buf = buffers.get(x.sid)
                if buf is None:
                    rec = self.by_sid[x.sid]
                    if x.sid in op.pure:
                        buf = torch.empty(rec.numel, dtype=rec.dtype)
                    else:  # written in place: it stops being version x.ver
                        buf = self.value(x.sid, x.ver, memo)
                        memo.pop((x.sid, x.ver), None)
                    buffers[x.sid] = buf
                    used.add(buf.untyped_storage().data_ptr())
                return buf.as_strided(*x.geom)
            flat = self.value(x.sid, x.ver, memo)
            used.add(flat.untyped_storage().data_ptr())
            return flat.as_strided(*x.geom)

        real_args, real_kwargs = tree_map(to_real, (op.args, op.kwargs))
        args, kwargs = on_device(op.func, real_args, real_kwargs, _CPU)
        if op.empty:  # uninitialised eagerly: zeros here
            real_out = None
            for b in buffers.values():
                b.zero_()
            for sid, _, _, numel in op.creates:
                memo[(sid, 0)] = torch.zeros(numel, dtype=self.by_sid[sid].dtype)
        else:
            with self.generator_state(op, first):
                real_out = op.func(*args, **kwargs)
            flat_out = tensors(real_out)
            for sid, i, geom, numel in op.creates:
                r = flat_out[i]
                if r.untyped_storage().data_ptr() in used:
                    r = r.clone()
                memo[(sid, 0)] = adopt(r, geom, numel)
        for sid, ver in op.writes.items():
            memo[(sid, ver + 1)] = buffers[sid]
        return real_out

    def value(self, sid: int, ver: int, memo: dict) -> torch.Tensor:
        """The full values of version ``ver`` of storage ``sid`` (flat)."""
        if (sid, ver) in memo:
            return memo[(sid, ver)]
        versions = self.by_sid[sid].versions
        start = ver  # walk back to the version this one's in-place chain starts from
        while start > 0 and (sid, start - 1) not in memo and sid not in versions[start].pure:
            start -= 1
        for v in range(start, ver + 1):
            if (sid, v) not in memo:
                self.execute(versions[v], memo)
        return memo[(sid, ver)]


class HideMeta(TorchFunctionMode):
    """``t.is_meta`` is False for tensors being built, as it would be eagerly:
    ``nn.init.orthogonal_`` / ``trunc_normal_`` / ``sparse_`` skip meta tensors."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_META and not self.recorder.busy:
            return func(*args) and self.recorder.record(args[0]) is None
        return func(*args, **(kwargs or {}))
