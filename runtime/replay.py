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
  (:class:`annot.runtime.stages.Absent`), and any op mixing meta and real tensors
  runs on meta.
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
stage. Gradients flow back through the tensors that crossed, as with any
stage: the receiver's swapped objects are leaves whose ``.grad`` goes back.

The price: each stage re-runs the Python of the stages before it (on meta:
no FLOPs), and tensors that are alive only inside an object (not a local, a
tuple, a list, a dict or a dataclass) cannot cross; using one on a later
stage is refused with a :class:`~annot.errors.PipelineError` that says so.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from annot.errors import PipelineError

__all__ = [
    "MetaOps",
    "ReplayStage",
    "StageDone",
    "install_boundaries",
    "replaying",
    "call_with",
    "shadow_call",
    "shape_run",
]

# Tensor methods whose answer is a Python value read from the data: a branch on
# them must take the same path on every stage, so their answers are logged.
_DECISIONS = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__complex__,
    torch.equal,
    torch.is_nonzero,
}


_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}


def _on_meta(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The op's tensor operands on meta; a move (``.to(device)``, ``.cpu()``)
    keeps its dtype and stays on meta."""
    args, kwargs = tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t,
        (args, kwargs),
    )
    if func in _MOVES:

        def keep(a: Any) -> Any:
            if isinstance(a, torch.device) or (
                isinstance(a, (str, int)) and not isinstance(a, bool)
            ):
                return "meta"
            return a

        args = (args[0], *(keep(a) for a in args[1:])) if func is torch.Tensor.to else args[:1]
        kwargs = {k: ("meta" if k == "device" else v) for k, v in kwargs.items()}
        if func is not torch.Tensor.to:
            kwargs = {}
    return args, kwargs


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
        self.top_code = None  # the frame where the walk stops (the runner's)
        self.mode: Optional[_ReplayMode] = None  # while replaying
        self.patches: list = []  # value reads logged while running for real


_ACTIVE: list[_Run] = []


def replaying() -> bool:
    """True while this rank replays an earlier stage's part of forward."""
    return bool(_ACTIVE) and _ACTIVE[-1].replaying


_PLAIN = (type(None), bool, int, float, str)
# values an op's key or result may hold as they are (hashable, no tensor inside)
_VALUES = (*_PLAIN, torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)


def _signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype)
    return leaf if isinstance(leaf, _PLAIN) else type(leaf)


def _flat(x: Any, leaves: list) -> Any:
    """A structure spec of ``x`` over tuples, lists and plain dicts, its other
    values appended to ``leaves`` (cheaper than a pytree for the hot path)."""
    t = type(x)
    if t is tuple or t is list:
        return (t, tuple(_flat(v, leaves) for v in x))
    if t is dict:
        return (dict, tuple((k, _flat(v, leaves)) for k, v in x.items()))
    leaves.append(x)
    return None


def _unflat(spec: Any, leaves: Any) -> Any:
    if spec is None:
        return next(leaves)
    t, items = spec
    if t is dict:
        return {k: _unflat(v, leaves) for k, v in items}
    return t(_unflat(v, leaves) for v in items)


def _recipe(out: Any, inputs: dict[int, int]) -> Optional[tuple]:
    """How to make ``out`` again for inputs of the same shapes: each tensor in
    it is input ``i`` (``inputs``: id -> position), an earlier output, or a new
    meta tensor of its shape, dtype and strides; None if ``out`` holds other
    objects."""
    outs: list = []
    spec = _flat(out, outs)
    seen: dict[int, int] = {}
    recipe = []
    for j, x in enumerate(outs):
        if isinstance(x, torch.Tensor):
            if id(x) in inputs:
                recipe.append(("in", inputs[id(x)]))
            elif id(x) in seen:
                recipe.append(("out", seen[id(x)]))
            else:
                recipe.append(("new", (tuple(x.shape), tuple(x.stride()), x.dtype)))
            seen.setdefault(id(x), j)
        elif isinstance(x, _VALUES):
            recipe.append(("plain", x))
        else:
            return None
    return tuple(recipe), spec


def _remake(hit: tuple, leaves: list) -> Any:
    recipe, spec = hit
    built: list = []
    with torch._C.DisableTorchFunction():
        for kind, a in recipe:
            if kind == "new":
                built.append(torch.empty_strided(a[0], a[1], dtype=a[2], device="meta"))
            elif kind == "in":
                built.append(leaves[a])
            elif kind == "out":
                built.append(built[a])
            else:
                built.append(a)
    return _unflat(spec, iter(built))


def shadow_call(shadow: nn.Module, cache: dict, args: tuple, kwargs: dict) -> Any:
    """Run another stage's module for shapes while replaying: on meta the first
    time for each signature of its inputs, then from ``cache`` (fresh meta
    tensors of the recorded shapes, the same aliasing of inputs and outputs),
    so a replay costs little more than the Python of the modules it passes
    through. A module whose outputs depend on values (it read one from the log)
    or are not plain pytrees is never cached."""
    run = _ACTIVE[-1]
    leaves: list = []
    with torch._C.DisableTorchFunction():  # .shape / .dtype without the replay mode
        key = (_flat((args, kwargs), leaves), tuple(_signature(x) for x in leaves))
    hit = cache.get(key)
    if hit is not None:
        return _remake(hit, leaves)
    pos = run.pos
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    out = shadow(*meta[0], **meta[1])
    if run.pos == pos:
        ins = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        metas: list = []
        _flat(meta, metas)
        ins.update({id(x): i for i, x in enumerate(metas)})
        hit = _recipe(out, ins)
        if hit is not None:
            cache[key] = hit
    return out


def _op_key(func, args: tuple, kwargs: dict) -> tuple[Optional[tuple], list]:
    """The key of an op on meta operands for :class:`_ReplayMode`'s cache: the
    op, the structure of its arguments and each one's value (a tensor's shape,
    strides and dtype); None where an argument is something else, or for an op
    that changes its operand in place or writes to ``out=``."""
    leaves: list = []
    spec = _flat((args, kwargs), leaves)
    name = getattr(func, "__name__", "_")
    if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs:
        return None, leaves  # (resize_, unsqueeze_, ... change the operand's shape)
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append((x.shape, x.stride(), x.dtype, x.is_meta))
        elif isinstance(x, _VALUES) or x is Ellipsis:
            sig.append(x)
        elif isinstance(x, slice) and all(isinstance(v, _PLAIN) for v in (x.start, x.stop, x.step)):
            sig.append((slice, x.start, x.stop, x.step))
        else:
            return None, leaves
    return (func, spec, tuple(sig)), leaves


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _has_meta(args: tuple, kwargs: dict) -> bool:
    """Whether an op's operands hold a meta tensor (one level of lists/tuples,
    which is where torch ops take tensors)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor) and t.is_meta:
                    return True
    return False


class MetaOps:
    """Ops with a meta operand, run on meta once per signature and then made
    from the recorded result's shapes: a replay passes through the same glue
    (masks, rotary tables, reshapes) every microbatch, and a meta kernel written
    in Python costs 0.1-0.5 ms where a fresh meta tensor costs a few us.

    The key is the op and each argument (a tensor's shape, strides, dtype and
    whether it is on meta; plain values as they are). Ops that change an
    operand's shape in place (``unsqueeze_``, ``resize_``), write to ``out=``,
    or take or return other objects run every time."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self.entries: dict = {}

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        key, leaves = _op_key(func, args, kwargs)
        if key is not None:
            hit = self.entries.get(key)
            if hit is not None:
                return _remake(hit, leaves)
        args, kwargs = _on_meta(func, args, kwargs)
        out = func(*args, **kwargs)
        if key is not None:
            # an output that is an operand already on meta is that operand again
            hit = _recipe(out, {id(x): i for i, x in enumerate(leaves) if _is_meta(x)})
            if hit is not None:
                if len(self.entries) >= self.size:
                    self.entries.clear()  # shapes that change every step: start over
                self.entries[key] = hit
        return out


class _ReplayMode(TorchFunctionMode):
    """Active while a stage replays the earlier stages' part: ops with a meta
    operand run on meta; value reads are answered from the log."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = _has_meta(args, kwargs)
        if func in _DECISIONS:
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


class _ShapeMode(TorchFunctionMode):
    """For :func:`shape_run`: ops with a meta operand run on meta; a value read
    of a meta tensor answers zero / False (the path taken is a guess there)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _has_meta(args, kwargs):
            if func in _DECISIONS:
                t = args[0]
                if func is torch.Tensor.tolist:
                    return torch.zeros(t.shape, dtype=t.dtype).tolist()
                return False if func in (torch.Tensor.__bool__, torch.equal) else 0
            args, kwargs = _on_meta(func, args, kwargs)
        return func(*args, **kwargs)


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


# -- logging value reads while running for real ---------------------------------

_READS = (
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__index__"),
    (torch.Tensor, "__complex__"),
    (torch, "equal"),
    (torch, "is_nonzero"),
)


def _log_reads(log: list) -> list:
    """Wrap the value-read methods so their answers are appended to ``log``
    (cheaper than a mode over every op); returns what :func:`_unlog` restores."""
    saved = []
    for owner, name in _READS:
        own = owner.__dict__.get(name)
        orig = getattr(owner, name)

        def read(*a, _orig=orig, **k):
            value = _orig(*a, **k)
            log.append(value)
            return value

        saved.append((owner, name, own))
        setattr(owner, name, read)
    return saved


def _unlog(saved: list) -> None:
    for owner, name, own in reversed(saved):
        if own is None:
            delattr(owner, name)  # inherited (torch._C.TensorBase) again
        else:
            setattr(owner, name, own)


# -- the frame walk -----------------------------------------------------------


def _frame_tensors(start, stop_code, skip: set[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Every tensor held by the locals of the frames from ``start`` outwards up
    to (not including) the frame running ``stop_code``: innermost frame first,
    locals in definition order, containers depth first, each object once.
    Module state (ids in ``skip``) and modules are left out."""
    out: list[torch.Tensor] = []
    names: list[str] = []
    seen: set[int] = set()

    def visit(value: Any, where: str, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(value, torch.Tensor):
            if id(value) in seen or id(value) in skip or isinstance(value, nn.Parameter):
                return
            seen.add(id(value))
            out.append(value)
            names.append(where)
            return
        if isinstance(value, (nn.Module, str, bytes, int, float, bool, type(None))):
            return
        if id(value) in seen:
            return
        if isinstance(value, dict):
            seen.add(id(value))
            for k, v in list(value.items()):
                visit(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for k, v in enumerate(value):
                visit(v, f"{where}[{k}]", depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            seen.add(id(value))
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name, None), f"{where}.{f.name}", depth + 1)

    frame = start
    while frame is not None and frame.f_code is not stop_code:
        where = f"{frame.f_code.co_qualname if hasattr(frame.f_code, 'co_qualname') else frame.f_code.co_name}"
        for name, value in list(frame.f_locals.items()):
            visit(value, f"{where}: {name}", 0)
        frame = frame.f_back
    if frame is None:
        raise PipelineError(
            "a pipeline boundary was reached outside the model call of the step (is the "
            "model called from another thread?)"
        )
    return out, names


def _state_ids(root: nn.Module) -> set[int]:
    from annot.runtime.stages import shadow_modules

    ids: set[int] = set()
    for m in [root, *shadow_modules(root)]:
        ids.update(id(t) for t in m.parameters())
        ids.update(id(t) for t in m.buffers())
    return ids


# -- boundaries ---------------------------------------------------------------


def install_boundaries(root: nn.Module, boundaries: Sequence[str]) -> list:
    """Forward pre-hooks on the module at each boundary path (also inside the
    meta shadows of modules held by other stages). They act only while a
    :class:`ReplayStage` runs; returns the hook handles."""
    from annot.runtime.stages import Absent, resolve_module

    handles = []
    for k, path in enumerate(boundaries, start=1):
        module = resolve_module(root, path)
        parent, _, name = path.rpartition(".")
        holder = resolve_module(root, parent)._modules.get(name) if name else None
        if isinstance(holder, Absent):
            module = holder  # its call (not its shadow's) is what forward makes
        handles.append(module.register_forward_pre_hook(_make_hook(k, path)))
    return handles


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
    run.mode.__exit__(None, None, None)  # (the checks below read shapes without it)
    mine, names = _frame_tensors(frame, run.top_code, run.stage.state_ids)
    got = run.received["t"]
    path = run.stage.boundaries[run.index - 1]
    if len(got) != len(mine):
        raise PipelineError(
            f"pipeline stage {run.index}: {len(got)} tensors arrived at boundary {path!r} but "
            f"this rank's forward holds {len(mine)} there; the forward took a different path "
            "on the two ranks (control flow that depends on something other than the step's "
            "inputs and the model's values?)"
        )
    for j, (t, r) in enumerate(zip(mine, got)):
        if r is None:
            continue
        if t.shape != r.shape or t.dtype != r.dtype:
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
        run.patches = _log_reads(run.decisions_out)
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
    tensors, _ = _frame_tensors(frame, run.top_code, run.stage.state_ids)
    run.outputs = {"t": [None if t.is_meta else t for t in tensors], "d": run.decisions_out}
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
        self.state_ids = _state_ids(root)
        self.meta_ops = MetaOps()  # the replay's ops on meta, by signature
        self.outputs: Optional[dict] = None

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
            run.patches = _log_reads(run.decisions_out)
        try:
            out = call()
        except StageDone:
            self.outputs = run.outputs
            raise
        except RuntimeError as exc:
            if "meta" in str(exc) and not run.replaying:
                raise PipelineError(
                    f"pipeline stage {self.index} used a tensor that an earlier stage computed "
                    "but that did not cross the boundary (it was held by an object other than "
                    f"a local variable, tuple, list, dict or dataclass): {exc}"
                ) from exc
            raise
        finally:
            if run.replaying:
                run.mode.__exit__(None, None, None)
            if run.patches:
                _unlog(run.patches)
            torch.set_grad_enabled(run.grad_mode)
            _ACTIVE.pop()
        if run.crossed < self.index:
            raise PipelineError(
                f"the forward ended after {run.crossed} of the {len(self.boundaries)} pipeline "
                f"boundaries {list(self.boundaries)}; stage {self.index} never began (is a "
                "boundary module skipped by the control flow for this input?)"
            )
        return out
