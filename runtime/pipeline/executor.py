"""The pipeline executor: run one training step over this rank's stages.

The user's step body runs once per microbatch (SageMaker ``@smp.step``
style). Inside it, ``model(...)`` maps to a
:class:`~annot.runtime.pipeline.model_call.ModelCall`: on the rank holding the first
stage it runs stage 0 on the body's arguments; on the rank holding the last
stage it runs that stage on the activations received and returns the real
outputs; ``model.backward(loss)`` registers the loss. The
executor walks this rank's list of :class:`~annot.runtime.pipeline.schedules.Action` and
does what each says:

===========  ==============================================================
``F(s, i)``  run stage ``s`` on microbatch ``i`` under autograd (the body is
             invoked here for the first stage, and for the last stage)
``SEND_F``   send the outputs to the rank of stage ``s + 1`` (async)
``RECV_F``   receive the inputs from the rank of stage ``s - 1``
``B(s, i)``  last stage: ``backward(loss * loss_scale(i))``; else backward
             of the outputs with the gradients received; keep the input
             gradients; free the microbatch
``I(s, i)``  zero-bubble schedules: B's input half (the gradients ``SEND_B``
             sends); ``W(s, i)`` later adds the weights' gradients
             (:mod:`annot.runtime.pipeline.split_backward`)
``SEND_B``   send the input gradients to the rank of stage ``s - 1``
``RECV_B``   receive the gradients of the outputs
===========  ==============================================================

Stages on the same rank (interleaved with ``pp == 1``) hand values over
locally, detached, so each stage's graph stays its own. Only tensors that
require grad cross the backward: other values (ints, masks, targets) cross
forward only, and a tensor that got no gradient is sent back as ``None``.

Gradients cross as a list in :func:`annot.runtime.pipeline.p2p_codec.tensors_requiring_grad`
order, the same on both sides of a boundary (:mod:`annot.runtime.pipeline.stage_values`).

Sends are async and waited at the end of the step (the executor's p2p:
:class:`annot.runtime.pipeline.messages.PipelineMessages`); every p2p wait
runs under :func:`annot.runtime.faults.failures.guard` with the timeout, so a dead or hung peer becomes
:class:`~annot.core.errors.RankFailure` instead of a hang. An exception on this
rank (a stage, the body, a bad value) is recorded with
:func:`annot.runtime.faults.store.report_failure` before it propagates, so the ranks
waiting on this one name it, its stage and the microbatch. Every message
carries its key ``(direction, stage, microbatch)``; one that arrives before
it is needed is kept until its RECV, so no schedule depends on two ranks
ordering their messages alike (only on not deadlocking, which
:func:`annot.runtime.pipeline.schedule_check.validate` checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from annot.core.errors import PipelineError, RankFailure
from annot.runtime.faults.store import report_failure
from annot.runtime.pipeline.messages import PipelineMessages, check_shareable, posts_early
from annot.runtime.pipeline.model_call import ModelCall, StepState
from annot.runtime.pipeline.p2p_codec import tensors_requiring_grad
from annot.runtime.pipeline.schedule_check import validate
from annot.runtime.pipeline.schedules import (
    CATEGORY,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    V_SCHEDULES,
    Action,
    B,
    F,
    I,
    W,
    get_schedule,
    rank_stages,
    schedule_name,
)
from annot.runtime.pipeline.schedules import forward_only as _strip_backward
from annot.runtime.pipeline.split_backward import backward_input, backward_weight, release
from annot.runtime.pipeline.stage_values import grad_pairs, handoff, input_grads, keep_grads
from annot.runtime.pipeline.trace import Tracer
from annot.runtime.runners.replay_state import StageDone
from annot.runtime.runners.stage_runner import ModelArgs, SourceRunner, StageRunner

__all__ = ["LocalStage", "PipelineExecutor"]

LossScale = Union[None, Callable[[int], float], Sequence[float]]


@dataclass
class LocalStage:
    """One pipeline stage held by this rank."""

    index: int  # global (virtual) stage index, 0 .. num_stages - 1
    fn: Callable[..., Any]  # called by the runner (StageRunner.run_stage); by default
    # stage 0: fn(*args, **kwargs) of the model call; later stages: fn(**out) if the
    # previous output is a dict, fn(*out) if a tuple, else fn(out)
    module: Optional[nn.Module] = None  # holds its parameters
    runner: StageRunner = field(default_factory=SourceRunner)  # how fn runs


class PipelineExecutor(PipelineMessages):
    """Runs steps over this rank's stages following a schedule.

    ``stages`` are the :class:`LocalStage` s this rank holds: with ``pp``
    ranks and ``chunks`` stages per rank, pipeline rank ``r`` holds stages
    ``r, r + pp, ...`` of ``num_stages = pp * chunks``; their runner
    (:class:`~annot.runtime.runners.stage_runner.StageRunner`, one for all) says where
    the step body runs and how each stage's function is called. ``ctx`` is the
    :class:`annot.runtime.process_groups.ParallelContext` (None: one process, ``pp == 1``).
    ``output_arity`` is how many values the model returns, so that
    ``a, b = model(...)`` unpacks on ranks without the last stage.
    ``post_receives`` posts each RECV's receive one action early under gloo
    (:func:`~annot.runtime.pipeline.messages.posts_early`); off by default:
    on 2 shared CPU cores it made a tiny model's step 1.1-1.5x slower
    (``benchmarks/pp.py`` (c)), the peer's loop thread woken on a busy core.
    """

    def __init__(
        self,
        stages: list[LocalStage],
        *,
        num_stages: int,
        ctx: Any = None,
        schedule: str = "1f1b",
        chunks: int = 1,
        v: bool = False,
        timeout_s: Optional[float] = None,
        trace: bool = False,
        output_arity: Optional[int] = None,
        forward_context: Callable[[], Any] = contextlib.nullcontext,
        post_receives: bool = False,
    ):
        if ctx is None:
            from annot.runtime.process_groups import current

            ctx = current()
        self.ctx = ctx
        self.forward_context = forward_context  # e.g. autocast for mixed precision
        self.pp = ctx.mesh.pp if ctx is not None else 1
        self.pp_rank = ctx.pp_rank if ctx is not None else 0
        self.rank = ctx.rank if ctx is not None else 0
        self.num_stages = num_stages
        self.chunks = chunks
        self.v = v  # stages placed in a V (schedules.stage_rank)
        self.schedule_name = schedule
        self.timeout_s = timeout_s
        self.output_arity = output_arity
        if num_stages != self.pp * chunks:
            raise PipelineError(
                f"num_stages={num_stages} but pp({self.pp}) * chunks({chunks}) = "
                f"{self.pp * chunks}; each pipeline rank holds `chunks` stages"
            )
        want = sorted(rank_stages(self.pp_rank, self.pp, chunks, v))
        got = sorted(s.index for s in stages)
        if got != want:
            raise PipelineError(
                f"pipeline rank {self.pp_rank} must hold stages {want} (rank r holds stages "
                f"{'r and 2 pp - 1 - r' if v else 'r, r + pp, ...'}), but was given stages {got}"
            )
        if (schedule_name(schedule) in V_SCHEDULES) != v:
            raise PipelineError(
                f"schedule={schedule!r} with stages placed "
                f"{'in a V' if v else 'r, r + pp, ...'}: "
                + (
                    "the V placement runs schedule='zbv'"
                    if v
                    else f"{schedule!r} runs two stages per rank placed in a V; build the model "
                    "with annot.parallelize(..., chunks=2, placement='v')"
                )
            )
        self.stages = {s.index: s for s in stages}
        get_schedule(schedule, self.pp, self.pp, chunks)  # checks the name and chunks early
        self.runner = _one_runner(stages)
        self.peers = ctx.axis_ranks("pp") if ctx is not None else [0]
        self.group = ctx.pp_group if ctx is not None and self.pp > 1 else None
        self.device = ctx.device if ctx is not None else None
        self.post_early = post_receives and self.pp > 1 and posts_early(self.group)
        self._schedules: dict[tuple[int, bool], list[list[Action]]] = {}
        self._weights: dict[int, list[nn.Parameter]] = {}
        self.tracer = Tracer(self.rank, enabled=trace)
        self.routes = {}

    # -- public ---------------------------------------------------------------

    def schedule(self, microbatches: int, *, forward_only: bool = False) -> list[list[Action]]:
        """The (validated) schedule of a step with ``microbatches``, every rank's."""
        key = (microbatches, forward_only)
        if key not in self._schedules:
            sched = get_schedule(self.schedule_name, self.pp, microbatches, self.chunks)
            if forward_only:
                sched = _strip_backward(sched)
            validate(sched, self.pp, microbatches, self.chunks, forward_only=forward_only, v=self.v)
            self._schedules[key] = sched
        return self._schedules[key]

    def run(
        self,
        microbatches: int,
        body: Callable[[int, ModelCall], Any],
        *,
        loss_scale: LossScale = None,
        forward_only: bool = False,
        grad_buckets: Any = None,
    ) -> list[Any]:
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

        Returns the body's return values per microbatch, tensors detached,
        on every rank of the pipeline: the last stage's rank sends them to the
        others at the step's end (:meth:`share_outputs`).
        Parameter gradients accumulate in ``.grad``; the dp all-reduce is the
        caller's. With ``grad_buckets`` (a
        :class:`~annot.runtime.grads.buckets.GradBuckets`) a stage's
        parameters are armed just before its last backward action of the step
        (B, or ZB-H1's last W), so their dp all-reduce starts while the other
        stages still run; the caller's ``finish()`` completes it.
        """
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches={microbatches!r}; expected an int >= 1")
        st = StepState(microbatches, body, _scaler(loss_scale, microbatches), forward_only)
        actions = self.schedule(microbatches, forward_only=forward_only)[self.pp_rank]
        if grad_buckets is not None and not forward_only:
            # each stage's last backward work of the step, in this rank's order
            last = {a.stage: a for a in actions if a.kind in (B, I, W)}
            st.grad_buckets, st.final_backward = grad_buckets, set(last.values())
        self.count_receives(st, actions)  # every backend: recv counts them down
        for action, after in zip(actions, actions[1:] + [None]):
            if action in st.final_backward:
                st.grad_buckets.arm(self.weights(action.stage))
            if self.post_early and after is not None and after.kind in (RECV_F, RECV_B):
                self.post_ahead(st, after)
            self._do(st, action)
        self.wait_sends(st)
        self._check_empty(st)
        holds_last = self.owner(self.num_stages - 1) == self.pp_rank
        return self.share_outputs(
            [st.results[i] for i in range(microbatches)] if holds_last else None
        )

    def trace_events(self) -> list[dict[str, Any]]:
        """This rank's Chrome trace events so far (``trace=True``); merge ranks
        with :func:`annot.runtime.pipeline.trace.to_chrome_trace`."""
        return list(self.tracer.events)

    # -- actions --------------------------------------------------------------

    def _do(self, st: StepState, a: Action) -> None:
        if not self.tracer.enabled:  # the hot path: no span, no event name
            self._act(st, a)
            return
        args = {"stage": a.stage, "microbatch": a.microbatch}
        with self.tracer.span(str(a), CATEGORY.get(a.kind, "p2p"), args, tid=a.stage):
            self._act(st, a)

    def _act(self, st: StepState, a: Action) -> None:
        kind, s, i = a
        try:
            if kind == F:
                if st.forward_only:
                    with torch.no_grad(), self.forward_context():
                        self._run_forward_action(st, s, i)
                else:
                    with self.forward_context():
                        self._run_forward_action(st, s, i)
            elif kind in (B, I):
                self._backward(st, s, i, split=kind == I)
            elif kind == W:
                written = backward_weight(st.weight_work.pop((s, i)))
                if a in st.final_backward:  # written directly: no hook saw them
                    st.grad_buckets.ready(written)
            elif kind == SEND_F:
                out = st.outputs[(s, i)] if not st.forward_only else st.outputs.pop((s, i))
                self.send(st, a, out)
            elif kind == SEND_B:
                self.send(st, a, st.in_grads.pop((s, i)))
            elif kind == RECV_F:
                st.inputs[(s, i)] = x = self.recv(st, a)
                keep_grads(x)
            elif kind == RECV_B:
                st.out_grads[(s, i)] = self.recv(st, a)
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
        op = CATEGORY.get(a.kind, str(a))
        with contextlib.suppress(Exception):  # reporting must not hide the real error
            report_failure(
                self.rank, a.stage, op, a.microbatch, f"{type(exc).__name__}: {exc}", kind="error"
            )

    def _run_forward_action(self, st: StepState, s: int, i: int) -> None:
        if (s, i) in st.forwarded:  # pp == 1: the body ran every stage already
            return
        last = self.num_stages - 1
        if s != 0 and s != last and not self.runner.body_runs_every_stage:
            self.forward_stage(st, s, i)
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
                    "training step must (for evaluation, call the step under torch.no_grad(), or "
                    "@annot.jit(..., forward_only=True))"
                )
            if self.pp > 1:
                check_shareable(
                    result, i
                )  # refused here, naming the microbatch, not at the step's end

    def forward_stage(
        self, st: StepState, s: int, i: int, model_args: Optional[ModelArgs] = None
    ) -> Any:
        """Run stage ``s`` on microbatch ``i``'s inputs (received, or handed
        over on this rank) and, where the step body runs it, ``model_args``."""
        stage = self.stages[s]
        inputs = st.inputs.pop((s, i)) if s > 0 else None
        try:
            out = self.runner.run_stage(stage, inputs, model_args)
        except StageDone:
            self._forwarded(st, s, i, inputs, self.runner.outputs_at_cut(stage))
            raise
        self._forwarded(st, s, i, inputs, out)
        return out

    def _forwarded(self, st: StepState, s: int, i: int, inputs: Any, out: Any) -> None:
        """Keep stage ``s``'s inputs (their ``.grad`` goes back in B) and outputs
        (sent by SEND_F, or handed to the next stage on this rank)."""
        st.forwarded.add((s, i))
        if not st.forward_only and s > 0:
            st.inputs[(s, i)] = inputs  # its .grad is what B sends back
        if s < self.num_stages - 1:
            if self.owner(s + 1) == self.pp_rank:
                st.inputs[(s + 1, i)] = handoff(out, self.device)
                if not st.forward_only:
                    st.outputs[(s, i)] = out
            else:
                st.outputs[(s, i)] = out  # sent by SEND_F, kept for B

    def _backward(self, st: StepState, s: int, i: int, split: bool = False) -> None:
        """B, or with ``split`` its input half I (the rest waits for W)."""
        if s == self.num_stages - 1:
            loss = st.losses.pop(i)
            outputs, grads = [loss * st.scale(i)], None
        else:
            pairs = grad_pairs(st.outputs.pop((s, i)), st.out_grads.pop((s, i)), s, i)
            outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
        inputs = st.inputs.pop((s, i)) if s > 0 else None
        if split:
            received = tensors_requiring_grad(inputs)
            grads, work = backward_input(outputs, grads, received, self.weights(s))
            st.weight_work[(s, i)] = work
            if s == self.num_stages - 1 and work is not None and work.retains_graph:
                release(loss)  # the step's results must not keep the retained graph alive
        else:
            if outputs:
                torch.autograd.backward(outputs, grads)
            grads = input_grads(inputs) if s > 0 else None
        del outputs, inputs
        if s > 0:
            if self.owner(s - 1) == self.pp_rank:
                st.out_grads[(s - 1, i)] = grads
            else:
                st.in_grads[(s, i)] = grads

    def weights(self, s: int) -> list[nn.Parameter]:
        """The trainable parameters stage ``s`` may reach (its module's)."""
        if s not in self._weights:
            module = self.stages[s].module
            params = module.parameters() if module is not None else ()
            self._weights[s] = [p for p in params if p.requires_grad]
        return self._weights[s]

    def _check_empty(self, st: StepState) -> None:
        left = {
            "activations": list(st.outputs),
            "inputs": list(st.inputs),
            "gradients": list(st.out_grads) + list(st.in_grads),
            "losses": list(st.losses),
            "weight gradients": list(st.weight_work),
            "messages": [k for box in st.inbox.values() for k in box],
            "posted receives": list(st.posted),
        }
        left = {k: v for k, v in left.items() if v}
        if left:
            raise PipelineError(
                f"rank {self.rank}: the step ended with values left over {left}; the schedule "
                "and the executor disagree (please report this with the schedule name)"
            )


def _one_runner(stages: list[LocalStage]) -> StageRunner:
    """The runner of this rank's ``stages`` (one layout's: the same kind for all)."""
    kinds = sorted({type(s.runner).__name__ for s in stages})
    if len(kinds) > 1:
        raise PipelineError(
            f"this rank's stages have different runners ({', '.join(kinds)}); the stages of "
            "one pipeline run one way (PipelineLayout.local_stages gives them their runner)"
        )
    return stages[0].runner


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
