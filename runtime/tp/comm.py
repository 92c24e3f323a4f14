"""Megatron's tensor-parallel collectives, as autograd functions over the tp group.

Four conjugate pairs (forward / backward), read from ``annot.runtime.process_groups.current()``:

=====================  ==========================  ==========================
function               forward                     backward
=====================  ==========================  ==========================
``copy_to_tp(x)``      identity                    all-reduce the gradient
``reduce_from_tp(x)``  all-reduce                  identity
``gather_from_tp(x)``  all-gather along ``dim``    keep this rank's slice
``scatter_to_tp(x)``   keep this rank's slice      all-gather along ``dim``
=====================  ==========================  ==========================

and the two of Megatron's sequence parallelism (Korthikanti et al., 2022),
which replace the all-reduces when the activations between the row- and the
column-parallel layers are split along the sequence (a ring all-reduce *is* a
reduce-scatter then an all-gather, so this costs no more communication):

==========================  ===========================  ==========================
function                    forward                      backward
==========================  ===========================  ==========================
``gather_sequence(x)``      all-gather along ``dim``     reduce-scatter along ``dim``
``reduce_scatter_seq(x)``   reduce-scatter along ``dim`` all-gather along ``dim``
==========================  ===========================  ==========================

With no active context, or a tp degree of 1, each is the identity and does no
communication. A column-parallel then row-parallel block therefore costs one
all-reduce forward (``reduce_from_tp`` after the row layer) and one backward
(``copy_to_tp`` before the column layer).

Overlap (Megatron's, in backward): the entries the column layers make for
themselves (``CopyToTP`` and ``GatherSequence`` with ``handoff``) reduce the
sum of those layers' input gradients through an :class:`InputGradReduction`.
The layers hand their input gradients to it
(:mod:`annot.runtime.tp.column_matmul`) instead of returning them to autograd;
the last one to run starts the all-reduce (reduce-scatter) with
``async_op=True`` and computes its weight gradient while it runs; the
entry's backward waits. The values are those of one reduction of the
summed gradient; only the order changes. Only an entry no other code sees
hands off: a hook or ``autograd.grad`` on its output would miss the part
handed to the reduction.

The public functions never modify their argument. The parallel layers use the
in-place variants (``inplace=True``) on tensors they just produced, which saves
one activation-sized copy per collective.

Under ``torch.compile`` the same functions are traced: while dynamo traces
(:func:`compiling`), the plain helpers below issue torch's functional
collectives (``torch.distributed._functional_collectives``, ops the compiler
sees and orders) instead of the in-place c10d calls, and return new tensors;
the backward overlap and the column layers' shared entries (Python state
kept between autograd nodes) are off, so a compiled block computes the
same values by plain autograd. Callers always use the returned tensor.

Counting collectives: :class:`torch.distributed.tensor.debug.CommDebugMode`
counts the c10d calls made here (``c10d.allreduce_``, ``c10d._allgather_base_``,
``c10d._reduce_scatter_base_``)
in forward and backward, so tests use it directly::

    with CommDebugMode() as comm:
        block(x).sum().backward()
    assert comm.get_comm_counts()[torch.ops.c10d.allreduce_] == 2
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from annot.core.errors import HintError
from annot.runtime.process_groups import current

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "gather_sequence",
    "gather_along",
    "reduce_scatter_seq",
    "InputGradReduction",
    "start_all_reduce",
    "start_reduce_scatter",
    "compiling",
]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old
# names warn); keep both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def compiling() -> bool:
    """Whether dynamo is tracing this call (``torch.compile``): collectives
    must then be functional ops the compiler sees, and no Python state may
    pass between autograd nodes."""
    return torch.compiler.is_compiling()


_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def tp_env() -> tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, size, rank)`` of this rank's tp axis; ``(None, 1, 0)`` with no
    active context."""
    ctx = current()
    if ctx is None:
        return None, 1, 0
    return ctx.tp_group, ctx.mesh.tp, ctx.tp_rank


# --------------------------------------------------------------------------- #
# Plain (non-autograd) helpers, shared with the layers and the state-dict code.
# --------------------------------------------------------------------------- #


def split_local(x: torch.Tensor, dim: int, chunks: int, size: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``: ``x`` is viewed as ``chunks``
    equal blocks along ``dim`` and the rank takes its ``1/size`` of each block
    (concatenated in block order). Returns a view when it can (``chunks == 1``).
    """
    if size == 1:
        return x
    dim = dim % x.dim()
    full = x.shape[dim]
    local = full // (size * chunks)
    if chunks == 1:
        return x.narrow(dim, rank * local, local)
    shape = x.shape
    # (..., chunks, size, local, ...) -> pick the rank -> (..., chunks, local, ...)
    blocks = x.reshape(*shape[:dim], chunks, size, local, *shape[dim + 1 :])
    return blocks.select(dim + 1, rank).reshape(*shape[:dim], chunks * local, *shape[dim + 1 :])


def gather_full(
    x: torch.Tensor, dim: int, chunks: int, size: int, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """All-gather ``x`` from every rank of ``group`` along ``dim``, the inverse of
    :func:`split_local`: with ``chunks`` > 1 each rank's tensor holds its slice
    of every block and the result is in the full tensor's original order."""
    if size == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    shape = x.shape
    # Gather flat (the concatenated form every backend accepts), then view.
    if compiling():
        assert group is not None  # size > 1: a tp group (funcol takes no default)
        flat = funcol.all_gather_tensor(x.view(-1), 0, group)
    else:
        flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
        if not x.is_meta:  # meta: shapes only (a pipeline stage replaying another's part)
            _all_gather_single(flat, x.view(-1), group=group)
    buf = flat.view(size, *shape)
    if dim == 0 and chunks == 1:
        return buf.view(size * shape[0], *shape[1:])  # rank-major already: no copy
    out_shape = (*shape[:dim], size * shape[dim], *shape[dim + 1 :])
    if chunks == 1:
        # (size, ..., n, ...) -> (..., size, n, ...) -> merge
        return buf.movedim(0, dim).reshape(out_shape)
    local = shape[dim] // chunks
    # (size, ..., chunks, local, ...) -> (..., chunks, size, local, ...) -> merge
    blocks = buf.view(size, *shape[:dim], chunks, local, *shape[dim + 1 :])
    return blocks.movedim(0, dim + 1).reshape(out_shape)


def reduce_scatter_full(
    x: torch.Tensor, dim: int, size: int, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's contiguous ``1/size`` slice
    along ``dim`` (rank order): the reduce-scatter that :func:`gather_full`
    inverts. A meta tensor only shapes the result."""
    if size == 1:
        return x
    return _finished(start_reduce_scatter(x, dim, size, group)).contiguous()


def start_reduce_scatter(
    x: torch.Tensor, dim: int, size: int, group: Optional[dist.ProcessGroup]
) -> tuple[Optional[dist.Work], torch.Tensor]:
    """Start :func:`reduce_scatter_full`'s collective: ``(work, out)``, ``out``
    valid once ``work.wait()`` returned (``work`` None: a meta tensor, no
    collective)."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0).contiguous()  # the collective splits the flat dim-0 form
    if compiling():
        assert group is not None  # funcol takes no default group
        return None, funcol.reduce_scatter_tensor(rows, "sum", 0, group).movedim(0, dim)
    out = rows.new_empty((rows.shape[0] // size, *rows.shape[1:]))
    work = None if x.is_meta else _reduce_scatter_single(out, rows, group=group, async_op=True)
    return work, out.movedim(0, dim)


def all_reduce_(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], op=dist.ReduceOp.SUM
) -> torch.Tensor:
    """In-place all-reduce; returns ``x`` (under ``torch.compile``: the reduced
    copy, :func:`compiling`, so use the result). A meta tensor (a pipeline
    stage replaying another stage's part for shapes) is returned as is."""
    if compiling():
        assert group is not None  # funcol takes no default group
        return funcol.all_reduce(x, _REDUCE_OPS[op], group)
    if not x.is_meta:
        dist.all_reduce(x, op=op, group=group)
    return x


def start_all_reduce(
    x: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> tuple[Optional[dist.Work], torch.Tensor]:
    """Start an in-place all-reduce of ``x``: ``(work, x)``, as
    :func:`start_reduce_scatter`."""
    return (None if x.is_meta else dist.all_reduce(x, group=group, async_op=True)), x


def _finished(started: tuple[Optional[dist.Work], torch.Tensor]) -> torch.Tensor:
    work, out = started
    if work is not None:
        work.wait()
    return out


class InputGradReduction:
    """The reduction of a column-parallel entry's input gradient over tp,
    started early so that it overlaps a weight gradient's GEMM.

    ``start(t)`` starts the collective on ``t`` (:func:`start_all_reduce`,
    :func:`start_reduce_scatter`). The column layers that read the entry's
    output count themselves in forward (:meth:`read`) and hand their input
    gradients to :meth:`arrive` in backward; the last of them starts the
    collective on the sum. The entry's backward calls :meth:`finish` with
    whatever autograd still brought it (another op that read its output)
    and gets the reduced total: it waits for the started collective, and
    reduces what did not make it into that one (a layer whose output got no
    gradient, another reader) with a second collective of its own. Exact:
    the reduction is linear, and every rank runs the same graph."""

    __slots__ = ("start", "readers", "arrived", "partial", "started")

    def __init__(self, start: Callable[[torch.Tensor], tuple[Optional[dist.Work], torch.Tensor]]):
        self.start = start
        self.readers = 0
        self.arrived = 0
        self.partial: Optional[torch.Tensor] = None  # owned: summed in place
        self.started: Optional[tuple[Optional[dist.Work], torch.Tensor]] = None

    def read(self) -> None:
        self.readers += 1

    def arrive(self, grad: torch.Tensor) -> None:
        """Add a reader's input gradient (a tensor it made: summed in place);
        the last reader's arrival starts the collective."""
        self.arrived += 1
        self.partial = grad if self.partial is None else self.partial.add_(grad)
        if self.arrived == self.readers:
            self.started, self.partial = self.start(self.partial), None

    def finish(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The reduced input gradient (None if none came), the state reset
        for the next backward through the same graph."""
        started, partial = self.started, self.partial
        self.started = self.partial = None
        self.arrived = 0
        result = None if started is None else _finished(started)
        if grad is not None:
            partial = grad if partial is None else partial.add_(grad)
        if partial is not None:
            rest = _finished(self.start(partial))
            result = rest if result is None else result + rest
        return None if result is None else result.contiguous()


# --------------------------------------------------------------------------- #
# Autograd functions. ``group``/``size``/``rank`` are passed in explicitly so a
# layer reads the context once per forward.
# --------------------------------------------------------------------------- #


class CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce (sum of the ranks' input grads).
    With ``handoff`` (an entry only column layers see: ``tp_layers``' shared
    entry) the layers reading it start that all-reduce early
    (:class:`InputGradReduction`)."""

    @staticmethod
    def forward(ctx, x, group, inplace, handoff):
        ctx.set_materialize_grads(False)
        ctx.group = group
        ctx.inplace = inplace
        start = functools.partial(start_all_reduce, group=group)
        ctx.reduction = InputGradReduction(start) if handoff else None
        return x

    @staticmethod
    def backward(ctx, grad):
        if grad is not None and not ctx.inplace:
            grad = grad.clone()  # autograd may hand the same tensor to another branch
        if ctx.reduction is not None:
            return ctx.reduction.finish(grad), None, None, None
        return None if grad is None else all_reduce_(grad, ctx.group), None, None, None


class ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        if not inplace:
            x = x.clone()
        y = all_reduce_(x, group)
        if y is x and inplace:  # the caller's tensor, changed: safe for in-place ops after
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromTP(torch.autograd.Function):
    """Forward all-gather along ``dim`` (chunk-aware), backward own slice."""

    @staticmethod
    def forward(ctx, x, group, size, rank, dim, chunks):
        ctx.args = (dim, chunks, size, rank)
        return gather_full(x, dim, chunks, size, group)

    @staticmethod
    def backward(ctx, grad):
        return split_local(grad, *ctx.args).contiguous(), None, None, None, None, None


class ScatterToTP(torch.autograd.Function):
    """Forward own slice along ``dim`` (chunk-aware), backward all-gather."""

    @staticmethod
    def forward(ctx, x, group, size, rank, dim, chunks):
        ctx.args = (dim, chunks, size, group)
        return split_local(x, dim, chunks, size, rank).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_full(grad, *ctx.args), None, None, None, None, None


class GatherSequence(torch.autograd.Function):
    """Forward all-gather along ``dim``, backward reduce-scatter: enter a
    column-parallel layer from sequence shards (each rank's gradient for the
    whole sequence is partial over the ranks' columns). With ``handoff`` the
    column layers reading it start the reduce-scatter early
    (:class:`InputGradReduction`)."""

    @staticmethod
    def forward(ctx, x, group, size, dim, handoff):
        ctx.set_materialize_grads(False)
        ctx.args = (dim, size, group)
        start = functools.partial(start_reduce_scatter, dim=dim, size=size, group=group)
        ctx.reduction = InputGradReduction(start) if handoff else None
        return gather_full(x, dim, 1, size, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduction is not None:
            return ctx.reduction.finish(grad), None, None, None, None
        return (
            None if grad is None else reduce_scatter_full(grad, *ctx.args),
            None,
            None,
            None,
            None,
        )


class ReduceScatterSequence(torch.autograd.Function):
    """Forward reduce-scatter along ``dim``, backward all-gather: leave a
    row-parallel layer with this rank's sequence shard of the summed output."""

    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.args = (dim, 1, size, group)
        return reduce_scatter_full(x, dim, size, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_full(grad, *ctx.args), None, None, None


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward; backward all-reduces the
    gradient over the tp group (each rank only saw its shard's contribution)."""
    group, size, _ = tp_env()
    if size == 1 or not x.requires_grad:
        return x
    return CopyToTP.apply(x, group, False, False)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    """Leave a tensor-parallel region by summing the ranks' partial results:
    all-reduce forward, identity backward. ``x`` itself is left unchanged."""
    group, size, _ = tp_env()
    if size == 1:
        return x
    return ReduceFromTP.apply(x, group, False)


def gather_from_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """All-gather the ranks' shards along ``dim`` (rank order) so every rank holds
    the full tensor; backward keeps this rank's slice of the gradient."""
    group, size, rank = tp_env()
    if size == 1:
        return x
    return GatherFromTP.apply(x, group, size, rank, dim, 1)


def scatter_to_tp(x: torch.Tensor, dim: int = -1, chunks: int = 1) -> torch.Tensor:
    """Keep this rank's contiguous ``1/tp`` slice of ``x`` along ``dim`` (of each
    of ``chunks`` equal blocks along it); backward all-gathers the gradient.
    ``x.shape[dim]`` must divide by ``tp * chunks``."""
    group, size, rank = tp_env()
    if size == 1:
        return x
    if x.shape[dim] % (size * chunks):
        raise HintError(
            f"scatter_to_tp: dim {dim} of size {x.shape[dim]} is not divisible by "
            f"tp({size}) * chunks({chunks})"
        )
    return ScatterToTP.apply(x, group, size, rank, dim, chunks)


def check_sequence_split(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size:
        raise HintError(
            f"{what}: sequence parallelism splits dim {dim} of a {list(x.shape)} tensor "
            f"over tp={size} ranks, but {x.shape[dim]} does not divide by {size}; pad the "
            "sequence to a multiple of tp, or build with sequence_parallel=False"
        )


def gather_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the ranks' shards along ``dim``: all-gather
    forward, reduce-scatter of the gradient backward."""
    group, size, _ = tp_env()
    if size == 1:
        return x
    return GatherSequence.apply(x, group, size, dim, False)


def gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """:func:`gather_sequence` over any ``group`` of ``size`` ranks (context
    parallelism's keys and values over its cp group)."""
    if size == 1:
        return x
    return GatherSequence.apply(x, group, size, dim, False)


def reduce_scatter_seq(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's shard along ``dim`` of the ranks' summed partial results:
    reduce-scatter forward, all-gather of the gradient backward."""
    group, size, _ = tp_env()
    if size == 1:
        return x
    check_sequence_split(x, dim, size, "reduce_scatter_seq")
    return ReduceScatterSequence.apply(x, group, size, dim)
