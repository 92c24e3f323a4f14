"""Deferred initialization: this rank's slice of a model's initial weights,
without ever holding the whole model.

``deferred_reference(build, wanted)`` returns what ``torch.manual_seed(s);
build()`` makes eagerly (bit for bit, with the global CPU generator left in
the same state), but keeps only ``wanted(name)(full_tensor)`` of each
parameter, buffer and tensor attribute::

    torch.manual_seed(0)
    ref, values = deferred_reference(lambda: GPT(cfg), wanted)
    # ref: the model on the meta device (names, shapes, ties; no memory)
    # values: {"h.0.mlp.c_fc.weight": this rank's slice, ...}

How. ``build()`` runs once under a ``TorchDispatchMode`` that makes every new
tensor a meta tensor and *records* each op that gives a storage values: its
function, its arguments (tensors as ``(storage, version, view)``), which
storages it writes or creates. Storages are thus versioned histories.

1. Random ops (any op with a ``generator`` argument) are also executed for
   real, on CPU tensors of the full shape, when they happen: the global
   generator advances exactly as in an eager build, and its state before the
   op is recorded. The result is dropped.
2. When ``__init__`` asks for a value (``bool(mask.any())`` in
   ``trunc_normal_``'s rejection loop, ``.item()``, a data-dependent shape),
   that value is computed by replaying its history (below) and returned.
3. When ``build()`` returns, names are known. For each storage some wanted
   name lives in, its last version is replayed: each recorded op is run for
   real, random ones under their recorded generator state; the wanted slices
   are cut and the full values dropped before the next storage.

Replay follows only what a version depends on: an op that overwrites a
whole storage without reading it (``normal_``, ``uniform_``, ``fill_``,
``zero_``, ``copy_``) cuts its history, so ``nn.Linear``'s ``kaiming_uniform_``
followed by GPT's ``normal_`` replays just the ``normal_``. Ops that read a
parameter's previous values (``p.data.mul_(2)``, ``weight[pad].fill_(0)``,
``trunc_normal_``'s steps, ``orthogonal_``'s QR) replay the chain they need.

Memory. At rest: the wanted slices and the op record (a 5 KiB generator
state per random op; small tensors from outside ``build()`` are copied into
the record, large ones referenced). Transiently: the full tensors one replay
needs (for a plain weight: that one full weight, plus its slice). Time: each
random op runs once while building and once more if this rank wants it.

``t.is_meta`` reads False for tensors being built (``nn.init.orthogonal_``
and ``trunc_normal_`` skip meta tensors). Tensors made from Python data
(``torch.tensor([...])``, ``torch.from_numpy``) are real and kept whole.
Refused with :class:`DeferredInitError` naming the line in ``__init__``:
``set_`` / ``resize_`` (lazy modules), a meta tensor made outside ``build()``,
writing values computed inside ``build()`` into a tensor made outside it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from annot.errors import AnnotError

__all__ = [
    "DeferredInitError",
    "deferred_reference",
    "materialize_",
    "meta_copy",
    "shard_slicers",
]

Slicer = Callable[[torch.Tensor], torch.Tensor]
Wanted = Callable[[str], Optional[Slicer]]
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset

_META = torch.device("meta")
_CPU = torch.device("cpu")

# In-place ops that write ``self`` without reading it (when ``self`` covers its storage).
_OVERWRITE = frozenset(
    {
        "fill_",
        "zero_",
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "bernoulli_",
        "copy_",
    }
)
# Ops whose values are uninitialised (replayed as zeros).
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that read only the shape of their tensor input: a replay does not rebuild its values.
_SHAPE_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)
# In-place ops that change only a tensor's view of its storage, never values.
_METADATA_INPLACE = frozenset(
    {"t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "detach_"}
)
_UNSUPPORTED = frozenset({"set_", "resize_", "resize_as_", "as_strided_"})
_RANDOM_EXTRA = frozenset({"native_dropout"})  # random ops without a generator argument
_SNAPSHOT_NUMEL = 1 << 16  # outside tensors up to this size are copied into the record
_IS_META = torch._C.TensorBase.__dict__["is_meta"]


class DeferredInitError(AnnotError):
    """A model's ``__init__`` does something deferred initialization cannot
    reproduce without building the full model; the message names the line."""


@dataclass(frozen=True)
class _Ref:
    """A tensor argument of a recorded op: a view of one version of a storage."""

    sid: int
    ver: int
    geom: Geometry


@dataclass
class _Op:
    """One recorded op, enough to run it again for real."""

    func: Any
    args: tuple  # tensors made inside build() as _Ref, others as they were
    kwargs: dict
    writes: dict[int, int]  # sid -> version before the op (the op makes version + 1)
    pure: frozenset[int]  # written sids the op does not read (start from an empty buffer)
    creates: tuple[tuple[int, int, Geometry, int], ...]  # (sid, output index, geometry, numel)
    random: bool
    empty: bool
    shape_only: bool
    rng: Optional[torch.Tensor] = None  # CPU generator state before the op (random ops)
    gen_state: Optional[torch.Tensor] = None  # same for an explicit generator= argument


@dataclass
class _Storage:
    sid: int
    dtype: torch.dtype
    numel: int
    meta: Any  # the meta untyped storage, kept alive so its address is not reused
    versions: list  # versions[v] is the _Op that made version v


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device
    (structure, no memory; tied tensors stay tied; other attributes copied)."""
    import copy

    memo: dict = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _user_frame() -> str:
    """``file:line (code)`` of the innermost frame outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f != here and not f.startswith(torch_dir) and "contextlib" not in f:
            return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return "<unknown>"


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.size()), tuple(t.stride()), t.storage_offset()


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes, tied ones under every name."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        out[name] = t
    for name, t in model.named_buffers(remove_duplicate=False):
        if t is not None:
            out[name] = t
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, v in vars(mod).items():
            if isinstance(v, torch.Tensor):
                out[f"{mod_name}.{attr}" if mod_name else attr] = v
    return out


def _bind(func, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """``[(schema argument, value)]`` for the arguments actually given."""
    schema = func._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    bound = list(zip(positional, args))
    bound += [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    return bound


def _on_device(func, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """``args, kwargs`` with the op's ``device`` argument (if it has one) set to ``device``."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "device":
            if not a.kwarg_only and i < len(args):
                args = args[:i] + (device,) + args[i + 1 :]
            else:
                kwargs = {**kwargs, "device": device}
    return args, kwargs


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@functools.cache
def _is_random(packet) -> bool:
    """An op draws random numbers if any of its overloads takes a generator."""
    if packet.__name__ in _RANDOM_EXTRA:
        return True
    return any(
        a.name == "generator"
        for o in packet.overloads()
        for a in getattr(packet, o)._schema.arguments
    )


def _adopt(real: torch.Tensor, geom: Geometry, numel: int) -> torch.Tensor:
    """A flat real tensor laid out like a storage whose view ``geom`` holds ``real``."""
    size, stride, offset = geom
    if (
        tuple(real.stride()) == stride
        and real.storage_offset() == offset
        and real.untyped_storage().nbytes() == numel * real.element_size()
    ):
        return real.as_strided((numel,), (1,), 0)
    flat = torch.empty(numel, dtype=real.dtype)
    flat.as_strided(size, stride, offset).copy_(real)
    return flat


class _Recorder(TorchDispatchMode):
    """Meta tensors for ``build()``, a record of every op that gives values,
    random ops run for real as they come, values replayed on demand."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, _Storage] = {}  # meta storage address -> record
        self.by_sid: list[_Storage] = []
        self.busy = False  # inside __torch_dispatch__ (is_meta tells the truth)

    def record(self, t: torch.Tensor) -> Optional[_Storage]:
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
        inputs = _tensors((args, kwargs))
        tracked = [t for t in inputs if self.record(t) is not None]
        if inputs and not tracked:
            if any(t.is_meta for t in inputs):
                raise self.fail(
                    f"{func} got a meta tensor that was not made inside build(); pass real "
                    "tensors (or none) to the model's constructor"
                )
            return func(*args, **kwargs)  # only real tensors from outside: run as is
        if name in _UNSUPPORTED:
            raise self.fail(f"{func} changes a storage's size or layout, which cannot be replayed")
        if name in _METADATA_INPLACE:
            return func(*args, **kwargs)  # views are re-read from each tensor at every op

        refs: dict[int, _Ref] = {}
        writes: dict[int, int] = {}
        read: set[int] = set()
        pure: set[int] = set()
        for arg, value in _bind(func, args, kwargs):
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
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
                refs[id(t)] = _Ref(rec.sid, len(rec.versions) - 1, _geometry(t))
                whole = t.numel() == rec.numel and t.storage_offset() == 0 and t.is_contiguous()
                overwrite = whole and (
                    (name in _OVERWRITE and arg.name == "self") or (arg.kwarg_only and is_write)
                )
                if is_write:
                    writes[rec.sid] = len(rec.versions) - 1
                    if overwrite:
                        pure.add(rec.sid)
                if not overwrite:
                    read.add(rec.sid)

        def template(x):
            if isinstance(x, torch.Tensor):
                if id(x) in refs:
                    return refs[id(x)]
                return x.detach().clone() if x.numel() <= _SNAPSHOT_NUMEL else x
            return x

        def to_meta(x):
            if isinstance(x, torch.Tensor) and not x.is_meta:
                return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
            if isinstance(x, torch.Generator):
                return None
            return x

        op = _Op(
            func,
            *tree_map(template, (args, kwargs)),
            writes=writes,
            pure=frozenset(pure - read),
            creates=(),
            random=_is_random(func.overloadpacket),
            empty=name in _EMPTY,
            shape_only=name in _SHAPE_ONLY,
        )
        sizes = {sid: self.by_sid[sid].meta.nbytes() for sid in writes}
        meta_args, meta_kwargs = _on_device(func, *tree_map(to_meta, (args, kwargs)), _META)
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

        creates = []
        for i, t in enumerate(_tensors(out)):
            if t.is_meta and self.record(t) is None:
                st = t.untyped_storage()
                numel = st.nbytes() // t.element_size()
                rec = _Storage(len(self.by_sid), t.dtype, numel, st, [op])
                self.storages[st._cdata] = rec
                self.by_sid.append(rec)
                creates.append((rec.sid, i, _geometry(t), numel))
        if not writes and not creates:
            return real_out if ran else out  # a view, metadata, or a value (.item())
        op.creates = tuple(creates)
        for sid in writes:
            self.by_sid[sid].versions.append(op)
        if op.random and not ran:
            self.execute(op, {}, first=True)  # advance the generator as eager does
        return out

    # ------------------------------------------------------------------ #
    # Replay
    # ------------------------------------------------------------------ #
    @contextlib.contextmanager
    def generator_state(self, op: _Op, first: bool):
        gens = [g for g in tree_flatten((op.args, op.kwargs))[0] if isinstance(g, torch.Generator)]
        gen = gens[0] if gens else None
        if not op.random:
            yield
        elif first:  # the real run: note where the generators were
            op.rng = torch.get_rng_state()
            op.gen_state = gen.get_state() if gen is not None else None
            yield
        else:  # a replay: rewind, run, put the generators back
            saved, gen_saved = torch.get_rng_state(), gen.get_state() if gen is not None else None
            torch.set_rng_state(op.rng)
            if gen is not None:
                gen.set_state(op.gen_state)
            try:
                yield
            finally:
                torch.set_rng_state(saved)
                if gen is not None:
                    gen.set_state(gen_saved)

    def execute(self, op: _Op, memo: dict, first: bool = False) -> Any:
        """Run ``op`` for real; put the versions it makes into ``memo``."""
        buffers: dict[int, torch.Tensor] = {}
        used: set[int] = set()  # storages of the inputs, so no output aliases one

        def to_real(x):
            if not isinstance(x, _Ref):
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

        args, kwargs = _on_device(op.func, *tree_map(to_real, (op.args, op.kwargs)), _CPU)
        if op.empty:  # uninitialised eagerly: zeros here
            real_out = None
            for b in buffers.values():
                b.zero_()
            for sid, _, _, numel in op.creates:
                memo[(sid, 0)] = torch.zeros(numel, dtype=self.by_sid[sid].dtype)
        else:
            with self.generator_state(op, first):
                real_out = op.func(*args, **kwargs)
            flat_out = _tensors(real_out)
            for sid, i, geom, numel in op.creates:
                r = flat_out[i]
                if r.untyped_storage().data_ptr() in used:
                    r = r.clone()
                memo[(sid, 0)] = _adopt(r, geom, numel)
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


class _HideMeta(TorchFunctionMode):
    """``t.is_meta`` is False for tensors being built, as it would be eagerly:
    ``nn.init.orthogonal_`` / ``trunc_normal_`` / ``sparse_`` skip meta tensors."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_META and not self.recorder.busy:
            return func(*args) and self.recorder.record(args[0]) is None
        return func(*args, **(kwargs or {}))


def _cut(view: torch.Tensor, slicer: Slicer, flat: torch.Tensor, name: str) -> torch.Tensor:
    """``slicer(view)`` as a tensor that does not keep ``flat`` alive (unless it is all of it)."""
    local = slicer(view)
    if not isinstance(local, torch.Tensor):
        raise DeferredInitError(
            f"deferred init: wanted({name!r}) returned a slicer that gave "
            f"{type(local).__name__}, expected a tensor (e.g. lambda t: t.narrow(0, 0, n))"
        )
    if local.untyped_storage()._cdata == flat.untyped_storage()._cdata:
        if not (local.numel() == flat.numel() and local.is_contiguous()):
            local = local.clone(memory_format=torch.contiguous_format)
    return local.detach()


def deferred_reference(
    build: Callable[[], nn.Module], wanted: Wanted
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Build ``build()``'s values slice by slice, never the whole model.

    ``wanted(name)`` is asked once per parameter, buffer and tensor attribute
    name (tied tensors under each of their names): ``None`` if this rank does
    not hold it, else a function from the full tensor to this rank's part
    (``lambda t: t`` for all of it). Returns the module built on the meta
    device (structure, names, ties) and ``{name: part}`` for every wanted name.

    The parts equal what ``build()`` makes eagerly from the same generator
    state, which this call advances exactly as the eager build does::

        torch.manual_seed(0)
        ref, values = deferred_reference(lambda: GPT(cfg), lambda name: lambda t: t)
    """
    recorder = _Recorder()
    with _HideMeta(recorder), recorder:
        module = build()
    if not isinstance(module, nn.Module):
        raise DeferredInitError(
            f"deferred init: build() returned {type(module).__name__}, expected an nn.Module"
        )
    by_sid: dict[int, list[tuple[str, Slicer, Geometry]]] = {}
    values: dict[str, torch.Tensor] = {}
    for name, t in named_tensors(module).items():
        rec = recorder.record(t)
        if t.is_meta and rec is None:
            raise DeferredInitError(
                f"deferred init: {name} is a meta tensor that was not made inside build(); "
                "pass real tensors to the model's constructor"
            )
        slicer = wanted(name)
        if slicer is None:
            continue
        if rec is None:  # a real tensor (torch.tensor([...]), from numpy, passed in)
            values[name] = _cut(t.detach(), slicer, t, name).clone()
        else:
            by_sid.setdefault(rec.sid, []).append((name, slicer, _geometry(t)))
    for sid, wants in by_sid.items():
        rec = recorder.by_sid[sid]
        flat = recorder.value(sid, len(rec.versions) - 1, {})
        done: dict = {}
        for name, slicer, geom in wants:  # tied names with one slicer share one tensor
            key = (geom, id(slicer))
            if key not in done:
                done[key] = _cut(flat.as_strided(*geom), slicer, flat, name)
            values[name] = done[key]
        del flat, done
    return module, values


# --------------------------------------------------------------------------- #
# Wiring into a tensor-parallel model
# --------------------------------------------------------------------------- #


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def shard_slicers(local: nn.Module) -> Wanted:
    """``wanted`` for :func:`deferred_reference` from this rank's model: names
    it does not hold give ``None``; sharded tensors (``annot_shard_layout()``,
    ``shard_parameter``) give this rank's ``split_local`` slice; the rest whole.

    ``local`` may be on the meta device (built under ``torch.device("meta")``
    and pruned to this rank's stages). Call inside ``annot.runtime.mesh.use(ctx)``.
    """
    from annot.errors import MeshError
    from annot.runtime.state_dict import shard_layouts
    from annot.runtime.tp_comm import split_local, tp_env

    layouts = shard_layouts(local)
    _, size, rank = tp_env()
    table: dict[str, Slicer] = {}
    for name, t in named_tensors(local).items():
        layout = layouts.get(id(t))
        if layout is None:
            table[name] = _identity
            continue
        dim, chunks, tp = layout
        if tp != size:
            raise MeshError(
                f"{name} is sharded for tp={tp} but the current tp degree is {size}; call "
                "shard_slicers inside annot.runtime.mesh.use(ctx) with the mesh the model was built for"
            )
        table[name] = functools.partial(split_local, dim=dim, chunks=chunks, size=tp, rank=rank)
    return table.get


def _fill(model: nn.Module, t: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``t`` the storage of ``value``, keeping the object (ties, subclass, attributes)."""
    cls, attrs = type(t), dict(t.__dict__)
    new = (
        nn.Parameter(value, requires_grad=t.requires_grad)
        if isinstance(t, nn.Parameter)
        else value.detach()  # a new object: the caller's dict keeps its tensors
    )
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError:  # something holds a view of t: replace it wherever the model has it
        if cls is not type(new):
            new.__class__ = cls
        new.__dict__.update(attrs)
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers, mod.__dict__):
                for k, v in list(table.items()):
                    if v is t:
                        table[k] = new
        return
    if type(t) is not cls:
        t.__class__ = cls
    t.__dict__.update(attrs)


def materialize_(
    model: nn.Module, values: dict[str, torch.Tensor], device: Optional[torch.device] = None
) -> nn.Module:
    """Give a (meta) model real storage on ``device`` holding ``values``, by
    name. Parameter objects are kept, so ties (one parameter under two names),
    parameter subclasses and their attributes survive (``Module.to_empty``
    keeps none of them). Every parameter, buffer and tensor attribute must
    have a value of its shape, else :class:`DeferredInitError` lists them.
    ``values`` are used in place when already on ``device`` with the dtype."""
    device = torch.device(device or "cpu")
    tensors = named_tensors(model)
    missing = [n for n in tensors if n not in values]
    wrong = [
        f"{n}: value {tuple(values[n].shape)}, model {tuple(t.shape)}"
        for n, t in tensors.items()
        if n in values and values[n].shape != t.shape
    ]
    if missing or wrong:
        raise DeferredInitError(
            f"materialize_: missing values for {missing or 'none'}; wrong shapes: "
            f"{wrong or 'none'}; build values with deferred_reference(build, "
            "shard_slicers(model)) for this same model"
        )
    done: set[int] = set()
    with torch.no_grad():
        for name, t in tensors.items():
            if id(t) not in done:  # tied: once
                done.add(id(t))
                _fill(model, t, values[name].to(device=device, dtype=t.dtype).contiguous())
    return model
