"""``@annot.jit``: the training step, run per microbatch (SageMaker ``@smp.step`` style).

    @annot.jit(model, microbatches=4, schedule="1f1b")
    def train_step(x, y):
        logits, loss = model(x, y)
        model.backward(loss)          # instead of loss.backward()
        return loss

    out = train_step(x, y)            # a StepOutput: one value per microbatch
    out.reduce_mean()                 # the full-batch mean loss

The body runs once per microbatch (tensor arguments split on dim 0). With
pipeline stages, ``model(...)`` runs this rank's stage when the schedule says
so, and the body's return values come from the last stage, sent to every
rank. Gradients are scaled so that they equal the single-device gradients of
the mean loss over the whole batch (each microbatch's loss is weighted by its
share of the batch), then averaged over dp and summed over tied stages.

Evaluation runs the forward of every microbatch only (no backward, no
gradient reduction): a step called under ``torch.no_grad()`` whose body
returns the loss without ``model.backward`` (which is refused there, as
``loss.backward()`` is), or ``@annot.jit(model, microbatches=4,
forward_only=True)``, which skips the body's ``model.backward`` (Megatron's
``forward_only``: one step function for both)::

    @annot.jit(model, microbatches=4)
    def eval_step(x, y):
        return model(x, y)[1]

    with torch.no_grad():
        val_loss = eval_step(x, y).reduce_mean()

The first call builds the executor (the plan, the schedule); later calls,
whatever their shapes, reuse it: nothing is traced, so control flow and
shapes may change from step to step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from annot.core.errors import HintError, PipelineError
from annot.parallel_model import ParallelModel, unwrap
from annot.runtime.pipeline.schedules import schedule_name
from annot.training.microbatch import StepOutput, split_microbatches

if TYPE_CHECKING:
    from annot.runtime.pipeline.executor import PipelineExecutor
    from annot.runtime.pipeline.model_call import ModelCall

__all__ = ["jit", "Step"]


class Step:
    """A step function run by annot (pipeline schedule, microbatches). Call it like the function it wraps."""

    def __init__(
        self,
        fn: Callable,
        model: ParallelModel,
        *,
        microbatches: int = 1,
        schedule: str = "1f1b",
        non_split: tuple[str, ...] = (),
        trace: bool = False,
        timeout_s: Optional[float] = None,
        forward_only: bool = False,
    ):
        model = unwrap(model)  # what torch.compile(model) returned
        if not isinstance(model, ParallelModel):
            raise HintError(
                f"annot.jit: model is a {type(model).__name__}; expected the result of "
                "annot.parallelize(...)"
            )
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"annot.jit: microbatches={microbatches!r}; expected an int >= 1")
        try:
            schedule = schedule_name(schedule)
        except PipelineError as exc:
            raise PipelineError(f"annot.jit: {exc}") from None
        self.fn = fn
        self.model = model
        self.microbatches = microbatches
        self.schedule = schedule
        self.non_split = tuple(non_split)
        self.trace = trace
        self.timeout_s = timeout_s
        self.forward_only = forward_only  # evaluation; also any call under torch.no_grad()
        self.executor_builds = 0  # how many times an executor was built (1 after the first call)
        self._executor: Optional[PipelineExecutor] = None
        self._scale = 1.0
        self._last = False  # the body runs the step's last microbatch (pp = 1)
        self._call: Optional[ModelCall] = None
        self._refuse_backward = False  # this call runs under torch.no_grad()
        functools.update_wrapper(self, fn)

    @property
    def pipelined(self) -> bool:
        p = self.model.pipeline
        return p is not None and p.num_stages > 1

    def _build(self) -> None:
        if self.pipelined:
            from annot.runtime.pipeline.executor import PipelineExecutor

            plan = self.model.pipeline
            self._executor = PipelineExecutor(
                plan.local_stages(self.model.module),
                num_stages=plan.num_stages,
                ctx=self.model.ctx,
                schedule=self.schedule,
                chunks=plan.chunks,
                v=plan.v,
                timeout_s=self.timeout_s,
                trace=self.trace,
                output_arity=plan.output_arity,
                forward_context=self.model.forward_context,
            )
        self.executor_builds += 1

    def __call__(self, *args: Any, **kwargs: Any) -> StepOutput:
        import torch

        mbs = split_microbatches(self.fn, args, kwargs, self.microbatches, self.non_split)
        if self.executor_builds == 0:
            self._build()
        from annot.runtime.process_groups import use

        # under torch.no_grad() loss.backward() fails too; forward_only=True skips it
        self._refuse_backward = not torch.is_grad_enabled() and not self.forward_only
        forward_only = self.forward_only or not torch.is_grad_enabled()
        self.model._step = self
        if not forward_only:  # evaluation leaves the gradients as they are
            self.model.begin_grad_reduce()
        fsdp = self.model.fsdp
        gathered = (
            fsdp.gathered() if forward_only and fsdp is not None else contextlib.nullcontext()
        )
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        with use(self.model.ctx), gathered, grad_mode:
            try:
                if not self.pipelined:
                    outs = []
                    for i, (a, k) in enumerate(mbs):
                        self._scale = 1.0 / len(mbs)
                        self._last = i == len(mbs) - 1
                        with self.model.forward_context():
                            outs.append(self.fn(*a, **k))
                else:
                    outs = self._run_pipeline(mbs, forward_only)
            finally:
                self.model._step = None
                self._call = None
                self._last = False
        if not forward_only:
            self.model.finish_gradients()
        return StepOutput(outs)

    def _run_pipeline(self, mbs: list, forward_only: bool) -> list:
        ex = self._executor
        assert ex is not None, "built by the first call"
        ex.tracer.clear()  # the trace shows the last step

        def body(i: int, call: ModelCall):
            self._call = call
            call.refuse_backward = self._refuse_backward
            a, k = mbs[i]
            return self.fn(*a, **k)

        return ex.run(
            len(mbs), body, grad_buckets=self.model.grad_buckets, forward_only=forward_only
        )

    # Called through ParallelModel while the step runs.
    def call(self, *args: Any, **kwargs: Any) -> Any:
        if self._call is not None:
            from annot.hf.models import pipeline_call_kwargs

            kwargs = pipeline_call_kwargs(self.model.module, kwargs)  # no KV cache across stages
            return self._call(*args, **kwargs)
        return self.model.module(*args, **kwargs)  # the step already installed the mesh

    def backward(self, loss, scale: Optional[float] = None) -> None:
        if self._call is not None:
            self._call.backward(loss)
            return
        if self._refuse_backward:
            from annot.runtime.pipeline.model_call import NO_GRAD_BACKWARD

            raise PipelineError(NO_GRAD_BACKWARD)
        if self.forward_only:  # skipped where asked (Megatron's forward_only)
            return
        s = self._scale if scale is None else scale
        if self._last:  # the last gradients of the step: reduce over dp as they land
            self.model.arm_grad_reduce()
        with self.model.backward_context():
            (loss * s).backward()

    @property
    def executor(self):
        """The :class:`annot.runtime.pipeline.executor.PipelineExecutor` running this
        rank's stages; None before the first call or without a pipeline."""
        return self._executor

    def trace_events(self) -> list:
        return self._executor.trace_events() if self._executor is not None else []

    def write_trace(self, path: str) -> Optional[str]:
        """Write the last step's timeline of every pipeline rank as one Chrome
        trace JSON (open it in Perfetto). ``path`` is a file or a directory
        (then ``annot-trace.json`` in it). Collective over the pp group: call
        it on every rank; rank 0 of each pipeline writes and gets the path."""
        import os

        import torch.distributed as dist

        from annot.runtime.pipeline.trace import write_chrome_trace

        events = self.trace_events()
        ctx = self.model.ctx
        if ctx.distributed and ctx.mesh.pp > 1:
            parts: list = [None] * ctx.mesh.pp
            dist.all_gather_object(parts, events, group=ctx.pp_group)
        else:
            parts = [events]
        if ctx.pp_rank != 0 or ctx.tp_rank != 0 or ctx.dp_rank != 0:
            return None
        if os.path.isdir(path) or path.endswith(os.sep) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, "annot-trace.json")
        return write_chrome_trace(path, {r: ev for r, ev in enumerate(parts)})

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """The plan: mesh, stages, schedule and this rank's rewritten source."""
        from annot.training.explain import explain_step

        return explain_step(self, args, kwargs)


def jit(
    model: ParallelModel,
    *,
    microbatches: int = 1,
    schedule: str = "1f1b",
    non_split: tuple[str, ...] = (),
    trace: bool = False,
    timeout_s: Optional[float] = None,
    forward_only: bool = False,
) -> Callable[[Callable], Step]:
    """Decorate a training-step function (``forward_only``: an evaluation
    step, whose body calls no ``model.backward``); see the module docstring."""

    def wrap(fn: Callable) -> Step:
        return Step(
            fn,
            model,
            microbatches=microbatches,
            schedule=schedule,
            non_split=non_split,
            trace=trace,
            timeout_s=timeout_s,
            forward_only=forward_only,
        )

    return wrap
