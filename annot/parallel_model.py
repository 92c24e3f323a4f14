"""``ParallelModel``: what :func:`annot.parallelize` returns on each rank.

A thin ``nn.Module`` around this rank's part of the model (its tp shard of its
pipeline stages). ``model(...)`` runs it; ``model.backward(loss)`` replaces
``loss.backward()`` and then makes the gradients whole: averaged over dp
(overlapped with the backward, :mod:`annot.runtime.grads.buckets`), summed
over the pipeline stages that share a tied weight. Inside an ``@annot.jit``
step the pipeline executor takes both calls over.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from annot.core.errors import PipelineError
from annot.runtime.tp.comm import compiling

if TYPE_CHECKING:
    from annot.runtime.fsdp import ShardedData

__all__ = ["ParallelModel", "clip_grad_norm_", "unwrap"]


class ParallelModel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        ctx,
        *,
        pipeline=None,
        report=None,
        autocast=None,
        verify=False,
        overlap_grad_reduce: bool = False,
        bucket_cap_mb: float = 25.0,
    ):
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.pipeline = pipeline  # annot.runtime.pipeline.layout.PipelineLayout or None
        self.report = report  # annot.build.report.BuildReport: what parallelize did
        self.autocast_dtype = autocast  # torch.bfloat16 with precision="bf16", else None
        self.verify = verify  # check replicated gradients agree over tp after each step
        self._step: Any = None  # the active jit step (set by annot.jit while it runs)
        self.preflight = None  # annot.build.preflight's check, run on the first call when set
        # stage_points.verify_call_order, on the first call of stages placed without a call order
        self.order_check: Optional[Callable[[tuple, dict], None]] = None
        self.dropout = None  # annot.runtime.tp.dropout.ShardedDropout's sites, from the pre-flight
        self._dropout_names = None
        self.overlap_grad_reduce = overlap_grad_reduce  # dp average in buckets during backward
        self.bucket_cap_mb = bucket_cap_mb
        self._buckets = None  # annot.runtime.grads.buckets.GradBuckets, built on first use
        self.fsdp: Optional[ShardedData] = None  # with parallelize(fsdp=True) at dp > 1
        self.compiled_blocks: list[str] = []  # paths whose forward torch.compile compiled
        self._warned_outer_compile = False
        self._no_dropout: set[bool] = set()  # modes an eager call drew no dropout mask in
        # gradients a step found already there, kept out of its sums over ranks
        self._carried_grads: Optional[dict[int, torch.Tensor]] = None
        self._wrap_checked = False  # check_attachments ran (at the first call)
        self._split_layers: Optional[list] = None  # tp_user_hooks.split_layers, found once

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__class__":  # fully_shard(model) by the user: refused
            from annot.runtime.wrap_guard import refuse_class_swap

            refuse_class_swap(self, value)
        super().__setattr__(name, value)

    def forward_context(self):
        """Where forward and the loss run: autocast (a no-op in fp32) and, where
        dropout sees tp shards, each rank's slice of the single-device mask."""
        from annot.runtime.precision import forward_context

        autocast = forward_context(self.ctx.device, self.autocast_dtype)
        if not self.dropout:
            return autocast
        stack = contextlib.ExitStack()
        stack.enter_context(autocast)
        stack.enter_context(self.dropout_context())
        return stack

    def dropout_context(self):
        """:class:`~annot.runtime.tp.dropout.ShardedDropout` over this rank's
        model, unless it is on already (never twice: each would draw a mask)."""
        from annot.runtime.tp.dropout import ShardedDropout, active, module_names

        if not self.dropout or active() is not None:
            return contextlib.nullcontext()
        if self._dropout_names is None:  # module id -> path, found once
            self._dropout_names = module_names(self.module)
        return ShardedDropout(self._dropout_names, self.dropout)

    def backward_context(self):
        """Autocast off for backward (a no-op in fp32)."""
        from annot.runtime.precision import backward_context

        return backward_context(self.ctx.device, self.autocast_dtype)

    @property
    def mesh(self):
        return self.ctx.mesh

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from annot.runtime.tp.layers import forget_shared_inputs

        if compiling() and not self._traceable():
            return self._eager_forward(*args, **kwargs)
        try:
            return self._forward(*args, **kwargs)
        finally:  # the tp layers' shared inputs matter within one forward only
            forget_shared_inputs()

    def check_attachments(self) -> None:
        """What users and libraries attached to the model since the last check:
        ``fully_shard`` around it refused (:mod:`annot.runtime.wrap_guard`); hooks on
        tp-split layers given whole tensors
        (:func:`annot.runtime.tp.user_hooks.view_hooks`). At the first call and
        the start of every training step."""
        from annot.runtime.tp.user_hooks import split_layers, view_hooks
        from annot.runtime.wrap_guard import check_unwrapped

        check_unwrapped(self)
        if self.ctx.mesh.tp > 1:
            if self._split_layers is None:  # the layers tp split stay: found once
                self._split_layers = split_layers(self.module)
            view_hooks(self._split_layers)
        root = self.module
        if (
            self.pipeline is not None
            and self.pipeline.num_stages > 1
            and (root._backward_hooks or root._backward_pre_hooks)
        ):
            from annot.core.errors import IntegrationError

            raise IntegrationError(
                f"a backward hook on the root module ({type(root).__name__}) of a pipeline: "
                "its gradients cross every stage and no rank holds them all. Register it on a "
                "module inside one stage, or build without pp"
            )

    def _traceable(self) -> bool:
        """Whether ``torch.compile(model)`` may trace this forward whole: a
        model in one stage, its pre-flight done, no pipeline step, FSDP2 or
        sharded dropout around it, and an eager call in this mode (training
        or eval) that drew no dropout mask. Otherwise annot's part runs
        eagerly and only what :meth:`compile` compiled runs compiled."""
        checked = self.module.training in self._no_dropout
        return self._traced_whole() and self.preflight is None and checked

    def _traced_whole(self) -> bool:
        """Whether annot's part of forward can ever be traced (see _traceable)."""
        one_stage = self.pipeline is None or self.pipeline.num_stages == 1
        return one_stage and self._step is None and self.fsdp is None and not self.dropout

    @torch.compiler.disable(
        reason="annot runs a model's first calls eagerly (the pre-flight, a check for "
        "dropout), and its pipelines, FSDP2 and sharded dropout always: use "
        "model.compile(fullgraph=True), which compiles the model in one stage (or each "
        "block) as one graph, or torch.compile(model) without fullgraph=True"
    )
    def _eager_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._traced_whole() and self.preflight is None:  # traced from the next call on
            from annot.runtime.compile import check_no_dropout

            out = check_no_dropout(self.module, self.forward, args, kwargs, "torch.compile(model)")
            self._no_dropout.add(self.module.training)
            return out
        quiet = self.compiled_blocks or self._traced_whole()  # (the pre-flight: once)
        if not quiet and not self._warned_outer_compile:
            self._warned_outer_compile = True
            warnings.warn(
                "torch.compile(model) on an annot model whose pipeline, jit step, FSDP2 or "
                "sharded dropout runs eagerly compiles nothing by itself; call model.compile(...) "
                "(or parallelize(..., compile=True)) to compile each block",
                stacklevel=3,
            )
        return self.forward(*args, **kwargs)

    def compile(self, **options: Any) -> None:
        """``torch.compile`` this rank's model after sharding: whole in one
        stage, else each block, as torchtitan does (:mod:`annot.runtime.compile`): ``options`` are
        ``torch.compile``'s (``backend=``, ``mode=``, ``dynamic=``, ...). The
        module tree and state-dict keys are unchanged; the pipeline, its
        replay and annot's reductions stay eager."""
        from annot.hf.models import nested_blocks
        from annot.runtime.compile import compile_blocks

        layout = self.pipeline
        staged = layout is not None and layout.num_stages > 1
        self.compiled_blocks += compile_blocks(
            self.module,
            options,
            container=nested_blocks(self.module),
            boundaries=layout.boundaries if staged else (),
            whole=not staged and self.fsdp is None,
        )

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._wrap_checked:
            self.check_attachments()
            self._wrap_checked = True
        if self.order_check is not None:  # once, before any stage runs
            order_check, self.order_check = self.order_check, None
            order_check(args, kwargs)
        if self.preflight is not None:  # once, before any collective
            check, self.preflight = self.preflight, None
            with self.forward_context():
                self.dropout = check(self.module, args, kwargs)
            if self.dropout:  # a step's context entered before the sites were known
                with self.dropout_context():
                    return self._forward(*args, **kwargs)
        if self._step is not None:
            return self._step.call(*args, **kwargs)
        if self.pipeline is not None and self.pipeline.num_stages > 1:
            raise PipelineError(
                "this model is split into pipeline stages: call it inside a step function "
                "decorated with @annot.jit(model, microbatches=M), e.g.\n"
                "    @annot.jit(model, microbatches=4)\n"
                "    def train_step(x, y):\n"
                "        logits, loss = model(x, y)\n"
                "        model.backward(loss)\n"
                "        return loss\n"
                "and for evaluation the same without model.backward, called under "
                "torch.no_grad() (or @annot.jit(model, microbatches=4, forward_only=True))"
            )
        from annot.runtime.process_groups import use

        with use(self.ctx), self.forward_context():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale: Optional[float] = None) -> None:
        """``loss.backward()`` for a parallel model (then dp / tied-weight reductions).

        Inside an ``@annot.jit`` step this registers the microbatch's loss and
        the pipeline runs its backward when the schedule says so.
        """
        if self._step is not None:
            self._step.backward(loss, scale)
            return
        from annot.runtime.process_groups import use

        self.begin_grad_reduce()
        self.arm_grad_reduce()
        with use(self.ctx), self.backward_context():
            (loss if scale is None else loss * scale).backward()
        self.finish_gradients()

    @property
    def grad_buckets(self):
        """The :class:`~annot.runtime.grads.buckets.GradBuckets` that average
        gradients over dp during the backward, or None (dp = 1, or
        ``overlap_grad_reduce=False``: one flat all-reduce after it; or FSDP2,
        which reduce-scatters them itself). Built
        from the trainable parameters on first use, again when they change."""
        ctx = self.ctx
        if self.fsdp is not None or not self.overlap_grad_reduce:
            return None
        if not ctx.distributed or ctx.mesh.dp == 1:
            return None
        from annot.runtime.ep.shards import expert_degree

        # experts split over ep are summed over their replicas only (grads.reduce)
        params = [p for p in self.module.parameters() if p.requires_grad and expert_degree(p) == 1]
        old = self._buckets
        if old is None or not old.holds(params):
            from annot.runtime.grads.buckets import GradBuckets

            if old is not None:
                old.close()
            self._buckets = GradBuckets(params, ctx.dp_group, 1.0 / ctx.mesh.dp, self.bucket_cap_mb)
        return self._buckets

    def begin_grad_reduce(self) -> None:
        """A new step: forget what an unfinished one left in the buckets (with
        FSDP2: accumulate gradients unreduced until :meth:`arm_grad_reduce`)."""
        from annot.runtime.grads.reduce import carried_grads

        self.check_attachments()
        # gradients accumulated over earlier steps: kept out of this step's sums
        # (FSDP2's sharded parameters hold them: nothing may be gathered here)
        if self.fsdp is not None:
            self.fsdp.reshard()
        self._carried_grads = carried_grads(self.module, self.ctx, self.pipeline)
        if self.fsdp is not None:
            self.fsdp.begin()
        buckets = self.grad_buckets
        if buckets is not None:
            buckets.reset()

    def arm_grad_reduce(self, params=None) -> None:
        """Let the coming backward start the dp all-reduce of ``params``
        (default: all) as their gradients land: call it before the backward
        that gives them their last gradient of the step."""
        if self.fsdp is not None:
            self.fsdp.arm()
        buckets = self.grad_buckets
        if buckets is not None:
            buckets.arm(params)

    def finish_gradients(self) -> None:
        """Average gradients over dp and sum tied weights' gradients over the
        stages that hold them. Called once per step, after all backwards. With
        ``verify`` it then checks every tp-replicated gradient is the same on
        every tp rank (:class:`annot.VerifyError` otherwise)."""
        from annot.runtime.grads.reduce import check_replicated_grads, reduce_gradients

        carried, self._carried_grads = self._carried_grads, None
        reduce_gradients(
            self.module, self.ctx, self.pipeline, self.fsdp or self.grad_buckets, carried
        )
        if self.verify:
            check_replicated_grads(self.module, self.ctx)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the whole parallel model (tp
        shards, pipeline stages, tied copies counted once); returns the total
        norm on every rank. Call it after the step, before ``opt.step()``."""
        from annot.runtime.grads.reduce import clip_grad_norm_

        return clip_grad_norm_(
            self.module,
            self.ctx,
            self.pipeline,
            max_norm,
            norm_type,
            dp_sharded=self.fsdp is not None,
        )

    # Checkpoint-friendly views: keys equal the single-device model's.
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from annot.runtime.process_groups import use
        from annot.runtime.tp.state_dict import full_state_dict

        with use(self.ctx):
            return _gather_stages(full_state_dict(self.module), self)

    def full_grads(self) -> dict[str, torch.Tensor]:
        from annot.runtime.process_groups import use
        from annot.runtime.tp.state_dict import full_grads

        with use(self.ctx):
            return _gather_stages(full_grads(self.module), self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load a single-device state dict (the plain model's keys): each rank
        takes what its stages hold, tp shards their slice. A key this rank
        holds under another name of a weight tied across the stages
        (``lm_head.weight`` for GPT-2's ``transformer.wte.weight``, which
        checkpoints store once) is read from that name. ``strict``: a key the
        rank holds that the dict lacks raises :class:`annot.CheckpointError`
        (in a pipeline too, where the rest of the dict is other stages'). Returns
        ``(missing_keys, unexpected_keys)`` of this rank, as ``load_state_dict``.
        In a pipeline with ``strict``, collective: every rank calls it."""
        from torch.nn.modules.module import _IncompatibleKeys

        from annot.core.errors import CheckpointError
        from annot.runtime.process_groups import use
        from annot.runtime.tp.state_dict import load_full_state_dict

        if self.pipeline is None:
            with use(self.ctx):
                return load_full_state_dict(self.module, state_dict, strict=strict)
        # every copy of a tied weight reads one entry: the first of its names there
        names = {n: t.names for t in self.pipeline.ties for n in t.names}
        local = {}
        for key in self.pipeline.local_keys:
            name = next((n for n in names.get(key, (key,)) if n in state_dict), None)
            if name is not None:
                local[key] = state_dict[name]
        missing = [k for k in self.pipeline.local_keys if k not in local]
        if strict:  # every rank raises, naming the ranks whose keys are missing
            every: list = [missing]
            if self.ctx.distributed:
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, missing)
            lacking = {r: m for r, m in enumerate(every) if m}
            if lacking:
                named = "; ".join(
                    f"rank {r}: {', '.join(m[:4])}{' ...' if len(m) > 4 else ''}"
                    for r, m in lacking.items()
                )
                raise CheckpointError(
                    f"load_full_state_dict: the state dict lacks keys that pipeline stages "
                    f"hold ({named}); it has {len(state_dict)} keys, e.g. "
                    f"{next(iter(state_dict), None)!r}, and must use the single-device model's "
                    "names. Pass strict=False to load only the keys that match"
                )
        with use(self.ctx):
            load_full_state_dict(self.module, local, strict=False)
        return _IncompatibleKeys(missing, [])

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a single-device state dict (no key
        under ``module.``, as the plain model's ``state_dict()`` or a
        checkpoint file gives it) goes to :meth:`load_full_state_dict`."""
        if state_dict and not any(k.startswith("module.") for k in state_dict) and not assign:
            return self.load_full_state_dict(dict(state_dict), strict=strict)
        return super().load_state_dict(state_dict, strict, assign)

    def extra_repr(self) -> str:
        return f"mesh={self.ctx.mesh!r}, rank={self.ctx.rank}"


def unwrap(model: Any) -> Any:
    """The :class:`ParallelModel` inside what ``torch.compile(model)``
    returned (its ``_orig_mod``); anything else as it is."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, nn.Module) and isinstance(inner, ParallelModel):
        return inner
    return model


def clip_grad_norm_(model: ParallelModel, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``annot.clip_grad_norm_(model, max_norm)``: see :meth:`ParallelModel.clip_grad_norm_`."""
    return unwrap(model).clip_grad_norm_(max_norm, norm_type)


def _gather_stages(local: dict[str, torch.Tensor], model: ParallelModel) -> dict:
    """With pp > 1 each stage holds part of the keys: merge them on every rank."""
    if model.pipeline is None or model.ctx.mesh.pp == 1:
        return local
    if model.pipeline is not None:
        local = {k: v for k, v in local.items() if k in set(model.pipeline.local_keys)}
    parts: list = [None] * model.ctx.mesh.pp
    dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()}, group=model.ctx.pp_group)
    merged: dict[str, torch.Tensor] = {}
    for p in parts:
        for k, v in p.items():
            merged.setdefault(k, v)
    return merged
