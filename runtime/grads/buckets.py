"""The dp gradient average, overlapped with the backward (DDP's buckets).

The trainable parameters are cut into buckets of about ``bucket_cap_mb`` in
the order backward produces their gradients (reverse registration order),
one dtype per bucket; the first bucket of each dtype is capped at 1 MiB
(DDP's first bucket) so the first all-reduce starts early. A
``post_accumulate_grad`` hook on each parameter marks it ready while it is
*armed*; once every parameter of a bucket is ready, its gradients are copied
into one flat buffer and ``all_reduce(async_op=True)`` over dp starts while
backward goes on. :meth:`GradBuckets.finish` (once per step, after every
backward) starts the rest, waits, scales by 1/dp and copies each average
back into ``.grad``.

Arming is what a step asks for: only the backward that gives a parameter its
last gradient of the step may launch its bucket (earlier microbatches just
accumulate, as under DDP's ``no_sync``). ``arm(params)`` arms some
parameters (a pipeline stage before its last backward), ``ready(params)``
marks parameters whose ``.grad`` was assigned without a hook (a zero-bubble
weight pass).

Exactly once, whatever happened:

- buckets launch in index order on every rank (bucket k waits for buckets
  0..k-1), so the dp ranks' collectives pair up even when data-dependent
  control flow makes a bucket ready on one rank and not on another;
- a bucket never made ready (never armed, or a parameter without a
  gradient this backward, which counts as zeros) launches at finish;
- a gradient that lands after its bucket launched (a second backward in the
  last microbatch, a parameter armed twice) marks the bucket stale. The last
  bucket always launches at finish and carries one flag per bucket; a
  bucket stale on any rank is reduced again, from the final gradients, on
  every rank.

Copy back rather than ``.grad`` as views of the buffers (DDP's
``gradient_as_bucket_view``): with views, a stale gradient would be written
into a buffer the all-reduce is still reading.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from annot.core.errors import HintError

__all__ = []  # internal: annot.parallelize(..., overlap_grad_reduce=True) builds one

MIB = 1024 * 1024
FIRST_BUCKET_BYTES = MIB  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def check_bucket_options(overlap_grad_reduce, bucket_cap_mb) -> None:
    """Refuse ``parallelize``'s gradient-reduction options before anything runs."""
    if not isinstance(overlap_grad_reduce, bool):
        raise HintError(
            f"parallelize: overlap_grad_reduce={overlap_grad_reduce!r}; expected True (average "
            "over dp during the backward) or False (one all-reduce after it)"
        )
    number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not number or not bucket_cap_mb > 0:
        raise HintError(
            f"parallelize: bucket_cap_mb={bucket_cap_mb!r}; expected the bucket size in MiB, a "
            "number > 0 (DDP's default: 25)"
        )


def assign_buckets(
    params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: Optional[int] = None
) -> list[list[int]]:
    """Indices of ``params`` (registration order) grouped into buckets, in the
    order backward fills them. Walking the parameters from the last to the
    first, each dtype fills its own open bucket, closed once it holds at least
    ``cap_bytes`` (a dtype's first bucket: ``first_cap_bytes``, default
    ``min(1 MiB, cap_bytes)``); a parameter larger than the cap is a bucket of
    its own. Buckets are ordered by their first parameter in that walk."""
    first = min(FIRST_BUCKET_BYTES, cap_bytes) if first_cap_bytes is None else first_cap_bytes
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    closed_per_dtype: dict[torch.dtype, int] = {}
    done: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        idx, size = open_.pop(p.dtype, ([], 0))
        idx.append(i)
        size += p.numel() * p.element_size()
        limit = cap_bytes if closed_per_dtype.get(p.dtype, 0) else first
        if size >= limit:
            done.append(idx)
            closed_per_dtype[p.dtype] = closed_per_dtype.get(p.dtype, 0) + 1
        else:
            open_[p.dtype] = (idx, size)
    done.extend(idx for idx, _ in open_.values())
    done.sort(key=lambda idx: -idx[0])
    return done


@dataclass
class LastStep:
    """What the last :meth:`GradBuckets.finish` saw: buckets launched before
    it (from the backward's hooks, or :meth:`GradBuckets.ready`), at finish,
    and reduced a second time because a gradient came after their launch."""

    before_finish: int = 0
    at_finish: int = 0
    again: int = 0
    order: list[int] = field(default_factory=list)  # bucket indices, in launch order


class GradBuckets:
    """DDP-style buckets for the dp average of ``params`` over ``group``."""

    unreduced: tuple = ()  # parameters left to a flat all-reduce after finish: none

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        group,
        scale: float,
        bucket_cap_mb: float = 25.0,
    ):
        self.params = list(params)
        self.group = group
        self.scale = scale
        self.buckets = [
            [self.params[i] for i in idx]
            for idx in assign_buckets(self.params, max(1, int(bucket_cap_mb * MIB)))
        ]
        self._bucket_of = {id(p): k for k, ps in enumerate(self.buckets) for p in ps}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.last_step = LastStep()
        self.reset()

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these buckets were built from exactly ``params``, in order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def reset(self) -> None:
        """Forget this step (a step that raised): disarmed, nothing launched."""
        n = len(self.buckets)
        self._armed: set[int] = set()
        self._ready: list[set[int]] = [set() for _ in range(n)]
        self._flat: list[Optional[torch.Tensor]] = [None] * n
        self._works: list = [None] * n
        self._stale = [False] * n
        self._next = 0  # the next bucket to launch: they go in index order
        self._step = LastStep()

    def close(self) -> None:
        """Remove the hooks (the parameters are no longer reduced here)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def launched(self) -> int:
        """How many buckets' all-reduces this step has started so far."""
        return self._next

    def arm(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Let the next gradient of ``params`` (default: all) launch their
        buckets. Arm before the backward that gives them their last gradient
        of the step; arming twice is arming once."""
        ids = self._bucket_of if params is None else (id(p) for p in params)
        self._armed.update(i for i in ids if i in self._bucket_of)

    def ready(self, params: Iterable[torch.Tensor]) -> None:
        """Mark ``params`` ready as a hook would: their ``.grad`` is final for
        the step (assigned directly, e.g. by a zero-bubble weight pass)."""
        for p in params:
            if id(p) in self._bucket_of:
                self._mark(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        k = self._bucket_of[id(p)]
        if self._works[k] is not None:
            self._stale[k] = True  # the launched copy missed this gradient
        elif id(p) in self._armed:
            self._mark(p)

    def _mark(self, p: torch.Tensor) -> None:
        k = self._bucket_of[id(p)]
        if self._works[k] is not None:
            self._stale[k] = True
            return
        self._ready[k].add(id(p))
        last = len(self.buckets) - 1  # launched at finish: it carries the stale flags
        while self._next < last and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch(self._next)
            self._step.before_finish += 1

    def _launch(self, k: int, tail: Optional[torch.Tensor] = None) -> None:
        flat = _flatten(self.buckets[k], tail)
        self._flat[k] = flat
        self._works[k] = dist.all_reduce(flat, group=self.group, async_op=True)
        self._step.order.append(k)
        self._next = k + 1

    def finish(self) -> None:
        """Launch what is left, wait, and write each parameter's dp average
        into its ``.grad`` (zeros averaged in for a parameter without one).
        Every parameter is reduced exactly once; then disarm for the next step."""
        n = len(self.buckets)
        if n == 0:
            return
        for k in range(self._next, n):
            flags = None
            if k == n - 1:
                flags = torch.tensor(self._stale, dtype=self.buckets[k][0].dtype)
                flags = flags.to(self.buckets[k][0].device)
            self._launch(k, flags)
            self._step.at_finish += 1
        for w in self._works:
            w.wait()
        flats: list[torch.Tensor] = []
        for f in self._flat:
            assert f is not None  # every bucket was launched above
            flats.append(f)
        stale = flats[n - 1][-n:].tolist()
        flats[n - 1] = flats[n - 1][:-n]
        for k in range(n):
            if stale[k]:  # on some rank a gradient landed after the launch
                flats[k] = _flatten(self.buckets[k])
                dist.all_reduce(flats[k], group=self.group)
                self._step.again += 1
        for ps, flat in zip(self.buckets, flats):
            flat.mul_(self.scale)
            _unflatten(ps, flat)
        self.last_step = self._step
        self.reset()


def _flatten(params: Sequence[torch.Tensor], tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The bucket's gradients in one buffer (a missing one as zeros), then ``tail``."""
    parts = [
        p.grad.detach().reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
        for p in params
    ]
    if tail is not None:
        parts.append(tail)
    return torch.cat(parts)


def _unflatten(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        part = flat[offset : offset + n].view_as(p)
        offset += n
        if p.grad is not None:
            p.grad.detach().copy_(part)
        elif p.requires_grad:
            p.grad = part.clone()
