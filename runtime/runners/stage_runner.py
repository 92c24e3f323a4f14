"""How this rank runs its pipeline stages: a runner, chosen once by the build
(:func:`annot.plan.stage_points.choose_runner`) and recorded on the layout
(:class:`annot.runtime.pipeline.layout.PipelineLayout`).

Both runners run the same plan (the same boundaries, the same stages):

* :class:`SourceRunner`: the stage-split rewriter cut the root's ``forward``
  into stage methods (``_annot_stage_k``), and for boundaries in the forwards
  it calls, those too (the nested split: the root's stage k calls
  ``self.model._annot_stage_k``); each stage is its method, and what a stage
  holds and sends is read from the source.
* :class:`ReplayRunner`: the model's own ``forward`` runs on every rank and
  the stages are cut at run time where a boundary module is called
  (:mod:`annot.runtime.runners.replay`); each stage holds the modules of its range of
  calls (:func:`annot.runtime.runners.stage_modules.call_order_stage_modules`).

The rest of the runtime asks the runner, not how the layout was made: the
build prunes by :attr:`StageRunner.cuts_at_run_time`, and the executor
(:class:`annot.runtime.pipeline.executor.PipelineExecutor`) runs the step body where
:attr:`StageRunner.body_runs_every_stage` says and each stage's forward with
:meth:`StageRunner.run_stage`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Optional, cast

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from annot.core.errors import PipelineError

if TYPE_CHECKING:
    from annot.runtime.pipeline.executor import LocalStage
    from annot.runtime.runners.replay import ReplayStage

__all__ = [
    "FROM_CALL",
    "ModelArgs",
    "ReplayRunner",
    "SourceRunner",
    "StageRunner",
    "call_supplied",
    "run_forward_hooks",
    "run_pre_hooks",
]

ModelArgs = tuple[tuple[Any, ...], dict[str, Any]]  # the model call's (args, kwargs)


class StageRunner(ABC):
    """One way to run the stages of a plan."""

    name: ClassVar[str]  # "source" or "replay": what build reports and explain shows
    # every rank runs forward's code for every stage: the build keeps placeholders
    # (shadows) of the modules other ranks hold and logs their outputs
    cuts_at_run_time: ClassVar[bool]
    # the step body runs at every stage's forward (its model call runs that stage);
    # False: at the first and the last stage's only, the middle stages running
    # their stage functions on what they receive
    body_runs_every_stage: ClassVar[bool]

    @abstractmethod
    def stage_modules(
        self, model: nn.Module, boundaries: tuple[str, ...], n_stages: int
    ) -> dict[int, set[str]]:
        """The module paths each stage holds."""

    @abstractmethod
    def stage_functions(
        self, module: nn.Module, layout: Any, wrap: Callable
    ) -> dict[int, Callable]:
        """This rank's stage functions by stage index (``wrap``: the
        ``@stage(recompute=True)``, identity otherwise)."""

    @abstractmethod
    def run_stage(self, stage: LocalStage, inputs: Any, model_args: Optional[ModelArgs]) -> Any:
        """The outputs of ``stage``'s forward, from ``inputs`` (the previous
        stage's outputs; None for stage 0) and ``model_args`` (the step body's
        model call, where the body runs this stage; else None). Raises
        :class:`annot.runtime.runners.replay_state.StageDone` where the forward stops at the
        stage's end inside the model call (:meth:`outputs_at_cut`)."""

    def outputs_at_cut(self, stage: LocalStage) -> Any:
        """The outputs ``stage`` sends on after :meth:`run_stage` stopped with
        ``StageDone``; only stages cut at run time stop so."""
        raise PipelineError(
            f"stage {stage.index}: the {self.name} runner's stages do not stop inside the "
            "model call (please report this)"
        )

    @property
    def output_arity(self) -> Optional[int]:
        return None


class _FromCall:
    """What a middle stage holds for an argument the last stage takes from the call."""

    def __repr__(self) -> str:
        return "<taken from the model call on the last stage>"


FROM_CALL = _FromCall()


def call_supplied(stages: Sequence[Any]) -> frozenset[str]:
    """The parameters of forward (stage 0's inputs) that the last stage reads
    and every stage before it leaves untouched (``StageMethod.untouched``):
    the last stage can take them from the model call where the step body
    runs, instead of each stage handing them on."""
    if len(stages) < 2:
        return frozenset()
    last = stages[-1]
    return frozenset(
        p
        for p in stages[0].inputs
        if p in last.inputs and all(p in s.untouched for s in stages[:-1] if p in s.inputs)
    )


class SourceRunner(StageRunner):
    """Stages as the stage methods the rewriter wrote
    (:class:`annot.rewriters.split.stage_split.StageSplit`), or (``split`` None) stage
    functions written by hand: stage 0 takes the model call's arguments, a
    later stage the previous one's outputs (``f(**out)`` for a dict,
    ``f(*out)`` for a tuple, else ``f(out)``).

    An argument of the model call that only the last stage reads (a target
    ``y`` in ``forward(x, y)``, HF's ``labels``: :func:`call_supplied`) is not
    handed through the pipeline: the step body runs on the last stage's rank
    with the same microbatch, and the last stage takes it from that call, as
    torch.distributed.pipelining gives the target to the last stage. Stage 0
    leaves it out of what it sends only where that is the same value: a
    tensor that does not require grad (its gradient would stay on the last
    rank), the very object the call passed (not one a decorator replaced) and
    sharing no memory with another argument (which stage 0 might change in
    place); otherwise it is sent as before. Middle stages hold
    :data:`FROM_CALL` for it and never read it."""

    name = "source"
    cuts_at_run_time = False
    body_runs_every_stage = False

    def __init__(self, split: Any = None):
        self.split = split
        self.from_call = call_supplied(split.stages) if split is not None else frozenset()
        # the root's decorator takes return_dict: the call's is given around the pipeline
        self.tuple_at_root = bool(split is not None and split.wrappers and split.tuple_at_root)
        # stage 0's parameters: where each of from_call sits in the call, and defaults
        self._position: dict[str, int] = {}
        self._default: dict[str, Any] = {}

    def stage_modules(self, model, boundaries, n_stages):
        from annot.runtime.runners.stage_modules import expand_module_paths, with_aliases

        if len(self.split.stages) != n_stages:
            raise PipelineError(
                f"the stage split has {len(self.split.stages)} stages but the mesh needs "
                f"pp * chunks = {n_stages}"
            )
        return with_aliases(
            model, {s.index: expand_module_paths(model, s.modules) for s in self.split.stages}
        )

    def stage_functions(self, module, layout, wrap):
        if self.from_call:
            params = inspect.signature(getattr(module, self.split.stages[0].method)).parameters
            positional = (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
            for i, (name, param) in enumerate(params.items()):
                if name in self.from_call and param.kind in positional:
                    self._position[name] = i
                self._default[name] = param.default
        return {
            s: wrap(getattr(module, self.split.stages[s].method)) for s in layout.local_stage_ids
        }

    def run_stage(self, stage: LocalStage, inputs: Any, model_args: Optional[ModelArgs]) -> Any:
        # the root's own forward pre-hooks and hooks, which its __call__ runs around
        # the whole forward: on the call's arguments where a stage reads them, on the
        # last stage's output (the stages are its methods, called without __call__)
        bound = getattr(stage.fn, "__self__", None)
        root = bound if isinstance(bound, nn.Module) else None
        if root is not None and model_args is not None and root._forward_pre_hooks:
            model_args = run_pre_hooks(root, model_args)
        out = self._run(stage, inputs, model_args)
        last = self.split is not None and stage.index == self.split.stages[-1].index
        if (
            self.tuple_at_root
            and last
            and model_args is not None
            and model_args[1].get("return_dict") is False
            and not isinstance(out, tuple)
        ):
            # what the root's @can_return_tuple / @capture_outputs does around the call
            out = out.to_tuple()
        if root is not None and last and model_args is not None and root._forward_hooks:
            out = run_forward_hooks(root, model_args, out)
        return out

    def _run(self, stage: LocalStage, inputs: Any, model_args: Optional[ModelArgs]) -> Any:
        if stage.index == 0:
            assert model_args is not None, "the step body runs stage 0"
            args, kwargs = model_args
            if self.split is not None and self.split.wrappers:
                self._check_output_request(stage.fn, kwargs)
                if self.tuple_at_root and "return_dict" in kwargs:
                    # the last stage's output is turned into a tuple (run_stage)
                    kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
            out = stage.fn(*args, **kwargs)
            if self.from_call and isinstance(out, dict):
                self._leave_out(out, model_args)
            return out
        # The stage's code may change the containers it receives (``saved.pop()``
        # of a received list); the executor finds the received tensors in
        # ``inputs`` again for B, so the stage gets containers of its own.
        inputs = _own_containers(inputs)
        if not (self.from_call and isinstance(inputs, dict)):
            return call_stage(stage.fn, inputs)
        missing = self.from_call.difference(inputs)
        if missing:
            inputs = {**inputs, **self._taken(missing, model_args, stage.index)}
        out = stage.fn(**inputs)
        if missing and isinstance(out, dict):
            for p in missing:
                if out.get(p) is FROM_CALL:
                    del out[p]
        return out

    def _argument(self, name: str, model_args: ModelArgs) -> tuple[Any, list]:
        """The model call's value of forward's parameter ``name`` (its default
        where the call leaves it out) and the call's other arguments."""
        args, kwargs = model_args
        if name in kwargs:
            return kwargs[name], [*args, *(v for k, v in kwargs.items() if k != name)]
        i = self._position.get(name, len(args))
        if i < len(args):
            return args[i], [*args[:i], *args[i + 1 :], *kwargs.values()]
        return self._default.get(name), [*args, *kwargs.values()]

    def _leave_out(self, out: dict, model_args: ModelArgs) -> None:
        """Drop from stage 0's outputs the call's arguments the last stage takes
        from its own call (see the class docstring)."""
        for p in self.from_call:
            v = out.get(p)
            if not isinstance(v, torch.Tensor) or v.requires_grad:
                continue
            called, others = self._argument(p, model_args)
            if v is called and not _shares_memory(v, others):
                del out[p]

    def _taken(self, names: frozenset[str], model_args: Optional[ModelArgs], index: int) -> dict:
        """What a stage after the first holds for ``names``, left out of its
        inputs by stage 0: the last stage's model call's values, a middle
        stage :data:`FROM_CALL`."""
        if index != self.split.stages[-1].index:
            return dict.fromkeys(names, FROM_CALL)
        if model_args is None:
            raise PipelineError(
                f"stage {index} takes {sorted(names)} from the model call, but the step body "
                "did not run it (please report this)"
            )
        return {p: self._argument(p, model_args)[0] for p in names}

    def _check_output_request(self, fn: Callable, kwargs: dict) -> None:
        """Refuse a call that asks an output-wrapping decorator of a split
        forward (HF's @capture_outputs, @can_return_tuple) for what it gives
        around the whole call only: on the split it wraps single stages (a
        call's ``return_dict=False`` for the root's decorator is given by
        :meth:`run_stage`)."""
        config = getattr(getattr(fn, "__self__", None), "config", None)
        asked = self.split.output_request(kwargs, config)
        if asked is not None:
            raise PipelineError(
                f"{asked} on a pipeline run by the source split: the decorator collects or "
                "converts the outputs of the whole call, and on the split it wraps single "
                "stages, so it would see part of the model or a stage's dict. Use "
                "runner='replay', which runs the model's own forward, or leave the argument out"
            )

    @property
    def output_arity(self) -> Optional[int]:
        return self.split.output_arity if self.split is not None else None


class ReplayRunner(StageRunner):
    """Stages cut at run time at module calls (:mod:`annot.runtime.runners.replay`).
    ``calls``: the module paths each stage calls, from one meta forward
    (:func:`annot.runtime.runners.stage_modules.stage_calls`), or None (registration order)."""

    name = "replay"
    cuts_at_run_time = True
    body_runs_every_stage = True

    def __init__(self, calls: Optional[dict[int, set[str]]] = None):
        self.calls = calls

    def stage_modules(self, model, boundaries, n_stages):
        from annot.runtime.runners.stage_modules import call_order_stage_modules

        return call_order_stage_modules(model, tuple(boundaries), self.calls)

    def stage_functions(self, module, layout, wrap):
        from annot.runtime.runners.placeholder import install_output_log
        from annot.runtime.runners.replay import ReplayStage, install_boundaries

        if layout.recompute:
            raise PipelineError(
                f"@stage(recompute=True) on {type(module).__name__}: its stages are cut "
                "inside nested forwards, so there is no stage function to recompute; put "
                "@recompute on the block classes instead (annot.recompute)"
            )
        if not getattr(module, "_annot_boundaries_installed", False):
            install_boundaries(module, layout.boundaries)
            install_output_log(module, layout.logged)
            module._annot_boundaries_installed = True
        return {s: ReplayStage(module, s, layout.boundaries) for s in layout.local_stage_ids}

    def run_stage(self, stage: LocalStage, inputs: Any, model_args: Optional[ModelArgs]) -> Any:
        assert model_args is not None, "the step body runs every stage"
        args, kwargs = model_args
        module = stage.module
        if module is None:
            raise PipelineError(
                f"stage {stage.index} is cut at run time from its model's forward: give "
                "its LocalStage the model (module=)"
            )
        return stage.fn(inputs, lambda: module(*args, **kwargs))

    def outputs_at_cut(self, stage: LocalStage) -> Any:
        return cast("ReplayStage", stage.fn).outputs


def _shares_memory(t: torch.Tensor, others: Sequence[Any]) -> bool:
    """Whether a tensor among ``others`` (any nesting) shares ``t``'s storage."""
    try:
        mine = t.untyped_storage().data_ptr()
        for o in others:
            leaves = (o,) if isinstance(o, torch.Tensor) else tree_leaves(o)
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() == mine:
                    return True
    except (RuntimeError, NotImplementedError):  # a sparse, nested or wrapper tensor
        return True  # cannot tell: sent, as before
    return False


def _own_containers(x: Any) -> Any:
    """``x`` with each list, tuple and dict in it rebuilt (the values inside
    are the same objects)."""
    kind = type(x)
    if kind is dict or kind is OrderedDict:
        return kind((k, _own_containers(v)) for k, v in x.items())
    if kind is list:
        return [_own_containers(v) for v in x]
    if kind is tuple:
        return tuple(_own_containers(v) for v in x)
    return x


def run_pre_hooks(module: nn.Module, model_args: ModelArgs) -> ModelArgs:
    """``module``'s forward pre-hooks on a call's ``(args, kwargs)``, as
    ``nn.Module.__call__`` runs them."""
    args, kwargs = model_args
    for hid, hook in list(module._forward_pre_hooks.items()):
        if hid in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def run_forward_hooks(module: nn.Module, model_args: ModelArgs, out: Any) -> Any:
    """``module``'s forward hooks on a call's output, as ``nn.Module.__call__``
    runs them."""
    args, kwargs = model_args
    for hid, hook in list(module._forward_hooks.items()):
        if hid in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, out)
        else:
            result = hook(module, args, out)
        if result is not None:
            out = result
    return out


def call_stage(fn: Callable[..., Any], inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, tuple):
        return fn(*inputs)
    return fn(inputs)
