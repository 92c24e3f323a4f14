"""The solver behind :func:`annot.plan.partition.partition`: the segments
as a :class:`Chain` (prefix sums of their costs, the memory each stage may
reach under the budget, the transfer times at each cut) and the searches over
it, for the cost model in :mod:`annot.plan.partition`'s docstring.

**Method.** Without communication, a stage's time and memory only grow when it
grows. Whether bottleneck ``L`` is feasible is then decided by the greedy that
makes each stage as long as ``L`` and the budget allow (it uses the fewest
stages; any count between that and ``n`` also works, by splitting stages). The
optimal ``L`` is found by bisection that snaps to real stage sums: a feasible
probe drops to the greedy's slowest stage, an infeasible one rises to the
smallest extension the greedy refused; a probe costs O(k log n). The tie-break
is a DP over (stage, boundary) restricted to the boundaries that bottleneck
allows; its cost matrix is Monge, so each stage's layer is solved by
divide-and-conquer, vectorised with numpy. 10 000 segments into 64 stages take a
few milliseconds (``benchmarks/partition_speed.py``).

With communication, cutting at a cheap point can make a *longer* stage faster,
so the greedy is no longer exact. The bottleneck then comes from a DP (the last
stage's start minimising ``max(best before it, this stage)``), and the
tie-break from the same DP over squared times. Both are restricted to the
windows and bands implied by the communication-free bounds, so they cost
O(k * n * w), ``w`` the largest number of segments a stage can hold.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import Optional

import numpy as np

from annot.core.errors import PartitionError

__all__ = ["Chain"]

_INF = float("inf")
_CELLS = 1 << 20  # entries per numpy block in the dense DP


def _floats(name: str, values: Iterable[float], n: Optional[int] = None) -> list[float]:
    out = [float(v) for v in values]
    if n is not None and len(out) != n:
        raise PartitionError(f"{name} has {len(out)} entries; expected one per segment ({n})")
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v >= 0):
            raise PartitionError(f"{name}[{i}] = {v!r}; expected a finite number >= 0")
    return out


class Chain:
    """The segments, their prefix sums and the memory reach under the budget."""

    def __init__(self, costs, memories, budget, cross_bytes, bandwidth, shared):
        cost = _floats("costs", costs)
        n = self.n = len(cost)
        if n == 0:
            raise PartitionError("no segments to partition: costs is empty")
        if memories is None:
            memories = [0] * n
        mem = [math.ceil(m) for m in _floats("memories", memories, n)]
        self.C = np.concatenate(([0.0], np.cumsum(np.asarray(cost, dtype=np.float64))))
        self.Cl = self.C.tolist()
        self.Mpl = [0]
        for m in mem:
            self.Mpl.append(self.Mpl[-1] + m)
        self.Mp = np.asarray(self.Mpl, dtype=np.int64)

        self.groups: list[tuple[int, list[int]]] = []
        self.seg_groups: list[list[int]] = [[] for _ in range(n)]
        for gi, item in enumerate(shared or ()):
            try:
                nbytes, members = item
                members = sorted({int(j) for j in members})
            except (TypeError, ValueError):
                raise PartitionError(
                    f"shared[{gi}] = {item!r}; expected (bytes, {{segment, ...}}), "
                    "e.g. shared=[(emb_bytes, {0, n - 1})] for an embedding tied to the head"
                ) from None
            (nb,) = _floats(f"shared[{gi}] bytes", [nbytes])
            if not members or members[0] < 0 or members[-1] >= n:
                raise PartitionError(
                    f"shared[{gi}] members {members}; expected segment indices in 0..{n - 1}"
                )
            self.groups.append((math.ceil(nb), members))
            for j in members:
                self.seg_groups[j].append(len(self.groups) - 1)

        if budget is not None:
            (b,) = _floats("memory_budget", [budget])
            if b <= 0:
                raise PartitionError(f"memory_budget = {budget!r}; expected a positive byte count")
            budget = math.floor(b)
        self.budget: Optional[int] = budget

        self.lft = np.zeros(n + 1)
        self.rgt = np.zeros(n + 1)
        if cross_bytes is not None or bandwidth is not None:
            if cross_bytes is None or bandwidth is None:
                raise PartitionError(
                    "give cross_bytes= and bandwidth= together: the time to cut after segment j "
                    "is cross_bytes[j] / bandwidth (bandwidth in bytes per unit of cost, e.g. "
                    "bytes/s when costs are seconds)"
                )
            x = _floats("cross_bytes", cross_bytes)
            if len(x) not in (n, n - 1):
                raise PartitionError(
                    f"cross_bytes has {len(x)} entries; expected one per segment ({n}) "
                    f"or one per gap ({n - 1})"
                )
            (bw,) = _floats("bandwidth", [bandwidth])
            if bw <= 0:
                raise PartitionError(f"bandwidth = {bandwidth!r}; expected > 0 bytes per unit")
            t = np.asarray(x[: n - 1], dtype=np.float64) / bw
            self.lft[1:n] = t  # a stage starting at a > 0 receives cross[a - 1]
            self.rgt[1:n] = t  # a stage ending at b < n sends cross[b - 1]
        self.comm = bool(self.lft.any())

        self.reach = self._mem_reach(self.budget)  # largest b with [a, b) fitting
        self.reach_l = self.reach.tolist()
        self.mem_start = np.concatenate(([0], np.searchsorted(self.reach, np.arange(1, n + 1))))

    # -- one stage ------------------------------------------------------------

    def time(self, a: int, b: int) -> float:
        return float((self.C[b] - self.C[a]) + self.lft[a] + self.rgt[b])

    def memory(self, a: int, b: int) -> int:
        total = self.Mpl[b] - self.Mpl[a]
        for nbytes, members in self.groups:
            i = bisect.bisect_left(members, a)
            if i < len(members) and members[i] < b:
                total += nbytes
        return total

    # -- memory ---------------------------------------------------------------

    def _mem_reach(self, limit: Optional[int]) -> np.ndarray:
        """For each start a, the largest b >= a with memory(a, b) <= limit."""
        n = self.n
        if limit is None:
            return np.full(n, n, dtype=np.int64)
        if not self.groups:
            return np.searchsorted(self.Mp, self.Mp[:n] + limit, side="right") - 1
        groups, seg_groups, Mp = self.groups, self.seg_groups, self.Mpl
        count = [0] * len(groups)
        extra, b, out = 0, 0, [0] * n
        for a in range(n):  # two pointers over the window [a, b)
            b = max(b, a)
            while b < n:
                add = sum(groups[g][0] for g in seg_groups[b] if count[g] == 0)
                if Mp[b + 1] - Mp[a] + extra + add > limit:
                    break
                for g in seg_groups[b]:
                    count[g] += 1
                extra += add
                b += 1
            out[a] = b
            if b > a:
                for g in seg_groups[a]:
                    count[g] -= 1
                    if count[g] == 0:
                        extra -= groups[g][0]
        return np.asarray(out, dtype=np.int64)

    def min_stages(self, reach: Sequence[int], cap: int) -> int:
        """Fewest stages under a memory reach (stops counting past ``cap``)."""
        a = stages = 0
        while a < self.n and stages <= cap:
            a = reach[a]
            stages += 1
        return stages if a >= self.n else cap + 1

    def best_memory(self, k: int) -> int:
        """The smallest possible largest stage memory over splits into k stages."""
        lo = max(self.memory(j, j + 1) for j in range(self.n))
        hi = self.memory(0, self.n)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.min_stages(self._mem_reach(mid).tolist(), k) <= k:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- time without communication -------------------------------------------

    def far(self, a: int, L: float) -> int:
        """The largest b with C[b] - C[a] <= L (the predicate exactly as evaluated)."""
        Cl, ca = self.Cl, self.Cl[a]
        b = bisect.bisect_right(Cl, ca + L, a, self.n + 1) - 1
        while b < self.n and Cl[b + 1] - ca <= L:
            b += 1
        while b > a and Cl[b] - ca > L:
            b -= 1
        return b

    def probe(self, L: float, k: int) -> tuple[Optional[list[int]], float]:
        """Greedy longest stages under bottleneck L: (their ends, or None when more
        than k stages are needed; the smallest L' > L that lets a stage grow)."""
        a, nxt, Cl = 0, _INF, self.Cl
        ends: list[int] = []
        while a < self.n:
            if len(ends) == k:
                return None, nxt
            bt, bm = self.far(a, L), self.reach_l[a]
            if bt < bm:
                nxt = min(nxt, Cl[bt + 1] - Cl[a])
            b = min(bt, bm)
            if b == a:
                return None, nxt
            ends.append(b)
            a = b
        return ends, nxt

    def bottleneck_nocomm(self, k: int) -> float:
        Cl = self.Cl
        lo = float(np.max(self.C[1:] - self.C[:-1]))  # a lower bound and a stage sum
        ends, _ = self.probe(Cl[self.n], k)
        assert ends is not None, "feasibility was checked before"
        hi = max(Cl[b] - Cl[a] for a, b in zip([0, *ends[:-1]], ends))
        while lo < hi:
            mid = lo + (hi - lo) / 2
            if not lo <= mid < hi:
                mid = lo
            ends, nxt = self.probe(mid, k)
            if ends is not None:
                hi = max(Cl[b] - Cl[a] for a, b in zip([0, *ends[:-1]], ends))
            else:
                lo = nxt if nxt > mid else hi
        return hi

    # -- the DP over (stage, boundary) ----------------------------------------

    def starts(self, L: float) -> np.ndarray:
        """For each end b, the smallest start a with C[b] - C[a] <= L and memory(a, b)
        within budget: [a, b) can be a stage (under the communication-free bound)
        exactly when starts[b] <= a < b."""
        C = self.C
        A = np.searchsorted(C, C - L, side="left")
        while True:  # make it exact for the predicate as evaluated
            dec = (A > 0) & (C - C[np.maximum(A - 1, 0)] <= L)
            if not dec.any():
                break
            A[dec] -= 1
        while True:
            inc = C - C[A] > L
            if not inc.any():
                break
            A[inc] += 1
        return np.maximum(A, self.mem_start)

    def bands(self, L: float, k: int, A: np.ndarray) -> list[tuple[int, int]]:
        """For each s, the boundaries that s stages can reach from the start and
        k - s stages can complete, under the communication-free bound L."""
        n = self.n
        left = [0]
        for _ in range(k):
            a = left[-1]
            left.append(n if a >= n else min(self.far(a, L), self.reach_l[a]))
        right = [n]
        for _ in range(k):
            right.append(int(A[right[-1]]))
        right.reverse()
        out = [(max(s, right[s]), min(left[s], n - (k - s))) for s in range(k + 1)]
        if any(lo > hi for lo, hi in out):
            raise AssertionError(f"partition: empty band at L={L!r}: {out}")
        return out

    def even_split(self, L: float, k: int) -> list[int]:
        """Among splits with every stage's time <= L (no communication), the one
        with the smallest sum of squares: divide-and-conquer per layer (Monge)."""
        A = self.starts(L)
        bands = self.bands(L, k, A)
        prev, backs = np.zeros(1), []
        for s in range(1, k + 1):
            prev, arg = _layer_monge(self.C, A, prev, bands[s - 1], bands[s])
            backs.append(arg)
        return _walk(backs, bands, self.n)

    def dense(self, L: float, k: int, squares: bool) -> tuple[float, list[int]]:
        """The DP over every allowed (start, end) pair with communication: the
        min-max stage time (squares=False) or the smallest sum of squared stage
        times with every stage <= L (squares=True)."""
        C, lft, rgt = self.C, self.lft, self.rgt
        A = self.starts(L)
        bands = self.bands(L, k, A)
        prev, backs = np.zeros(1), []
        for s in range(1, k + 1):
            plo, phi = bands[s - 1]
            lo, hi = bands[s]
            bs = np.arange(lo, hi + 1)
            amin = np.maximum(A[bs], plo)
            amax = np.minimum(bs - 1, phi)
            width = max(int((amax - amin).max()) + 1, 1)
            cur = np.full(bs.size, _INF)
            arg = np.zeros(bs.size, dtype=np.int64)
            step = max(1, _CELLS // width)
            for r0 in range(0, bs.size, step):
                rows = slice(r0, r0 + step)
                b = bs[rows, None]
                a = amin[rows, None] + np.arange(width)[None, :]
                ok = a <= amax[rows, None]
                a = np.clip(a, plo, phi)
                t = (C[b] - C[a]) + lft[a] + rgt[b]
                p = prev[a - plo]
                ok &= (t <= L) & (p < _INF)
                v = np.where(ok, p + t * t if squares else np.maximum(p, t), _INF)
                j = np.argmin(v, axis=1)  # first minimum: the earliest start
                cur[rows] = v[np.arange(v.shape[0]), j]
                arg[rows] = a[np.arange(v.shape[0]), j]
            prev = cur
            backs.append(arg)
        if not prev[0] < _INF:
            raise AssertionError(f"partition: no split within L={L!r}")
        return float(prev[0]), _walk(backs, bands, self.n)


def _layer_monge(C, A, prev, pband, band):
    """One DP layer: for each end b in ``band``, the start a in ``pband`` (with
    A[b] <= a < b) minimising prev[a] + (C[b] - C[a])**2, leftmost on ties.
    The matrix is Monge with a staircase of allowed entries, so the leftmost
    argmin is non-decreasing in b; solved by divide-and-conquer, one numpy pass
    per recursion level."""
    plo, phi = pband
    lo, hi = band
    best = np.empty(hi - lo + 1)
    arg = np.empty(hi - lo + 1, dtype=np.int64)
    rl, rr = np.array([lo]), np.array([hi])
    ol, orr = np.array([plo]), np.array([phi])
    while rl.size:
        mid = (rl + rr) // 2
        clo = np.maximum(ol, A[mid])
        chi = np.minimum(orr, mid - 1)
        length = chi - clo + 1
        if (length < 1).any():
            raise AssertionError("partition: empty candidate range in the balancing DP")
        starts = np.concatenate(([0], np.cumsum(length)[:-1]))
        cols = np.repeat(clo - starts, length) + np.arange(int(length.sum()))
        t = C[np.repeat(mid, length)] - C[cols]
        v = prev[cols - plo] + t * t
        mins = np.minimum.reduceat(v, starts)
        hit = np.flatnonzero(v == np.repeat(mins, length))
        opt = cols[hit[np.searchsorted(hit, starts)]]
        best[mid - lo] = mins
        arg[mid - lo] = opt
        left, right = rl < mid, mid < rr
        rl, rr, ol, orr = (
            np.concatenate((rl[left], mid[right] + 1)),
            np.concatenate((mid[left] - 1, rr[right])),
            np.concatenate((ol[left], opt[right])),
            np.concatenate((opt[left], orr[right])),
        )
    return best, arg


def _walk(backs, bands, n: int) -> list[int]:
    """Stage ends from the DP's back pointers, last stage first."""
    ends, b = [n], n
    for s in range(len(backs), 1, -1):
        b = int(backs[s - 1][b - bands[s][0]])
        ends.append(b)
    return ends[::-1]
