"""Make gradients whole after the backward passes of a step.

- data parallel: average every gradient over the dp group (one flat buffer
  per dtype, so one all-reduce instead of one per parameter), or take the
  average that :class:`~annot.runtime.grads.buckets.GradBuckets` overlapped
  with the backward, or the reduce-scatter of FSDP2
  (:class:`~annot.runtime.fsdp.ShardedData`: each dp rank then holds a
  shard of every gradient, and the sums below work on the shards);
- tied weights across pipeline stages (embedding and LM head): sum the
  gradient over exactly the stages that hold the weight, so every copy takes
  the same optimizer step and the copies stay identical; first check that
  they are still one parameter (:func:`tie_verdict`: requires_grad alike, and
  equal values), as a single device's one Parameter is by construction;
- replicated parameters whose forward reads tp-sharded activations (marked
  ``annot_grad_sum = "tp"`` by the build, from ``Replicate(sum_grad=True)``):
  each tp rank holds a partial gradient; sum it over tp;
- experts split over ep (:mod:`annot.runtime.ep.experts`): the all-to-all's
  backward already summed what every rank of the expert group sent them, so
  they are summed over the ranks holding the same experts only (``edp``) and
  divided by dp, as the dp average divides the rest.

A sum over ranks must add this step's parts only: where a step starts with
gradients already there (accumulated over steps, no ``zero_grad`` between),
:func:`carried_grads` keeps them apart and the sum adds them back once (the
dp average needs no care: every rank carries the same gradient in).

``check_replicated_grads`` verifies the result: every parameter that is not
sharded over tp has the same gradient on every tp rank. ``clip_grad_norm_``
clips by the norm of the whole model's gradient, across the mesh.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from annot.core.errors import PipelineError, VerifyError
from annot.runtime.ep.shards import expert_degree
from annot.runtime.fsdp import local
from annot.runtime.pipeline.schedules import stage_rank

__all__ = [
    "carried_grads",
    "check_replicated_grads",
    "clip_grad_norm_",
    "reduce_gradients",
    "tie_verdict",
]


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype: one flat buffer, one collective each."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _flat_all_reduce(tensors: list[torch.Tensor], group, scale: float | None) -> None:
    for idx in _by_dtype(tensors):
        ts = [tensors[i] for i in idx]
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        offset = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters, each once (named_parameters drops tied duplicates)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _summed(module: nn.Module, ctx, pipeline) -> list[tuple[nn.Parameter, Any]]:
    """The parameters whose gradient a step sums over ranks, each with the
    group it is summed over (None: tp): tp partial sums, then tied copies."""
    out: list[tuple[nn.Parameter, Any]] = []
    if ctx.mesh.tp > 1:
        out += [(p, None) for _, p in _unique_params(module) if _sums_over_tp(p)]
    for tie in pipeline.ties if pipeline is not None else ():
        p = tie.local_param(module) if tie.group is not None else None
        if p is not None:
            out.append((p, tie))
    return out


def carried_grads(module: nn.Module, ctx, pipeline=None) -> dict[int, torch.Tensor]:
    """At a step's start: a copy of each gradient the step will sum over ranks
    that is already there (by parameter id; see the module docstring). Empty
    after ``zero_grad()``, the usual case."""
    if ctx is None or not ctx.distributed:
        return {}
    params = [p for p, _ in _summed(module, ctx, pipeline)] + _experts(module)
    return {id(p): local(p.grad).detach().clone() for p in params if p.grad is not None}


def _experts(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters split over an expert group."""
    return [p for _, p in _unique_params(module) if expert_degree(p) > 1]


def reduce_gradients(
    module: nn.Module,
    ctx,
    pipeline=None,
    dp_reduction=None,
    carried: Optional[dict[int, torch.Tensor]] = None,
) -> None:
    """Make this step's gradients whole: the dp average (``dp_reduction``, a
    :class:`~annot.runtime.grads.buckets.GradBuckets` or an
    :class:`~annot.runtime.fsdp.ShardedData`, holds it: ``finish()``, then one
    flat all-reduce of what it left, ``unreduced``; without one, a flat
    all-reduce per dtype of every gradient), tp partial sums and tied-weight
    sums. Sums commute with the average, so its place in the order is free.
    ``carried``: :func:`carried_grads` at the step's start, out of the sums."""
    if ctx is None or not ctx.distributed:
        return
    if dp_reduction is not None:  # first: finish writes every .grad back
        dp_reduction.finish()
    carried = carried or {}
    summed = _summed(module, ctx, pipeline)
    partial = [p for p, tie in summed if tie is None]
    v = getattr(pipeline, "v", False)
    verdicts = [
        (p, tie, tie_verdict(tie, p, ctx.mesh.pp, v)) for p, tie in summed if tie is not None
    ]
    _agree_on_ties(ctx, [v for *_, v in verdicts])
    ties = [(p, tie) for p, tie, (trains, _) in verdicts if trains]  # frozen: nothing to sum
    own = list({id(p): p for p in partial + [p for p, _ in ties]}.values())  # each once
    for p in own:  # this step's parts only
        if id(p) in carried:
            local(_grad(p)).sub_(carried[id(p)])
    if partial:
        _flat_all_reduce([local(_grad(p)) for p in partial], ctx.tp_group, None)
    for p, tie in ties:
        dist.all_reduce(local(_grad(p)), group=tie.group)
    for p in own:
        if id(p) in carried:
            local(_grad(p)).add_(carried[id(p)])
    if ctx.mesh.dp > 1:  # what no dp_reduction averaged (with FSDP2: scalar parameters)
        if dp_reduction is None:
            grads = [_grad(p) for _, p in _unique_params(module) if expert_degree(p) == 1]
        else:
            grads = [_grad(p) for p in dp_reduction.unreduced]
        if grads:
            _flat_all_reduce(grads, ctx.dp_group, 1.0 / ctx.mesh.dp)
        _reduce_experts(_experts(module), ctx, carried)


def _reduce_experts(params: list[nn.Parameter], ctx, carried: dict[int, torch.Tensor]) -> None:
    """Experts' gradients: this step's part summed over the ranks that hold the
    same experts, over dp in all (what was carried in is added back)."""
    if not params:
        return
    for p in params:
        if id(p) in carried:
            _grad(p).sub_(carried[id(p)])
    grads = [_grad(p) for p in params]
    if ctx.mesh.dp > ctx.mesh.ep:
        _flat_all_reduce(grads, ctx.edp_group, 1.0 / ctx.mesh.dp)
    else:
        for g in grads:
            g.mul_(1.0 / ctx.mesh.dp)
    for p in params:
        if id(p) in carried:
            _grad(p).add_(carried[id(p)])


SAMPLE = 4096  # elements of a tied copy compared each step (evenly strided)


def tie_verdict(tie, p: nn.Parameter, pp: int, v: bool = False) -> tuple[bool, Optional[str]]:
    """Whether the tied weight ``tie`` (``p``: this rank's copy) trains, and
    why its copies are no longer one parameter (None while they are):
    collective over ``tie.group``. On a single device the tie is one
    Parameter; here each stage holding it keeps a copy, and the copies stay
    one parameter only while they agree on ``requires_grad`` and take the
    same optimizer steps. They disagree where a copy was frozen by the name
    its own stage uses (``lm_head.weight``) and not by the single device's
    (``transformer.wte.weight``), and their values differ (compared on an
    evenly strided sample of :data:`SAMPLE` elements of this rank's shard)
    after another param group or weight decay for one name, a per-rank
    ``torch.nn.utils.clip_grad_norm_``, an in-place change of one copy.
    :func:`reduce_gradients` raises the reason on every rank of the tie's tp
    and dp replicas together (:func:`_agree_on_ties`)."""
    data = local(p).detach().reshape(-1)
    sample = data[:: max(1, data.numel() // SAMPLE)].double().sum()
    flag = torch.tensor(float(p.requires_grad), dtype=torch.float64, device=data.device)
    mine = torch.stack([flag, sample])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(tie.group))]
    dist.all_gather(parts, mine, group=tie.group)
    flags = [bool(t[0].item()) for t in parts]
    sums = [t[1].item() for t in parts]
    holders = sorted({stage_rank(s, pp, v) for s in tie.stages})  # the group's ranks, in order
    names = " / ".join(tie.names)
    if len(set(flags)) > 1:
        trains = [r for r, f in zip(holders, flags) if f]
        frozen = [r for r, f in zip(holders, flags) if not f]
        return True, (
            f"the weight tied across pipeline stages {names} is trainable on pipeline "
            f"rank(s) {trains} and frozen on {frozen}: on a single device it is one "
            "parameter, here each stage holding it keeps a copy under its own name. Set "
            "requires_grad on every copy, by every name it has, e.g. `for n, p in "
            f"model.named_parameters(): if n.endswith({tie.names!r}): p.requires_grad_(False)`"
        )
    if any(not (a == sums[0] or (a != a and sums[0] != sums[0])) for a in sums):
        return flags[0], (
            f"the copies of the weight tied across pipeline stages {names} differ between "
            f"pipeline ranks {holders} (sums of a sample: {sums}): they must take the same "
            "optimizer step on every rank: one param group and setting (lr, weight decay) "
            "for every name the weight has, model.clip_grad_norm_ (the whole model's norm) "
            "rather than torch.nn.utils.clip_grad_norm_ on each rank, and no in-place change "
            "of one copy"
        )
    return flags[0], None


def _agree_on_ties(ctx, verdicts: list[tuple[bool, Optional[str]]]) -> None:
    """Raise :class:`PipelineError` on every rank of the tp and dp replicas of
    this rank's tie groups when any of them found a tie's copies disagree
    (each group checks its own shard: one raising alone would leave the
    others waiting in the next collective). Every rank of a tp or dp group
    holds the same ties, so each calls this once a step."""
    if not verdicts:
        return
    reasons = [why for _, why in verdicts if why is not None]
    bad = torch.tensor([1.0 if reasons else 0.0], device=ctx.device)
    for axis in ("tp", "dp"):
        if getattr(ctx.mesh, axis) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=ctx.groups[axis])
    if bad.item():
        raise PipelineError(
            reasons[0]
            if reasons
            else "the copies of a weight tied across pipeline stages "
            "disagree on another tp or dp rank's shard (its error names them)"
        )


def _sums_over_tp(p: nn.Parameter) -> bool:
    return getattr(p, "annot_grad_sum", None) == "tp"


def check_replicated_grads(module: nn.Module, ctx, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Raise :class:`VerifyError` on every tp rank if the tp ranks disagree on
    the gradient of a parameter that is not sharded over tp, naming each one.

    Tp rank 0's gradients are broadcast (one flat buffer per dtype) and
    compared; the verdict is all-reduced so every rank raises together.
    """
    if ctx is None or not ctx.distributed or ctx.mesh.tp == 1:
        return
    from annot.runtime.tp.state_dict import shard_layouts

    sharded = shard_layouts(module)
    params = [(n, p) for n, p in _unique_params(module) if id(p) not in sharded]
    group = ctx.tp_group
    src = dist.get_global_rank(group, 0)
    bad = torch.zeros(len(params), dtype=torch.float32, device=ctx.device)
    # A missing gradient reads as zeros here, without setting one (verification
    # must not change what the optimizer sees).
    grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for _, p in params]
    for idx in _by_dtype(grads):
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in idx:
            g = grads[i]
            theirs = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
            if not torch.allclose(g, theirs, rtol=rtol, atol=atol):
                bad[i] = (g - theirs).abs().max().float() / theirs.abs().max().float().clamp_min(
                    1e-12
                )
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.any():
        names = [
            f"{params[i][0]} (off by up to {bad[i].item():.0%})"
            for i in bad.nonzero().flatten().tolist()
        ]
        raise VerifyError(
            f"the tp ranks disagree on the gradient of {len(names)} replicated parameter(s): "
            f"{', '.join(names)}. Each rank holds a partial gradient: the parameter's forward "
            "reads tp-sharded activations (per-head q/k norms, a norm or bias inside a "
            "column-parallel region). Hint its module Replicate(sum_grad=True) (in an HF tp "
            "plan: replicated_with_grad_allreduce) so annot sums it over tp, or shard it."
        )


def clip_grad_norm_(
    module: nn.Module,
    ctx,
    pipeline,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    dp_sharded: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole parallel model: the norm
    of the single-device model's gradient, on every rank, and every local
    gradient scaled by ``max_norm / (norm + 1e-6)`` where that is below 1.

    Each parameter counts once: a tp-sharded one as the sum of its shards; a
    tp-replicated one on tp rank 0 only; a weight tied across pipeline stages
    on the first stage holding it; over dp the gradients are already averaged
    (equal), so dp adds nothing, unless ``dp_sharded`` (FSDP2): each dp rank
    holds a shard of every gradient, and the shards add up over dp. Call it
    after the step's backward.
    """
    p = float(norm_type)
    params = []
    grads: dict[int, torch.Tensor] = {}
    for _, q in _unique_params(module):
        if q.grad is not None:
            params.append(q)
            grads[id(q)] = local(q.grad).detach()
    device = grads[id(params[0])].device if params else (ctx.device if ctx else torch.device("cpu"))
    inf = p == float("inf")
    skip: set[int] = set()
    if pipeline is not None:
        mine = set(pipeline.local_stage_ids)
        for tie in pipeline.ties:
            q = tie.local_param(module)
            if q is not None and min(tie.stages) not in mine:
                skip.add(id(q))
    distributed = ctx is not None and ctx.distributed
    from annot.runtime.tp.state_dict import shard_layouts

    sharded = shard_layouts(module) if distributed and ctx.mesh.tp > 1 else {}
    counted_rep = not distributed or ctx.tp_rank == 0
    counted = [
        q
        for q in params
        if id(q) not in skip
        and (id(q) in sharded or counted_rep)
        and grads[id(q)].numel()  # an empty dp shard (FSDP2: fewer rows than dp ranks)
    ]
    zero = torch.zeros((), device=device)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

    def combine(qs) -> torch.Tensor:
        parts = [torch.linalg.vector_norm(grads[id(q)].float(), p) for q in qs]
        if not parts:
            return zero.clone()
        return torch.stack(parts).max() if inf else torch.stack(parts).pow(p).sum()

    total = combine([q for q in counted if expert_degree(q) == 1])
    if distributed:
        for axis in ("tp", "pp", "dp") if dp_sharded else ("tp", "pp"):
            if getattr(ctx.mesh, axis) > 1:
                dist.all_reduce(total, op=op, group=ctx.groups[axis])
    if distributed and ctx.mesh.ep > 1:  # each rank of an expert group holds other experts
        experts = combine([q for q in counted if expert_degree(q) > 1])
        for axis in ("ep", "tp", "pp"):  # never dp: the experts are whole over it
            if getattr(ctx.mesh, axis) > 1:
                dist.all_reduce(experts, op=op, group=ctx.groups[axis])
        total = torch.maximum(total, experts) if inf else total + experts
    norm = total if inf else total.pow(1.0 / p)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for q in params:
        g = grads[id(q)]
        g.mul_(coef.to(g.device, g.dtype))
    return norm
