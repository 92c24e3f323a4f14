"""The optimal balanced split of a chain of segments into pipeline stages.

The model is cut, at its candidate split points, into ``n`` *segments* in
execution order. Segment ``j`` has

* ``costs[j]``: its time (or FLOPs) per microbatch, forward + backward, >= 0;
* ``memories[j]``: the bytes it needs on a device (parameters, gradients,
  optimizer state, activations), *not* counting parameters it shares with other
  segments: those go in ``shared``;
* ``cross_bytes[j]``: the bytes of the values crossing the boundary *after* it
  (the last entry, after the last segment, is ignored).

A partition puts consecutive segments into exactly ``n_stages`` non-empty stages.

**Stage time.** Stage ``[a, b)`` (segments ``a .. b-1``) takes
``sum(costs[a:b])`` plus, for each of its two ends that is a cut, the transfer
time ``cross_bytes[cut - 1] / bandwidth``. A transfer is charged to *both*
stages it joins: in a pipeline the sender and the receiver are both busy with it
(the activation forward, its gradient, of the same size, backward).
``bandwidth`` is in bytes per unit of cost (bytes/s when costs are seconds).

**Stage memory.** ``sum(memories[a:b])`` plus, once, the bytes of every shared
group (``shared=[(bytes, {segment, ...}), ...]``, e.g. an embedding tied to the
LM head) with at least one member in the stage; every stage that holds a member
pays the group in full. Memory is counted in whole bytes (rounded up).

**Objective.** :func:`partition` returns the exact optimum: the smallest
possible time of the slowest stage (the *bottleneck*) over all splits into
exactly ``n_stages`` non-empty stages whose memory each fits ``memory_budget``.
Among the splits with that bottleneck it returns the one with the smallest sum
of squared stage times, i.e. the most even one; remaining exact ties go to the
split whose last boundary is earliest, then the one before it, and so on. The
answer is deterministic.

The method (a bisection over greedy probes, then a DP over stage boundaries
for the tie-break) is :mod:`annot.plan.partition_chain`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from annot.core.errors import PartitionError
from annot.plan.partition_chain import Chain

__all__ = ["Partition", "partition", "partition_units", "fit", "evaluate", "least_memory"]


@dataclass(frozen=True)
class Partition:
    """A split of segments into stages: stage ``i`` runs segments
    ``bounds[i][0] .. bounds[i][1] - 1``."""

    bounds: list[tuple[int, int]]
    stage_costs: list[float]  # compute + communication: what the partitioner minimises
    stage_memory: list[int]  # bytes, shared groups counted once per stage holding them
    stage_comm: list[float]  # the communication part of stage_costs

    @property
    def n_stages(self) -> int:
        return len(self.bounds)

    @property
    def boundaries(self) -> list[int]:
        """The segment indices where stages begin, excluding 0."""
        return [a for a, _ in self.bounds[1:]]

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time."""
        return max(self.stage_costs)

    @property
    def imbalance(self) -> float:
        """Slowest stage / mean stage (1.0 is perfect balance)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return self.bottleneck / mean if mean > 0 else 1.0


def _fmt_bytes(x: float) -> str:
    if x >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.2f} MiB"
    return f"{int(x)} bytes"


def _stats(chain: Chain, ends: Sequence[int]) -> Partition:
    """The stage times and memory of the split ending at ``ends``."""
    bounds = list(zip([0, *ends[:-1]], ends))
    return Partition(
        bounds=[(int(a), int(b)) for a, b in bounds],
        stage_costs=[chain.time(a, b) for a, b in bounds],
        stage_memory=[chain.memory(a, b) for a, b in bounds],
        stage_comm=[float(chain.lft[a] + chain.rgt[b]) for a, b in bounds],
    )


def _check_stages(chain: Chain, n_stages: object) -> int:
    if isinstance(n_stages, bool) or not isinstance(n_stages, (int, np.integer)):
        raise PartitionError(f"n_stages = {n_stages!r}; expected an int >= 1")
    k = int(n_stages)
    if not 1 <= k <= chain.n:
        raise PartitionError(
            f"cannot split {chain.n} segments into {k} non-empty stages; n_stages must be "
            f"in 1..{chain.n} (for more stages, offer more split points)"
        )
    return k


def _check_segments_fit(chain: Chain) -> None:
    for j, b in enumerate(chain.reach_l):
        if b == j:
            assert chain.budget is not None  # without a budget every segment fits
            raise PartitionError(
                f"segment {j} alone needs {_fmt_bytes(chain.memory(j, j + 1))} (its own memory "
                f"plus the shared parameters it holds) > memory budget "
                f"{_fmt_bytes(chain.budget)}; no partition can fit: raise memory_budget or "
                "split that segment at more candidate points"
            )


def _solve(chain: Chain, k: int) -> Partition:
    L = chain.bottleneck_nocomm(k)
    ends = chain.even_split(L, k)
    if chain.comm:
        upper = max(chain.time(a, b) for a, b in zip([0, *ends[:-1]], ends))
        L, _ = chain.dense(upper, k, squares=False)
        _, ends = chain.dense(L, k, squares=True)
    return _stats(chain, ends)


def partition(
    costs: Sequence[float],
    memories: Optional[Sequence[float]],
    n_stages: int,
    *,
    memory_budget: Optional[float] = None,
    cross_bytes: Optional[Sequence[float]] = None,
    bandwidth: Optional[float] = None,
    shared: Optional[Sequence[tuple[float, Iterable[int]]]] = None,
) -> Partition:
    """The optimal split of the segments into exactly ``n_stages`` non-empty
    contiguous stages: the smallest slowest-stage time with every stage's
    memory within ``memory_budget``; among those, the most even (smallest sum
    of squared stage times). See the module docstring for the cost model.

    ``partition(costs, memories, 4, memory_budget=16 * 2**30,
    shared=[(emb_bytes, {0, len(costs) - 1})])``

    Interleaved schedules simply ask for ``pp * chunks`` stages. Raises
    :class:`~annot.core.errors.PartitionError` when no split fits the budget, saying
    how many stages would.
    """
    chain = Chain(costs, memories, memory_budget, cross_bytes, bandwidth, shared)
    k = _check_stages(chain, n_stages)
    _check_segments_fit(chain)
    need = chain.min_stages(chain.reach_l, chain.n)
    if need > k:
        assert chain.budget is not None  # without a budget one stage fits
        raise PartitionError(
            f"no split into {k} stages fits memory budget {_fmt_bytes(chain.budget)}: the best "
            f"{k}-stage split has a stage of {_fmt_bytes(chain.best_memory(k))}; {need} stages "
            f"would fit (fit(..., max_stages=...) picks the count), or raise memory_budget"
        )
    return _solve(chain, k)


def fit(
    costs: Sequence[float],
    memories: Sequence[float],
    memory_budget: float,
    *,
    max_stages: int,
    cross_bytes: Optional[Sequence[float]] = None,
    bandwidth: Optional[float] = None,
    shared: Optional[Sequence[tuple[float, Iterable[int]]]] = None,
) -> Partition:
    """Memory-fit mode (RaNNC): the fewest stages, at most ``max_stages``, whose
    every stage fits ``memory_budget``, split optimally as by :func:`partition`."""
    chain = Chain(costs, memories, memory_budget, cross_bytes, bandwidth, shared)
    cap = _check_stages(chain, max_stages)
    _check_segments_fit(chain)
    need = chain.min_stages(chain.reach_l, cap)
    if need > cap:
        assert chain.budget is not None  # without a budget one stage fits
        raise PartitionError(
            f"needs more than max_stages={cap} stages: best with {cap} stages has a stage of "
            f"{_fmt_bytes(chain.best_memory(cap))} > budget {_fmt_bytes(chain.budget)}; "
            "raise max_stages or memory_budget"
        )
    return _solve(chain, need)


def least_memory(
    memories: Sequence[float],
    n_stages: int,
    *,
    shared: Optional[Sequence[tuple[float, Iterable[int]]]] = None,
) -> int:
    """The smallest memory budget some split into exactly ``n_stages`` stages
    fits: the least possible memory of its largest stage (``partition`` with
    this budget then balances among the splits that reach it)."""
    chain = Chain([0.0] * len(memories), memories, None, None, None, shared)
    return chain.best_memory(_check_stages(chain, n_stages))


def evaluate(
    costs: Sequence[float],
    memories: Optional[Sequence[float]],
    boundaries: Sequence[int],
    *,
    cross_bytes: Optional[Sequence[float]] = None,
    bandwidth: Optional[float] = None,
    shared: Optional[Sequence[tuple[float, Iterable[int]]]] = None,
) -> Partition:
    """The stage times and memory of a given split (``boundaries``: the segment
    indices where stages begin, excluding 0), e.g. a hand-written
    ``@stage(split=...)``, under the same cost model as :func:`partition`."""
    chain = Chain(costs, memories, None, cross_bytes, bandwidth, shared)
    ends = [int(b) for b in boundaries] + [chain.n]
    if any(not a < b for a, b in zip([0, *ends[:-1]], ends)):
        raise PartitionError(
            f"boundaries {list(boundaries)} must increase strictly within 1..{chain.n - 1}"
        )
    return _stats(chain, ends)


_fewest_stages = fit  # partition_units takes a flag named fit


def partition_units(
    args: dict[str, Any],
    n_stages: int,
    *,
    memory: Optional[int] = None,
    fit: bool = False,
    least_when_none_fits: bool = False,
) -> Any:
    """The planner's one partition step, for either unit source: the exact
    min-bottleneck contiguous split of the units (``args``:
    :func:`annot.plan.cost.partition_args` of their costs) into
    ``n_stages`` stages under ``memory`` bytes each
    (:func:`annot.plan.partition.partition`), or with ``fit`` the fewest
    stages, at most ``n_stages``, that fit it (:func:`annot.plan.partition.fit`).
    ``least_when_none_fits``: where no split fits the budget as charged, the
    split whose largest stage is least (the caller checks each stage at its
    own figures)."""

    if fit:
        if memory is None:
            raise PartitionError("fit=True needs memory= (the budget each stage must fit)")
        return _fewest_stages(memory_budget=memory, max_stages=n_stages, **args)
    try:
        return partition(n_stages=n_stages, memory_budget=memory, **args)
    except PartitionError:
        if not least_when_none_fits:
            raise
        least = least_memory(args["memories"], n_stages, shared=args["shared"])
        return partition(n_stages=n_stages, memory_budget=least, **args)
