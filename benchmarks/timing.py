"""Side-by-side timing for the benchmarks: two step functions run in turn
(a, b, a, b, ...) so load on this noisy machine hits both alike."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

STEPS = int(os.environ.get("BENCH_STEPS", "20"))


def time_pair(
    a: Callable[[], object], b: Callable[[], object], steps: int = STEPS, warmup: int = 3
) -> tuple[float, float]:
    """Median seconds of ``a()`` and of ``b()``, interleaved, after ``warmup``."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(steps):
        t = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)
