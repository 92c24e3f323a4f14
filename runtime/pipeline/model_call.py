"""What ``model(...)`` and ``model.backward(loss)`` are inside a pipelined
step body: a :class:`ModelCall` per microbatch, over the :class:`StepState`
that the executor (:class:`annot.runtime.pipeline.executor.PipelineExecutor`) keeps
for one step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from annot.core.errors import PipelineError
from annot.runtime.runners.replay_state import StageDone

if TYPE_CHECKING:
    from annot.runtime.pipeline.executor import PipelineExecutor

__all__ = ["NO_GRAD_BACKWARD", "ModelCall", "StepState"]


# model.backward in a step called under torch.no_grad(): refused, as loss.backward()
# is there, not skipped (a training step called there by mistake would train
# nothing, silently). With forward_only=True asked for, it is skipped (Megatron's
# forward_only: one step function for training and evaluation).
NO_GRAD_BACKWARD = (
    "model.backward(loss) in a step called under torch.no_grad(), which runs the forward "
    "only (an evaluation): call the training step with gradients enabled; for evaluation, "
    "leave model.backward out, or decorate with @annot.jit(..., forward_only=True), which "
    "skips it"
)


class StepState:
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
        self.weight_work: dict[tuple[int, int], Any] = {}  # I done, W to come
        self.grad_buckets: Any = None  # annot.runtime.grads.buckets.GradBuckets, if overlapping
        self.final_backward: set[Any] = set()  # each stage's last B/I/W: arm its buckets
        self.results: dict[int, Any] = {}
        self.forwarded: set[tuple[int, int]] = set()
        self.inbox: dict[int, dict[tuple, Any]] = {}
        self.handles: list[Any] = []  # annot.runtime.pipeline.p2p.Handle
        self.due: dict[int, int] = {}  # peer -> messages still to come from it this step
        self.posted: dict[
            int, Any
        ] = {}  # peer -> its next message's annot.runtime.pipeline.p2p.PostedRecv


class ModelCall:
    """What ``model(...)`` and ``model.backward(loss)`` map to inside the step
    body, for one microbatch on one rank."""

    def __init__(self, executor: PipelineExecutor, step: StepState, microbatch: int, stage: int):
        self._ex = executor
        self._step = step
        self.microbatch = microbatch
        self.stage = stage  # the stage whose F invoked the body
        self.called = False
        self.backward_called = False
        # set by the step (annot.jit) called under torch.no_grad(): backward refused
        self.refuse_backward = False

    @property
    def is_last(self) -> bool:
        """True where ``call(...)`` returns real outputs: the call at the last
        stage's forward (on its rank; in a V, rank 0 also holds the first
        stage, whose call is not), or the one call where a rank holds every stage."""
        ex = self._ex
        if ex.runner.body_runs_every_stage:
            return self.stage == ex.num_stages - 1
        return self.stage == ex.num_stages - 1 or len(ex.stages) == ex.num_stages

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
        if ex.runner.body_runs_every_stage:  # this call runs its stage only
            return ex.forward_stage(st, self.stage, i, (args, kwargs))
        if self.stage == 0:
            out = ex.forward_stage(st, 0, i, (args, kwargs))
            if not self.is_last:
                raise StageDone()  # the rest of the body (the loss) runs at the last stage
            for s in range(1, ex.num_stages):  # pp == 1: every stage is here
                out = ex.forward_stage(st, s, i, (args, kwargs))
            st.outputs.pop((last, i), None)
            return out
        out = ex.forward_stage(st, last, i, (args, kwargs))
        st.outputs.pop((last, i), None)
        return out

    def backward(self, loss: Any) -> None:
        """Register the microbatch's loss; the executor runs its backward when
        the schedule says B. Several calls add up. A no-op off the last stage."""
        self.backward_called = True
        if self.refuse_backward and self.is_last:
            raise PipelineError(NO_GRAD_BACKWARD)
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
