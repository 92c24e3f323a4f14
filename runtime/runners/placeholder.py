"""A module another pipeline stage holds, as this rank sees it: its
placeholder (:class:`Absent`, with the module's meta *shadow*), and the
output log that answers its calls while this rank replays the earlier
stages' part of forward (:func:`shadow_call`, :func:`install_output_log`):
what the stage that ran it for real recorded, made again as meta tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import Any, Optional, cast

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from annot.core.errors import PipelineError
from annot.runtime.runners.meta_ops import flat, pack, recipe, remake, signature, unpack
from annot.runtime.runners.replay_state import ACTIVE, Call, Run, replaying, running_live

__all__ = [
    "Absent",
    "NotHeld",
    "called_module",
    "install_output_log",
    "placement",
    "register_collectors",
    "resolve_module",
    "shadow_call",
    "shadow_modules",
]


class Absent(nn.Module):
    """Placeholder for a submodule held by another pipeline stage.

    With a ``shadow`` (the module itself, its weights left on the meta device
    and not registered: no parameters, no state-dict keys here), a stage that
    replays the earlier stages' part of forward (:mod:`annot.runtime.runners.replay`) runs
    the shadow for shapes, and attribute reads fall through to it."""

    shadow: Optional[nn.Module]  # set in __dict__: not a submodule
    shapes: dict[Any, Any]

    def __init__(self, path: str, shadow: Optional[nn.Module] = None):
        super().__init__()
        self.path = path
        self.__dict__["shadow"] = shadow  # not a submodule: its weights are not this rank's
        self.__dict__["shapes"] = {}  # shadow_call's cache

    def forward(self, *args, **kwargs):
        if self.shadow is not None and replaying():
            # another stage's work: shapes only (meta), even where its weights are real here
            return shadow_call(self, args, kwargs)
        raise PipelineError(
            f"module {self.path!r} belongs to another pipeline stage but was called here; "
            + (
                "its weights were placed by the order the model registers its modules, which "
                "differs from the order forward calls them: pass sample=<one microbatch of the "
                "model's arguments> to annot.parallelize so annot follows the calls"
                if self.shadow is not None
                else "the stage split missed a use of it (please report this with your model)"
            )
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("shadow")
            if shadow is None:
                raise
            value = getattr(shadow, name)
            if running_live() is not None and isinstance(value, torch.Tensor) and value.is_meta:
                return NotHeld.of(value, f"{self.path}.{name}")  # its shape, never its use
            return value

    def __getitem__(self, index: Any) -> Any:
        return self.__dict__["shadow"][index]

    def __len__(self) -> int:
        return len(self.__dict__["shadow"])

    def __iter__(self):
        return iter(self.__dict__["shadow"])

    def extra_repr(self) -> str:
        return f"held by another stage: {self.path}"


def _not_held(name: str, stage: int) -> str:
    return (
        f"pipeline stage {stage} reads {name!r} directly, but this stage does not hold it: "
        "annot placed it by the order the model registers its modules, which differs from "
        "where forward reads it, and its gradient would be lost. To fix: pass sample=<one "
        "microbatch of the model's arguments> to annot.parallelize, so annot follows the "
        "calls and reads (a parameter read by several stages is then held by each, its "
        "gradient summed over them)"
    )


class NotHeld(torch.Tensor):
    """A raw parameter of a module this rank keeps, held by another stage (or
    a tensor read through an :class:`Absent` while a stage runs): a meta tensor, for shapes while the rank replays the earlier
    stages' part of forward. Read by the part this rank runs for real, it
    refuses, naming the parameter, instead of letting an op mix the meta
    tensor into real ones (``x @ meta`` answers a CPU tensor of garbage)."""

    param_path: str  # the name it has in the model

    @staticmethod
    def of(t: torch.Tensor, name: str) -> NotHeld:
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.Tensor._make_subclass(NotHeld, t.detach().to("meta"), False)
        out.param_path = name
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        stage = running_live()
        if stage is not None and getattr(func, "__name__", "") != "__get__":
            held = [t for t in tree_leaves((args, kwargs)) if isinstance(t, NotHeld)]
            raise PipelineError(_not_held(held[0].param_path if held else "?", stage))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def resolve_module(root: nn.Module, path: str) -> nn.Module:
    """The module at ``path``, looking through :class:`Absent` into its shadow."""
    obj: Any = root
    for part in path.split(".") if path else ():
        if isinstance(obj, Absent) and obj.shadow is not None:
            obj = obj.shadow
        obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
    return obj


def shadow_modules(root: nn.Module) -> list[nn.Module]:
    """The meta shadows under ``root`` (to tell their tensors from activations)."""
    return [m.shadow for m in root.modules() if isinstance(m, Absent) and m.shadow is not None]


def _entry(run: Run, module: nn.Module) -> Optional[tuple]:
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
    run = ACTIVE[-1]
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


def _from_log(run: Run, entry: tuple, leaves: list) -> Any:
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
        run = ACTIVE[-1] if ACTIVE else None
        entry = _entry(run, self.module) if run is not None and run.replaying else None
        if entry is None:
            return self.__wrapped__(*args, **kwargs)
        leaves: list = []
        with torch._C.DisableTorchFunction():
            flat((args, kwargs), leaves)
        return _from_log(run, entry, leaves)


def called_module(root: nn.Module, path: str) -> nn.Module:
    """The module forward calls at ``path``: the placeholder where another
    stage holds it, else the module (also inside the meta shadows)."""
    parent, _, name = path.rpartition(".")
    holder = resolve_module(root, parent)._modules.get(name) if name else None
    return holder if isinstance(holder, Absent) else resolve_module(root, path)


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
    handles, done = [], set()
    for path, key in keys.items():
        module = called_module(root, path)
        if id(module) in done:
            continue
        done.add(id(module))
        kind = "absent" if isinstance(module, Absent) else placement(root, path)
        exit_ = module.register_forward_hook(_log_exit(), with_kwargs=True)
        handles.append(module.register_forward_pre_hook(_log_enter(key, kind, exit_.id)))
        handles.append(exit_)
        if kind == "shadow":
            module.forward = _FromLog(module, module.forward)
    return handles


def placement(root: nn.Module, path: str) -> str:
    """ "shadow" if ``path`` lies inside another stage's meta shadow here, else "own"."""
    obj: Any = root
    for part in path.split("."):
        obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
        if isinstance(obj, Absent):
            return "shadow"
    return "own"


def _log_enter(key: str, kind: str, exit_id: int):
    def hook(module: nn.Module, args: tuple) -> None:
        if not ACTIVE:
            return
        hooks = cast("OrderedDict[int, Any]", module._forward_hooks)
        if exit_id in hooks and next(reversed(hooks)) != exit_id:
            hooks.move_to_end(exit_id)  # after hooks added since (output capture)
        run = ACTIVE[-1]
        n = run.calls.get(key, 0)
        run.calls[key] = n + 1
        run.entered.append(key)
        lists = _collectors()
        sizes = [len(lst) for _, lst in lists]
        start = len(run.decisions_out)
        run.open.append(Call(key, n, start, len(run.entered), lists, sizes, module, kind))

    return hook


def _log_exit():
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not ACTIVE:
            return
        run = ACTIVE[-1]
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
