"""The pipeline executor: run one training step over this rank's stages.

The user's step body runs once per microbatch (SageMaker ``@smp.step``
style). Inside it, ``model(...)`` maps to a :class:`ModelCall`: on the rank
holding the first stage it runs stage 0 on the body's arguments; on the rank
holding the last stage it runs that stage on the activations received and
returns the real outputs; ``model.backward(loss)`` registers the loss. The
executor walks this rank's list of :class:`~annot.runtime.schedules.Action` and
does what each says:

===========  ==============================================================
``F(s, i)``  run stage ``s`` on microbatch ``i`` under autograd (the body is
             invoked here for the first stage, and for the last stage)
``SEND_F``   send the outputs to the rank of stage ``s + 1`` (async)
``RECV_F``   receive the inputs from the rank of stage ``s - 1``
``B(s, i)``  last stage: ``backward(loss * loss_scale(i))``; else backward
             of the outputs with the gradients received; keep the input
             gradients; free the microbatch
``SEND_B``   send the input gradients to the rank of stage ``s - 1``
``RECV_B``   receive the gradients of the outputs
===========  ==============================================================

Stages on the same rank (interleaved with ``pp == 1``) hand values over
locally, detached, so each stage's graph stays its own. Only tensors that
require grad cross the backward: other values (ints, masks, targets) cross
forward only, and a tensor that got no gradient is sent back as ``None``.

Gradients cross as a list in :func:`annot.runtime.p2p_codec.tensors_requiring_grad`
order, the same on both sides of a boundary.

Sends are async and waited at the end of the step; every p2p wait runs under
:func:`annot.runtime.faults.guard` with the timeout, so a dead or hung peer becomes
:class:`~annot.errors.RankFailure` instead of a hang. An exception on this
rank (a stage, the body, a bad value) is recorded with
:func:`annot.runtime.fault_store.report_failure` before it propagates, so the ranks
waiting on this one name it, its stage and the microbatch. Every message
carries its key ``(direction, stage, microbatch)``; one that arrives before
it is needed is kept until its RECV, so no schedule depends on two ranks
ordering their messages alike (only on not deadlocking, which
:func:`annot.runtime.schedule_check.validate` checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.errors import PipelineError, RankFailure
from annot.runtime.fault_store import report_failure
from annot.runtime.p2p import recv_pytree, send_pytree
from annot.runtime.p2p_codec import flatten, tensors_requiring_grad, unflatten
from annot.runtime.replay import ReplayStage, StageDone
from annot.runtime.schedule_check import validate
from annot.runtime.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    get_schedule,
)
from annot.runtime.schedules import forward_only as _strip_backward
from annot.runtime.trace import Tracer

__all__ = ["LocalStage", "PipelineExecutor", "ModelCall"]

LossScale = Union[None, Callable[[int], float], Sequence[float]]


@dataclass
class LocalStage:
    """One pipeline stage held by this rank."""

    index: int  # global (virtual) stage index, 0 .. num_stages - 1
    fn: Callable[..., Any]  # stage 0: fn(*args, **kwargs) of the model call; later
    # stages: fn(**out) if the previous output is a dict, fn(*out) if a tuple, else fn(out)
    module: Optional[nn.Module] = None  # holds its parameters


# -- pytrees: what annot.runtime.p2p carries, in its flatten order ------------------


def _handoff(out: Any, device: Optional[torch.device]) -> Any:
    """A stage's outputs as the next stage's inputs on the same rank: the same
    values, tensors detached, so each stage keeps its own graph (as after p2p)."""
    tree, tensors = flatten(out, root="stage outputs")
    fresh = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
    return unflatten(tree, fresh, device=device)


def _keep_grads(inputs: Any) -> None:
    """Received tensors that require grad must collect a ``.grad`` (p2p gives
    leaves; anything else is asked to retain it)."""
    for t in tensors_requiring_grad(inputs):
        if not t.is_leaf:
            t.retain_grad()


def _input_grads(inputs: Any) -> list[Optional[torch.Tensor]]:
    """What B sends back: the ``.grad`` of each input tensor that requires
    grad (p2p's flatten order), None where one got no gradient."""
    return [t.grad for t in tensors_requiring_grad(inputs)]


def _grad_pairs(out: Any, grads: list, stage: int, microbatch: int) -> list[tuple]:
    """Pair each output tensor that requires grad with its gradient; skip Nones."""
    tensors = tensors_requiring_grad(out)
    if not isinstance(grads, list) or len(grads) != len(tensors):
        n = len(grads) if isinstance(grads, list) else type(grads).__name__
        raise PipelineError(
            f"stage {stage}, microbatch {microbatch}: {n} gradients arrived for "
            f"{len(tensors)} outputs that require grad; the two sides of the stage boundary "
            "disagree about its values (please report this)"
        )
    return [(t, g) for t, g in zip(tensors, grads) if g is not None]


def _detached(tree: Any) -> Any:
    """Tensors detached in tuples, lists and dicts; everything else as is."""
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, dict):
        return type(tree)((k, _detached(v)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_detached(v) for v in tree]
    if isinstance(tree, tuple):
        items = [_detached(v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree


def _call_stage(fn: Callable[..., Any], inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, tuple):
        return fn(*inputs)
    return fn(inputs)


# -- the executor -------------------------------------------------------------


class _Step:
    """Everything one step keeps per (stage, microbatch); emptied as it goes."""

    def __init__(self, microbatches: int, body: Callable, scale: Callable[[int], float], fwd_only):
        self.microbatches = microbatches
        self.body = body
        self.scale = scale
        self.forward_only = fwd_only
        self.inputs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.out_grads: dict[tuple[int, int], Any] = {}
        self.in_grads: dict[tuple[int, int], Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.results: dict[int, Any] = {}
        self.forwarded: set[tuple[int, int]] = set()
        self.inbox: dict[int, dict[tuple, Any]] = {}
        self.handles: list[Any] = []  # annot.runtime.p2p.Handle


class ModelCall:
    """What ``model(...)`` and ``model.backward(loss)`` map to inside the step
    body, for one microbatch on one rank."""

    def __init__(self, executor: PipelineExecutor, step: _Step, microbatch: int, stage: int):
        self._ex = executor
        self._step = step
        self.microbatch = microbatch
        self.stage = stage  # the stage whose F invoked the body
        self.called = False
        self.backward_called = False

    @property
    def is_last(self) -> bool:
        """True where ``call(...)`` returns real outputs (the last stage's rank;
        with replayed stages, the last stage's own call)."""
        if self._ex.replay:
            return self.stage == self._ex.num_stages - 1
        return self._ex._owner(self._ex.num_stages - 1) == self._ex.pp_rank

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.called:
            raise PipelineError(
                f"the model was called twice for microbatch {self.microbatch}; a pipelined "
                "step calls model(...) once per microbatch (return the values you need from "
                "that one call)"
            )
        self.called = True
        ex, st, i = self._ex, self._step, self.microbatch
        last = ex.num_stages - 1
        if ex.replay:
            return ex._forward(st, self.stage, i, (args, kwargs))
        if self.stage == 0:
            out = ex._forward(st, 0, i, (args, kwargs))
            if not self.is_last:
                raise StageDone()  # the rest of the body (the loss) runs on the last stage
            for s in range(1, ex.num_stages):  # pp == 1: every stage is here
                out = ex._forward(st, s, i)
            st.outputs.pop((last, i), None)
            return out
        out = ex._forward(st, last, i)
        st.outputs.pop((last, i), None)
        return out

    def backward(self, loss: Any) -> None:
        """Register the microbatch's loss; the executor runs its backward when
        the schedule says B. Several calls add up. A no-op off the last stage."""
        self.backward_called = True
        if not self.is_last or self._step.forward_only:
            return
        if not isinstance(loss, torch.Tensor):
            raise PipelineError(
                f"model.backward(loss) got a {type(loss).__name__}; expected the loss tensor "
                "computed from the model's outputs"
            )
        if not loss.requires_grad:
            raise PipelineError(
                f"model.backward(loss): the loss of microbatch {self.microbatch} does not "
                "require grad (computed under torch.no_grad(), or not from the model outputs?)"
            )
        losses = self._step.losses
        i = self.microbatch
        losses[i] = loss if i not in losses else losses[i] + loss


class PipelineExecutor:
    """Runs steps over this rank's stages following a schedule.

    ``stages`` are the :class:`LocalStage` s this rank holds: with ``pp``
    ranks and ``chunks`` stages per rank, pipeline rank ``r`` holds stages
    ``r, r + pp, ...`` of ``num_stages = pp * chunks``. ``ctx`` is the
    :class:`annot.runtime.mesh.ParallelContext` (None: one process, ``pp == 1``).
    ``output_arity`` is how many values the model returns, so that
    ``a, b = model(...)`` unpacks on ranks without the last stage.
    """

    def __init__(
        self,
        stages: list[LocalStage],
        *,
        num_stages: int,
        ctx: Any = None,
        schedule: str = "1f1b",
        chunks: int = 1,
        timeout_s: Optional[float] = None,
        trace: bool = False,
        output_arity: Optional[int] = None,
        forward_context: Callable[[], Any] = contextlib.nullcontext,
    ):
        if ctx is None:
            from annot.runtime.mesh import current

            ctx = current()
        self.ctx = ctx
        self.forward_context = forward_context  # e.g. autocast for mixed precision
        self.pp = ctx.mesh.pp if ctx is not None else 1
        self.pp_rank = ctx.pp_rank if ctx is not None else 0
        self.rank = ctx.rank if ctx is not None else 0
        self.num_stages = num_stages
        self.chunks = chunks
        self.schedule_name = schedule
        self.timeout_s = timeout_s
        self.output_arity = output_arity
        if num_stages != self.pp * chunks:
            raise PipelineError(
                f"num_stages={num_stages} but pp({self.pp}) * chunks({chunks}) = "
                f"{self.pp * chunks}; each pipeline rank holds `chunks` stages"
            )
        want = [self.pp_rank + c * self.pp for c in range(chunks)]
        got = sorted(s.index for s in stages)
        if got != want:
            raise PipelineError(
                f"pipeline rank {self.pp_rank} must hold stages {want} (rank r holds stages "
                f"r, r + pp, ...), but was given stages {got}"
            )
        self.stages = {s.index: s for s in stages}
        # Stages cut at run time (annot.runtime.replay): the body runs for every stage.
        self.replay = any(isinstance(s.fn, ReplayStage) for s in stages)
        get_schedule(schedule, self.pp, self.pp, chunks)  # checks the name and chunks early
        self._peers = ctx.axis_ranks("pp") if ctx is not None else [0]
        self._group = ctx.pp_group if ctx is not None and self.pp > 1 else None
        self._device = ctx.device if ctx is not None else None
        self._schedules: dict[tuple[int, bool], list[list[Action]]] = {}
        self.tracer = Tracer(self.rank, enabled=trace)
        self.last_rank_outputs: Optional[list[Any]] = None

    # -- public ---------------------------------------------------------------

    def schedule(self, microbatches: int, *, forward_only: bool = False) -> list[list[Action]]:
        """The (validated) schedule of a step with ``microbatches``, every rank's."""
        key = (microbatches, forward_only)
        if key not in self._schedules:
            sched = get_schedule(self.schedule_name, self.pp, microbatches, self.chunks)
            if forward_only:
                sched = _strip_backward(sched)
            validate(sched, self.pp, microbatches, self.chunks, forward_only=forward_only)
            self._schedules[key] = sched
        return self._schedules[key]

    def run(
        self,
        microbatches: int,
        body: Callable[[int, ModelCall], Any],
        *,
        loss_scale: LossScale = None,
        forward_only: bool = False,
    ) -> Optional[list[Any]]:
        """Run one step of ``microbatches``.

        ``body(i, call)`` is invoked once per microbatch on the ranks holding
        the first or the last stage (at the F of stage 0 on the first rank, at
        the F of the last stage on the last rank; once when ``pp == 1``) and
        never elsewhere. ``call(*args, **kwargs)`` is the model call;
        ``call.backward(loss)`` registers the loss, whose backward runs scaled
        by ``loss_scale(i)`` (default ``1 / microbatches``; pass a callable or
        a sequence of weights, e.g. ``n_i / N`` for uneven microbatches, to
        get the exact full-batch mean). ``forward_only`` runs no backward and
        the forwards under ``torch.no_grad()`` (evaluation).

        Returns the body's return values per microbatch on the rank holding
        the last stage, None elsewhere (see :meth:`broadcast_outputs`).
        Parameter gradients accumulate in ``.grad``; the dp all-reduce is the
        caller's.
        """
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches={microbatches!r}; expected an int >= 1")
        st = _Step(microbatches, body, _scaler(loss_scale, microbatches), forward_only)
        actions = self.schedule(microbatches, forward_only=forward_only)[self.pp_rank]
        for action in actions:
            self._do(st, action)
        self._wait_sends(st)
        self._check_empty(st)
        holds_last = self._owner(self.num_stages - 1) == self.pp_rank
        self.last_rank_outputs = (
            [st.results[i] for i in range(microbatches)] if holds_last else None
        )
        return self.last_rank_outputs

    def broadcast_outputs(self, outputs: Optional[list[Any]] = None) -> list[Any]:
        """The last stage's step outputs (``outputs`` there, else the last
        :meth:`run`'s), tensors detached, on every rank of the pipeline."""
        last = self.num_stages - 1
        holds_last = self._owner(last) == self.pp_rank
        if holds_last:
            outputs = self.last_rank_outputs if outputs is None else outputs
            if outputs is None:
                raise PipelineError("broadcast_outputs() before any run(): nothing to send")
            outputs = _detached(outputs)
        if self.pp == 1:
            return outputs
        src = self._peers[self._owner(last)]
        if not holds_last:
            return recv_pytree(
                src,
                group=self._group,
                device=self._device,
                what="step outputs",
                timeout_s=self.timeout_s,
                stage=self.pp_rank,
                peer_stage=last,
            )
        handles = [
            send_pytree(
                outputs,
                dst,
                group=self._group,
                what="step outputs",
                timeout_s=self.timeout_s,
                stage=last,
            )
            for dst in self._peers
            if dst != self.rank
        ]
        for h in handles:
            h.wait()
        return outputs

    def trace_events(self) -> list[dict[str, Any]]:
        """This rank's Chrome trace events so far (``trace=True``); merge ranks
        with :func:`annot.runtime.trace.to_chrome_trace`."""
        return list(self.tracer.events)

    # -- actions --------------------------------------------------------------

    def _owner(self, stage: int) -> int:
        return stage % self.pp

    def _do(self, st: _Step, a: Action) -> None:
        kind, s, i = a
        cat = {F: "forward", B: "backward"}.get(kind, "p2p")
        with self.tracer.span(str(a), cat, {"stage": s, "microbatch": i}, tid=s):
            try:
                if kind == F:
                    grad = torch.no_grad() if st.forward_only else contextlib.nullcontext()
                    with grad, self.forward_context():
                        self._run_forward_action(st, s, i)
                elif kind == B:
                    self._backward(st, s, i)
                elif kind == SEND_F:
                    out = st.outputs[(s, i)] if not st.forward_only else st.outputs.pop((s, i))
                    self._send(st, a, out)
                elif kind == SEND_B:
                    self._send(st, a, st.in_grads.pop((s, i)))
                elif kind == RECV_F:
                    st.inputs[(s, i)] = x = self._recv(st, a, self._owner(s - 1))
                    _keep_grads(x)
                elif kind == RECV_B:
                    st.out_grads[(s, i)] = self._recv(st, a, self._owner(s + 1))
            except RankFailure:
                raise  # another rank failed first; the store already says who
            except Exception as exc:
                self._report(exc, a)
                raise

    def _report(self, exc: BaseException, a: Action) -> None:
        """Record this rank's own failure in the fault store, so the ranks
        waiting on it name it (and this action) instead of timing out."""
        if self.ctx is None or not self.ctx.distributed:
            return
        op = {F: "forward", B: "backward"}.get(a.kind, str(a))
        try:
            report_failure(
                self.rank, a.stage, op, a.microbatch, f"{type(exc).__name__}: {exc}", kind="error"
            )
        except Exception:  # noqa: BLE001 - reporting must not hide the real error
            pass

    def _run_forward_action(self, st: _Step, s: int, i: int) -> None:
        if (s, i) in st.forwarded:  # pp == 1: the body ran every stage already
            return
        last = self.num_stages - 1
        if s != 0 and s != last and not self.replay:
            self._forward(st, s, i)
            return
        call = ModelCall(self, st, i, s)
        try:
            result = st.body(i, call)
        except StageDone:
            return  # this stage's part is done; the body's rest runs on the last stage
        if not call.called:
            raise PipelineError(
                f"the step body did not call the model for microbatch {i}; with pipeline "
                "stages every microbatch must call model(...) exactly once"
            )
        if call.is_last:
            st.results[i] = result
            if not st.forward_only and i not in st.losses:
                raise PipelineError(
                    f"the step body did not call model.backward(loss) for microbatch {i}; a "
                    "training step must (for evaluation, run with forward_only=True)"
                )

    def _forward(self, st: _Step, s: int, i: int, first_args: Any = None) -> Any:
        stage = self.stages[s]
        if self.replay:
            args, kwargs = first_args
            inputs = st.inputs.pop((s, i)) if s > 0 else None
            try:
                out = stage.fn(inputs, lambda: stage.module(*args, **kwargs))
            except StageDone:
                self._forwarded(st, s, i, inputs, stage.fn.outputs)
                raise
            self._forwarded(st, s, i, inputs, out)
            return out
        if s == 0:
            args, kwargs = first_args
            inputs = None
            out = stage.fn(*args, **kwargs)
        else:
            inputs = st.inputs.pop((s, i))
            out = _call_stage(stage.fn, inputs)
        self._forwarded(st, s, i, inputs, out)
        return out

    def _forwarded(self, st: _Step, s: int, i: int, inputs: Any, out: Any) -> None:
        """Keep stage ``s``'s inputs (their ``.grad`` goes back in B) and outputs
        (sent by SEND_F, or handed to the next stage on this rank)."""
        st.forwarded.add((s, i))
        if not st.forward_only and s > 0:
            st.inputs[(s, i)] = inputs  # its .grad is what B sends back
        if s < self.num_stages - 1:
            if self._owner(s + 1) == self.pp_rank:
                st.inputs[(s + 1, i)] = _handoff(out, self._device)
                if not st.forward_only:
                    st.outputs[(s, i)] = out
            else:
                st.outputs[(s, i)] = out  # sent by SEND_F, kept for B

    def _backward(self, st: _Step, s: int, i: int) -> None:
        if s == self.num_stages - 1:
            loss = st.losses.pop(i)
            torch.autograd.backward(loss * st.scale(i))
        else:
            out = st.outputs.pop((s, i))
            pairs = _grad_pairs(out, st.out_grads.pop((s, i)), s, i)
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            del out, pairs
        if s > 0:
            grads = _input_grads(st.inputs.pop((s, i)))
            if self._owner(s - 1) == self.pp_rank:
                st.out_grads[(s - 1, i)] = grads
            else:
                st.in_grads[(s, i)] = grads

    # -- p2p ------------------------------------------------------------------

    def _send(self, st: _Step, a: Action, payload: Any) -> None:
        direction, dst_stage, i = a.message
        dst = self._peers[self._owner(dst_stage)]
        handle = send_pytree(
            (direction, dst_stage, i, payload),
            dst,
            group=self._group,
            what="activations" if direction == F else "gradients",
            timeout_s=self.timeout_s,
            stage=a.stage,
            microbatch=i,
            peer_stage=dst_stage,
        )
        st.handles.append(handle)

    def _recv(self, st: _Step, a: Action, src_pp_rank: int) -> Any:
        """The payload of message ``a.message`` from its sender; messages from
        the same peer that arrive first are kept for their own RECV."""
        src = self._peers[src_pp_rank]
        key = a.message
        box = st.inbox.setdefault(src, {})
        while key not in box:
            msg = recv_pytree(
                src,
                group=self._group,
                device=self._device,
                what="activations" if a.kind == RECV_F else "gradients",
                timeout_s=self.timeout_s,
                stage=a.stage,
                microbatch=a.microbatch,
                peer_stage=a.stage - 1 if a.kind == RECV_F else a.stage + 1,
            )
            if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] in (F, B)):
                raise PipelineError(
                    f"rank {self.rank} expected a pipeline message for {a} from rank {src} but "
                    f"got a {type(msg).__name__}; another p2p exchange is interleaved with the "
                    "pipeline on this pair of ranks"
                )
            got = (msg[0], msg[1], msg[2])
            if got in box:
                raise PipelineError(f"rank {self.rank} received {got} from rank {src} twice")
            box[got] = msg[3]
        return box.pop(key)

    def _wait_sends(self, st: _Step) -> None:
        if not st.handles:
            return
        with self.tracer.span("wait sends", "p2p", {"count": len(st.handles)}, tid=self.pp_rank):
            for handle in st.handles:
                handle.wait()
        st.handles.clear()

    def _check_empty(self, st: _Step) -> None:
        left = {
            "activations": list(st.outputs),
            "inputs": list(st.inputs),
            "gradients": list(st.out_grads) + list(st.in_grads),
            "losses": list(st.losses),
            "messages": [k for box in st.inbox.values() for k in box],
        }
        left = {k: v for k, v in left.items() if v}
        if left:
            raise PipelineError(
                f"rank {self.rank}: the step ended with values left over {left}; the schedule "
                "and the executor disagree (please report this with the schedule name)"
            )


def _scaler(loss_scale: LossScale, microbatches: int) -> Callable[[int], float]:
    if loss_scale is None:
        return lambda i: 1.0 / microbatches
    if callable(loss_scale):
        return loss_scale
    scales = list(loss_scale)
    if len(scales) != microbatches:
        raise PipelineError(
            f"loss_scale has {len(scales)} weights for {microbatches} microbatches; give one "
            "per microbatch (e.g. n_i / N for microbatch sizes n_i summing to N)"
        )
    return lambda i: scales[i]
