"""Pipeline stages at any depth, by replay: a stage is a range of module calls.

The stage-split rewriter cuts one ``forward`` into stage methods. Real models
keep their blocks deeper (``LlamaForCausalLM.forward`` -> ``self.model(...)``
-> a loop over ``self.layers``; timm's ``forward_features`` -> an
``nn.Sequential``; torchvision's ``_forward_impl``), behind decorators,
``**kwargs`` and dataclass returns. Here the model's code runs *unchanged*, on
every pipeline rank, and the stages are cut at run time instead:

* A boundary is a module path (``"model.layers.4"``). Stage ``k`` begins at
  the first call of boundary ``k`` in a forward and ends at the first call of
  boundary ``k + 1``, wherever those calls sit in the call stack.
* Stage ``k`` runs the forward from the top. Up to its boundary it *replays*
  the earlier stages' part on the meta device (shapes only, no FLOPs, no
  autograd): modules held by other stages run their meta shadow
  (:class:`annot.runtime.runners.stage_prune.Absent`), and any op mixing meta and real
  tensors runs on meta.
* At boundary ``k`` it takes what the previous stage sent and swaps it into
  the live tensors of every frame on the stack (:func:`torch.utils.swap_tensors`
  keeps each object's identity, so every local, tuple, dict and dataclass that
  holds it sees the real value), then runs its own modules for real.
* At boundary ``k + 1`` it collects the tensors of every frame on the stack,
  in a fixed order (innermost frame first, locals in definition order,
  containers depth first), hands them to the executor as the stage's outputs
  and stops with :class:`StageDone`: the rest of forward, and of the step
  body (the loss), belong to later stages.

Both ranks walk the same frames of the same program, so the two lists pair
up one to one; shapes and dtypes are checked pair by pair and a mismatch is
refused naming the variable. Control flow that reads tensor values
(``if x.mean() > 0``, ``.item()``) is replayed from a log: every such answer
a stage computes is recorded in order and sent along, and a later stage's
replay reads it back, so data-dependent branches take the same path on every
stage. The same log carries the outputs of the modules the later stages hold
as placeholders: the rank that runs such a module for real records the
structure, shapes and dtypes of what it returned (and which of its value
reads happened inside), and a later stage's replay answers the placeholder's
call from that record instead of running it on meta. So a module whose output
shapes depend on its data (a mixture of experts routing tokens with
``nonzero``) or whose kernels have no meta version (``_grouped_mm`` in
float32, a custom kernel) replays like any other; a module whose output is not
plain data (a cache object) is run on meta, as before. Gradients flow back
through the tensors that crossed, as with any stage: the receiver's swapped
objects are leaves whose ``.grad`` goes back.

The price: each stage re-runs the Python of the stages before it (on meta:
no FLOPs), and tensors that are alive only inside an object (not a local, a
tuple, a list, a dict or a dataclass) cannot cross; using one on a later
stage is refused with a :class:`~annot.core.errors.PipelineError` that says so.

Its parts: the ops on meta and their cache by signature in
:mod:`annot.runtime.runners.meta_ops`, the log of value reads in
:mod:`annot.runtime.runners.value_reads`, the walk that collects the frames' tensors in
:mod:`annot.runtime.frames`; here the boundaries, the replay mode and the
stage.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from annot.core.errors import PipelineError
from annot.runtime.frames import frame_tensors, named_frame_tensors, state_ids
from annot.runtime.runners.meta_ops import (
    MetaOps,
    flat,
    has_meta,
    on_meta,
    pack,
    recipe,
    remake,
    signature,
    unpack,
)
from annot.runtime.runners.value_reads import DECISIONS, log_reads, unlog

if TYPE_CHECKING:
    from annot.runtime.runners.stage_prune import Absent

__all__ = [
    "ReplayStage",
    "StageDone",
    "install_boundaries",
    "install_output_log",
    "register_collectors",
    "replaying",
    "running_live",
    "call_with",
    "meta_values",
    "shadow_call",
    "shape_run",
]


class StageDone(BaseException):
    """This stage's part of the forward is over (raised at the next boundary).

    A ``BaseException``, so model code's ``except Exception`` does not catch
    it; the pipeline executor does, around the step body."""


class _Run:
    """One (stage, microbatch) forward on this rank."""

    def __init__(self, stage: ReplayStage, received: Optional[dict], record: bool):
        self.stage = stage
        self.index = stage.index
        self.received = received
        self.crossed = 0  # boundaries passed so far in this forward
        self.replaying = stage.index > 0
        self.decisions_in = list(received["d"]) if received else []
        self.pos = 0
        self.decisions_out: list = []
        self.record = record
        self.outputs: Optional[dict] = None
        self.grad_mode = torch.is_grad_enabled()
        self.top_code: Optional[CodeType] = None  # the frame where the walk stops (the runner's)
        self.mode: Optional[_ReplayMode] = None  # while replaying
        self.patches: list = []  # value reads logged while running for real
        # The output log of the modules other stages hold as placeholders, by
        # (key, how many calls of it came before in this forward): what the
        # owner recorded (received) and what goes on (received + this stage's).
        self.logged = {(e[0], e[1]): e for e in received["m"]} if received else {}
        self.log_out: list = list(received["m"]) if received and record else []
        self.calls: dict[str, int] = {}  # logged modules (by key) entered so far, with counts
        self.entered: list[str] = []  # ... in order
        self.open: list[_Call] = []  # the logged calls under way, innermost last


_ACTIVE: list[_Run] = []


def replaying() -> bool:
    """True while this rank replays an earlier stage's part of forward."""
    return bool(_ACTIVE) and _ACTIVE[-1].replaying


def running_live() -> Optional[int]:
    """The stage this rank runs for real right now (between its boundaries),
    else None (replaying, or no stage running)."""
    return _ACTIVE[-1].index if _ACTIVE and not _ACTIVE[-1].replaying else None


@dataclass(slots=True)
class _Call:
    """A logged module's call under way (see :func:`install_output_log`)."""

    key: str
    n: int  # calls of it before this one in the forward
    start: int  # the value-read log's length when it began
    inner: int  # len(run.entered) when it began
    lists: list  # the collectors' lists, and their lengths when it began
    sizes: list
    module: nn.Module
    kind: str  # "own", "absent", "shadow"; "answered" once answered from the log


def _entry(run: _Run, module: nn.Module) -> Optional[tuple]:
    """The log entry answering this call of ``module`` (whose pre-hook opened
    the innermost logged call), if the stage that ran it logged one."""
    call = run.open[-1] if run.open else None
    if call is None or call.module is not module:
        return None
    return run.logged.get((call.key, call.n))


def shadow_call(absent: Absent, args: tuple, kwargs: dict) -> Any:
    """Another stage's module (the placeholder ``absent``) called while
    replaying: its outputs as the stage that ran it logged them (fresh meta
    tensors of the logged shapes, the same aliasing of inputs and outputs), and
    the value reads made inside it skipped. Without a log entry (its output is
    not plain data) its shadow runs on meta (where the logged modules inside
    it are answered from the log in turn), the first time for each signature
    of its inputs, then from its cache; one whose outputs depend on values (it
    read one from the log) or are not plain pytrees is never cached."""
    run = _ACTIVE[-1]
    leaves: list = []
    with torch._C.DisableTorchFunction():  # .shape / .dtype without the replay mode
        spec = flat((args, kwargs), leaves)
    entry = _entry(run, absent)
    if entry is not None:
        return _from_log(run, entry, leaves)
    with torch._C.DisableTorchFunction():
        key = (spec, tuple(signature(x) for x in leaves))
    cache = absent.shapes
    hit = cache.get(key)
    if hit is not None:
        return remake(hit, leaves)
    pos = run.pos
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    shadow = absent.shadow
    assert shadow is not None, "Absent.forward calls this only with a shadow"
    out = shadow(*meta[0], **meta[1])
    if run.pos == pos:
        ins = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        metas: list = []
        flat(meta, metas)
        ins.update({id(x): i for i, x in enumerate(metas)})
        hit = _recipe(out, ins, run.stage.state_ids)
        if hit is not None:
            cache[key] = hit
    return out


def _recipe(out: Any, ins: dict, state: Container[int]) -> Optional[tuple]:
    """:func:`recipe` of ``out`` leaving out module state (the frame walk
    leaves state out, so a fresh meta tensor in its place would be one tensor
    too many); None also for a tensor without strides."""
    try:
        return recipe(out, ins, state)
    except (RuntimeError, NotImplementedError):  # .stride() of a sparse or nested tensor
        return None


def _from_log(run: _Run, entry: tuple, leaves: list) -> Any:
    key, n, start, end, inner, text = entry
    if start != run.pos:
        raise PipelineError(
            f"pipeline stage {run.index} replays the earlier stages' part of forward: call "
            f"{n} of {key!r} came after {run.pos} value reads here but after {start} on the "
            "stage that ran it; the forward took a different path on the two ranks"
        )
    if run.record:
        run.decisions_out.extend(run.decisions_in[start:end])
    run.pos = end
    for q in inner:  # the logged modules it called: counted as if run here
        run.calls[q] = run.calls.get(q, 0) + 1
    run.entered.extend(inner)
    run.open[-1].kind = "answered"  # (its own hooks' appends are the logged ones)
    out, appended = remake(unpack(text), leaves)
    if appended:
        lists = dict(_collectors())
        for name, items in appended.items():
            if name not in lists:
                raise PipelineError(
                    f"pipeline stage {run.index}: call {n} of {key!r} captured {name!r} "
                    "outputs on the stage that ran it, but that capture is off here"
                )
            lists[name].extend(items)
        run.open[-1].sizes = [len(lst) for _, lst in run.open[-1].lists]
    return out


class _FromLog:
    """The ``forward`` of a logged module inside another stage's meta shadow:
    answered from the log while replaying, where its owner logged the call."""

    def __init__(self, module: nn.Module, forward):
        self.module = module
        self.__wrapped__ = forward  # (inspect.signature follows it)

    def __call__(self, *args, **kwargs):
        run = _ACTIVE[-1] if _ACTIVE else None
        entry = _entry(run, self.module) if run is not None and run.replaying else None
        if entry is None:
            return self.__wrapped__(*args, **kwargs)
        leaves: list = []
        with torch._C.DisableTorchFunction():
            flat((args, kwargs), leaves)
        return _from_log(run, entry, leaves)


class _ReplayMode(TorchFunctionMode):
    """Active while a stage replays the earlier stages' part: ops with a meta
    operand run on meta; value reads are answered from the log."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = has_meta(args, kwargs)
        if func in DECISIONS:
            return self._decide(func, args, kwargs, meta)
        if not meta:
            return func(*args, **kwargs)
        return self.run.stage.meta_ops(func, args, kwargs)

    def _decide(self, func, args, kwargs, meta: bool):
        run = self.run
        if run.pos >= len(run.decisions_in):
            name = getattr(func, "__name__", str(func))
            raise PipelineError(
                f"pipeline stage {run.index} replays the earlier stages' part of forward and "
                f"reached a value read ({name}) that the earlier stages did not make; the "
                "forward took a different path on this rank. Make the control flow before "
                f"boundary {run.stage.boundaries[run.index - 1]!r} depend only on the step's "
                "inputs and the values computed there"
            )
        value = run.decisions_in[run.pos]
        run.pos += 1
        if not meta:  # a value this rank has for real: it must agree
            value = func(*args, **kwargs)
        if run.record:
            run.decisions_out.append(value)
        return value


def meta_values() -> TorchFunctionMode:
    """A mode in which a model on the meta device runs forward and backward
    as :func:`shape_run` runs forward (value reads of meta tensors answer
    zero / False), autograd on: for measuring what a step keeps and
    computes from shapes alone."""
    return _ShapeMode()


class _ShapeMode(TorchFunctionMode):
    """For :func:`shape_run`: ops with a meta operand run on meta; a value read
    of a meta tensor answers zero / False, and an op that meta cannot run
    (its output shape depends on the data, like ``nonzero``; its meta kernel
    refuses a dtype the real one takes) runs on zeros: the path taken is a
    guess there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if has_meta(args, kwargs):
            if func in DECISIONS:
                t = args[0]
                if func is torch.Tensor.tolist:
                    return torch.zeros(t.shape, dtype=t.dtype).tolist()
                return (
                    False
                    if func in (torch.Tensor.__bool__, torch.Tensor.__contains__, torch.equal)
                    else 0
                )
            meta = on_meta(func, args, kwargs)
            try:
                return func(*meta[0], **meta[1])
            except (NotImplementedError, RuntimeError) as exc:
                return _on_zeros(func, args, kwargs, exc)
        return func(*args, **kwargs)


_ZEROS_LIMIT = 1 << 28  # bytes of zeros one op of the probe may make


def _on_zeros(func, args: tuple, kwargs: dict, failed: Exception) -> Any:
    """``func`` run for real with zeros for its meta operands (up to
    :data:`_ZEROS_LIMIT` bytes, else it raises ``failed``, meta's error), its
    tensors moved to meta."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    if sum(t.numel() * t.element_size() for t in tensors if t.is_meta) > _ZEROS_LIMIT:
        raise failed
    real = tree_map(
        lambda t: (
            torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) and t.is_meta else t
        ),
        (args, kwargs),
    )
    out = func(*real[0], **real[1])
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, out)


def call_with(fn, sample: Any) -> Any:
    """``fn`` called on one microbatch of forward's arguments: a dict (keyword
    arguments), a tuple (positional) or a single value."""
    if isinstance(sample, dict):
        return fn(**sample)
    if isinstance(sample, tuple):
        return fn(*sample)
    return fn(sample)


def shape_run(fn, sample: Any) -> Any:
    """``fn`` on ``sample`` (see :func:`call_with`) for shapes and the order of
    module calls only, over a model whose weights are on the meta device while
    the inputs may be real (value reads of meta tensors answer zero / False),
    without autograd."""
    with torch.no_grad(), _ShapeMode():
        return call_with(fn, sample)


# -- boundaries ---------------------------------------------------------------


def _called(root: nn.Module, path: str) -> nn.Module:
    """The module forward calls at ``path``: the placeholder where another
    stage holds it, else the module (also inside the meta shadows)."""
    from annot.runtime.runners.stage_prune import Absent, resolve_module

    parent, _, name = path.rpartition(".")
    holder = resolve_module(root, parent)._modules.get(name) if name else None
    return holder if isinstance(holder, Absent) else resolve_module(root, path)


def install_boundaries(root: nn.Module, boundaries: Sequence[str]) -> list:
    """Forward pre-hooks on the module at each boundary path (also inside the
    meta shadows of modules held by other stages). They act only while a
    :class:`ReplayStage` runs; returns the hook handles."""
    # first of the module's pre-hooks: what the others do (sequence
    # parallelism's scatter) is the stage's work on what arrived
    return [
        _called(root, path).register_forward_pre_hook(_make_hook(k, path), prepend=True)
        for k, path in enumerate(boundaries, start=1)
    ]


# Functions that return the lists forward hooks append module outputs to right
# now, by name (transformers' output capture: annot.hf registers it).
_COLLECTORS: list = []


def register_collectors(fn) -> None:
    """Register ``fn() -> [(name, list), ...]``: lists that forward hooks
    append module outputs to during a forward (an output-capture mechanism). A
    logged module's appends are logged with its outputs and made again, as
    meta tensors, where a later stage answers the call from the log, so every
    stage holds the same tensors and the captured ones cross the boundaries."""
    if fn not in _COLLECTORS:
        _COLLECTORS.append(fn)


def _collectors() -> list:
    return [c for fn in _COLLECTORS for c in fn()] if _COLLECTORS else []


def install_output_log(root: nn.Module, keys: dict[str, str]) -> list:
    """Hooks on the modules at the paths of ``keys`` (those some stage holds as
    a placeholder, and the blocks inside them), each logged under its key (the
    first path of the module, so a module reached by several paths, a shared
    embedding, is one module everywhere): the rank that runs one for real logs
    its outputs for the later stages' replay (see :func:`shadow_call`). Every
    rank hooks the same keys, so the calls are counted alike everywhere; a
    logged module inside a meta shadow answers from the log. Returns the handles."""
    from annot.runtime.runners.stage_prune import Absent

    handles, done = [], set()
    for path, key in keys.items():
        module = _called(root, path)
        if id(module) in done:
            continue
        done.add(id(module))
        kind = "absent" if isinstance(module, Absent) else _kind(root, path)
        exit_ = module.register_forward_hook(_log_exit(), with_kwargs=True)
        handles.append(module.register_forward_pre_hook(_log_enter(key, kind, exit_.id)))
        handles.append(exit_)
        if kind == "shadow":
            module.forward = _FromLog(module, module.forward)
    return handles


def _kind(root: nn.Module, path: str) -> str:
    """ "shadow" if ``path`` lies inside another stage's meta shadow here, else "own"."""
    from annot.runtime.runners.stage_prune import Absent

    obj: Any = root
    for part in path.split("."):
        obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
        if isinstance(obj, Absent):
            return "shadow"
    return "own"


def _log_enter(key: str, kind: str, exit_id: int):
    def hook(module: nn.Module, args: tuple) -> None:
        if not _ACTIVE:
            return
        hooks = cast("OrderedDict[int, Any]", module._forward_hooks)
        if exit_id in hooks and next(reversed(hooks)) != exit_id:
            hooks.move_to_end(exit_id)  # after hooks added since (output capture)
        run = _ACTIVE[-1]
        n = run.calls.get(key, 0)
        run.calls[key] = n + 1
        run.entered.append(key)
        lists = _collectors()
        sizes = [len(lst) for _, lst in lists]
        start = len(run.decisions_out)
        run.open.append(_Call(key, n, start, len(run.entered), lists, sizes, module, kind))

    return hook


def _log_exit():
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not _ACTIVE:
            return
        run = _ACTIVE[-1]
        # its frame, and above it those of calls that raised into an except of the model
        at = next(
            (i for i in range(len(run.open) - 1, -1, -1) if run.open[i].module is module), None
        )
        if at is None:
            return
        call = run.open[at]
        del run.open[at:]
        if (
            call.kind == "answered"
        ):  # its own hooks ran again on the answer: the log's appends stand
            for (_, lst), k in zip(call.lists, call.sizes):
                del lst[k:]
            return
        if not run.record or run.replaying:
            return  # logged by the stage that ran it (or nobody needs it)
        appended = {name: lst[k:] for (name, lst), k in zip(call.lists, call.sizes) if len(lst) > k}
        leaves: list = []
        flat((args, kwargs), leaves)
        ins = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        hit = _recipe((out, appended), ins, run.stage.state_ids)
        text = pack(hit) if hit is not None else None
        if text is not None:
            inner = tuple(run.entered[call.inner :])
            run.log_out.append((call.key, call.n, call.start, len(run.decisions_out), inner, text))

    return hook


def _make_hook(k: int, path: str):
    def hook(module: nn.Module, args: tuple) -> None:
        if not _ACTIVE:
            return
        run = _ACTIVE[-1]
        if k <= run.crossed:
            return  # the same module called again, or an earlier boundary
        run.crossed = k
        if k == run.index:
            _enter(run, sys._getframe(1))
        elif k > run.index:
            if run.replaying:
                raise PipelineError(
                    f"pipeline boundary {k} ({path!r}) was reached before boundary "
                    f"{run.index} ({run.stage.boundaries[run.index - 1]!r}); boundaries must be "
                    "given in the order forward calls them"
                )
            _leave(run, sys._getframe(1))

    return hook


def _enter(run: _Run, frame) -> None:
    """Boundary ``run.index``: stop replaying, swap the received tensors in."""
    run.replaying = False
    assert run.mode is not None, "a later stage replays until its boundary"
    assert run.received is not None, "a later stage receives"
    run.mode.__exit__(None, None, None)  # (the checks below read shapes without it)
    mine = frame_tensors(frame, run.top_code, run.stage.state_ids)
    got = run.received["t"]
    path = run.stage.boundaries[run.index - 1]
    if len(got) != len(mine):
        raise PipelineError(
            f"pipeline stage {run.index}: {len(got)} tensors arrived at boundary {path!r} but "
            f"this rank's forward holds {len(mine)} there; the forward took a different path "
            "on the two ranks. Either control flow depends on something other than the step's "
            "inputs and the model's values, or a forward hook stored tensors on the rank that "
            "ran the module into a collector the replay does not know: register it with "
            "annot.runtime.runners.replay.register_collectors (transformers' output capture is "
            "registered)"
        )
    for j, (t, r) in enumerate(zip(mine, got)):
        if r is None:
            continue
        if t.shape != r.shape or t.dtype != r.dtype:
            _, names = named_frame_tensors(frame, run.top_code, run.stage.state_ids)
            raise PipelineError(
                f"pipeline stage {run.index}, boundary {path!r}: {names[j]} is "
                f"{t.dtype}{list(t.shape)} here but {r.dtype}{list(r.shape)} on the previous "
                "stage; the forward took a different path on the two ranks"
            )
        if t.is_meta or r.requires_grad:  # (a value with a gradient path comes from its stage)
            _swap(t, r)  # t (held by the frames) is now the received tensor
            got[j] = t
    if run.pos != len(run.decisions_in):
        raise PipelineError(
            f"pipeline stage {run.index}: the previous stage made {len(run.decisions_in)} value "
            f"reads before boundary {path!r} but this rank's replay made {run.pos}; the forward "
            "took a different path on the two ranks"
        )
    if run.record:
        run.patches = log_reads(run.decisions_out)
    torch.set_grad_enabled(run.grad_mode)


def _swap(meta: torch.Tensor, real: torch.Tensor) -> None:
    """Give the object ``meta`` the contents of ``real`` (and ``real`` the meta
    ones). ``swap_tensors`` refuses a tensor that a view still references as
    its base; for a meta tensor of the replay that reference is harmless (the
    view is a frame tensor too and gets its own value), so swap the impls."""
    try:
        torch.utils.swap_tensors(meta, real)
    except RuntimeError:
        torch._C._swap_tensor_impl(meta, real)


def _leave(run: _Run, frame) -> None:
    """Boundary ``run.index + 1``: the live tensors are this stage's outputs."""
    tensors = frame_tensors(frame, run.top_code, run.stage.state_ids)
    run.outputs = {
        "t": [None if t.is_meta else t for t in tensors],
        "d": run.decisions_out,
        "m": run.log_out,
    }
    raise StageDone()


# -- the stage ----------------------------------------------------------------


class ReplayStage:
    """Stage ``index`` of a model cut at module-path ``boundaries``.

    ``stage(received, call)`` runs ``call()`` (the model call of the step
    body) as this stage: replaying until boundary ``index`` with ``received``
    (the previous stage's outputs), then for real until boundary ``index + 1``
    where it raises :class:`StageDone` with the outputs in ``.outputs``.
    The last stage returns ``call()``'s value.
    """

    def __init__(self, root: nn.Module, index: int, boundaries: Sequence[str]):
        self.root = root
        self.index = index
        self.boundaries = tuple(boundaries)
        self.num_stages = len(self.boundaries) + 1
        self.state_ids = state_ids(root)
        self.meta_ops = MetaOps()  # the replay's ops on meta, by signature
        self.outputs: Optional[dict] = None

    def _replay_failed(self, run: _Run, exc: BaseException) -> str:
        why = str(exc).rstrip(".")
        head = (
            f"pipeline stage {self.index} replays the earlier stages' part of forward (shapes "
            "only, on the meta device) and an op"
        )
        if not run.open:
            return (
                f"{head} outside the modules other stages hold failed there: {why}. Code whose "
                "output shapes depend on the data (or whose ops have no meta kernel) replays "
                "only inside such a module; move it into one, or pass split= with a boundary "
                "after it"
            )
        call = run.open[-1]
        if call.kind == "own":
            begin = self.boundaries[self.index - 1]
            if begin.startswith(call.key + "."):  # the stage begins inside it
                return (
                    f"{head} in {call.key!r} failed there: {why}. Stage {self.index} begins "
                    f"inside it ({begin!r}), so this rank runs its part before the boundary on "
                    f"meta, where its ops cannot run. Put the boundary at {call.key!r} or after "
                    "it instead"
                )
            return (
                f"{head} in {call.key!r} failed there: {why}. {call.key!r} belongs to an "
                "earlier stage this rank also holds (interleaved virtual stages), and a rank's "
                "own modules replay on meta, where its ops cannot run. Use chunks=1 for this "
                "model, or boundaries between blocks the source split can cut (runner='source' "
                "or left out: no stage runs an earlier one again)"
            )
        return (
            f"{head} in {call.key!r} failed there: {why}. A module of another stage is "
            "answered from the log of what it returned when that is tensors in tuples, lists "
            "and dicts; this one returned something else. Return plain containers from it, "
            "or pass split= with a boundary before it"
        )

    def __call__(self, received: Optional[dict], call) -> Any:
        last = self.index == self.num_stages - 1
        run = _Run(self, received, record=not last)
        run.top_code = ReplayStage.__call__.__code__
        self.outputs = None
        _ACTIVE.append(run)
        if run.replaying:
            run.mode = _ReplayMode(run)
            run.mode.__enter__()
            torch.set_grad_enabled(False)
        elif run.record:
            run.patches = log_reads(run.decisions_out)
        try:
            out = call()
        except StageDone:
            self.outputs = run.outputs
            raise
        except (RuntimeError, NotImplementedError) as exc:
            if run.replaying:
                raise PipelineError(self._replay_failed(run, exc)) from exc
            if isinstance(exc, RuntimeError) and "meta" in str(exc):
                raise PipelineError(
                    f"pipeline stage {self.index} used a tensor that an earlier stage computed "
                    "but that did not cross the boundary (it was held by an object other than "
                    f"a local variable, tuple, list, dict or dataclass): {exc}"
                ) from exc
            raise
        finally:
            if run.replaying and run.mode is not None:
                run.mode.__exit__(None, None, None)
            if run.patches:
                unlog(run.patches)
            torch.set_grad_enabled(run.grad_mode)
            _ACTIVE.pop()
        if run.crossed < self.index:
            raise PipelineError(
                f"the forward ended after {run.crossed} of the {len(self.boundaries)} pipeline "
                f"boundaries {list(self.boundaries)}; stage {self.index} never began (is a "
                "boundary module skipped by the control flow for this input?)"
            )
        return out
