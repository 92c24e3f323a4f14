"""How fast is the partitioner? 10 000 random segments into 64 stages.

    python benchmarks/partition_speed.py            # median of 5 runs per case

Results (2-core CPU shared with other jobs, so two runs under different load;
median of 5):

    case                                       quiet    loaded
    plain (costs only)                          8 ms     17 ms
    + memory budget (1.05 x mean stage)         9 ms     18 ms
    + budget + 2 shared groups                 17 ms     40 ms
    + communication (cross_bytes, bandwidth)   14 ms     35 ms

The target is under 0.1 s for the plain case. The sanity line checks, without
brute force, that the answer has 64 non-empty stages, respects the budget, and
that its bottleneck is at least the lower bound max(largest segment,
total / 64) and within one segment of it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from annot.plan.partition import partition

__all__ = []

N, K, REPEATS = 10_000, 64, 5


def median_time(fn) -> tuple[float, object]:
    times, out = [], None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    rng = np.random.default_rng(0)
    costs = rng.uniform(0.5, 1.5, N).tolist()
    memories = rng.integers(1, 100, N).tolist()
    cross = rng.uniform(0, 100, N).tolist()
    budget = int(sum(memories) / K * 1.05)
    shared = [(50, {0, N - 1}), (10, {5, 500, 9000})]
    cases = {
        "plain (costs only)": dict(),
        "+ memory budget": dict(memory_budget=budget),
        "+ budget + 2 shared groups": dict(memory_budget=int(budget * 1.2), shared=shared),
        "+ communication": dict(cross_bytes=cross, bandwidth=1000.0),
    }
    print(f"partition(): {N} segments into {K} stages, median of {REPEATS}")
    for name, kwargs in cases.items():
        seconds, p = median_time(lambda kw=kwargs: partition(costs, memories, K, **kw))
        print(f"  {name:<30} {seconds * 1e3:8.2f} ms   imbalance {p.imbalance:.4f}")
    seconds, p = median_time(lambda: partition(costs, memories, K, memory_budget=budget))
    lower = max(max(costs), sum(costs) / K)
    ok = (
        p.n_stages == K
        and all(a < b for a, b in p.bounds)
        and max(p.stage_memory) <= budget
        and lower <= p.bottleneck <= lower + max(costs)
    )
    print(
        f"sanity: {p.n_stages} non-empty stages, max memory {max(p.stage_memory)} <= {budget}, "
        f"bottleneck {p.bottleneck:.3f} vs lower bound {lower:.3f}: {'ok' if ok else 'FAILED'}"
    )
    print(f"target < 100 ms: {'met' if seconds < 0.1 else 'NOT met'} ({seconds * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
