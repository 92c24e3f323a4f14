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
  (:class:`annot.runtime.runners.placeholder.Absent`), and any op mixing meta and real
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
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from annot.core.errors import PipelineError
from annot.runtime.frames import frame_tensors, named_frame_tensors, state_ids
from annot.runtime.runners.meta_ops import (
    MetaOps,
    has_meta,
)
from annot.runtime.runners.placeholder import called_module
from annot.runtime.runners.replay_state import ACTIVE, Run, StageDone
from annot.runtime.runners.value_reads import DECISIONS, log_reads, unlog

__all__ = ["ReplayStage", "install_boundaries"]


class _ReplayMode(TorchFunctionMode):
    """Active while a stage replays the earlier stages' part: ops with a meta
    operand run on meta; value reads are answered from the log."""

    def __init__(self, run: Run):
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


# -- boundaries ---------------------------------------------------------------


def install_boundaries(root: nn.Module, boundaries: Sequence[str]) -> list:
    """Forward pre-hooks on the module at each boundary path (also inside the
    meta shadows of modules held by other stages). They act only while a
    :class:`ReplayStage` runs; returns the hook handles."""
    # first of the module's pre-hooks: what the others do (sequence
    # parallelism's scatter) is the stage's work on what arrived
    return [
        called_module(root, path).register_forward_pre_hook(_make_hook(k, path), prepend=True)
        for k, path in enumerate(boundaries, start=1)
    ]


def _make_hook(k: int, path: str):
    def hook(module: nn.Module, args: tuple) -> None:
        if not ACTIVE:
            return
        run = ACTIVE[-1]
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


def _enter(run: Run, frame) -> None:
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
            "annot.runtime.runners.placeholder.register_collectors (transformers' output capture is "
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


def _leave(run: Run, frame) -> None:
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

    def _replay_failed(self, run: Run, exc: BaseException) -> str:
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
        run = Run(self, received, record=not last)
        run.top_code = ReplayStage.__call__.__code__
        self.outputs = None
        ACTIVE.append(run)
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
            ACTIVE.pop()
        if run.crossed < self.index:
            raise PipelineError(
                f"the forward ended after {run.crossed} of the {len(self.boundaries)} pipeline "
                f"boundaries {list(self.boundaries)}; stage {self.index} never began (is a "
                "boundary module skipped by the control flow for this input?)"
            )
        return out
