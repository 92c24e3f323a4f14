"""A pipeline schedule as a terminal table, drawn from its simulated step
(:func:`annot.runtime.pipeline.schedule_check.simulate`). The same step as a Chrome
trace is :func:`annot.runtime.pipeline.trace.schedule_to_chrome_trace`.
"""

from __future__ import annotations

from typing import Optional

from annot.core.errors import PipelineError
from annot.runtime.pipeline.schedule_check import simulate
from annot.runtime.pipeline.schedules import COMPUTE, Schedule, W

__all__ = ["format_table"]


def format_table(
    schedule: Schedule,
    *,
    cost_f: int = 1,
    cost_b: Optional[int] = None,
    cost_w: Optional[int] = None,
) -> str:
    """A terminal table of the simulated step: one row per rank, one column
    per time step, cells ``F0`` / ``B3`` / ``I3`` / ``W3`` (``2F0`` when a
    rank holds several stages), ``.`` where the rank idles. An action taking
    ``k`` steps fills ``k`` cells. ``cost_b`` is a whole backward (default 1;
    2 when the schedule splits its backwards, so that I and W take
    ``cost_b - cost_w`` and ``cost_w``, default half each)."""
    split = any(a.kind == W for acts in schedule for a in acts)
    cost_b = (2 if split else 1) if cost_b is None else cost_b
    cost_w = cost_b // 2 if cost_w is None else cost_w
    costs = [("cost_f", cost_f), ("cost_b", cost_b)]
    if split:
        costs += [("cost_w", cost_w), ("cost_b - cost_w", cost_b - cost_w)]
    for name, v in costs:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"format_table needs integer costs >= 1, got {name}={v!r}")
    timeline = simulate(schedule, cost_f, cost_b, cost_w=cost_w)
    pp = len(schedule)
    multi = any(a.stage >= pp for acts in schedule for a in acts)
    steps = int(timeline.makespan)
    grid = [["."] * steps for _ in range(pp)]
    for r in range(pp):
        for slot in timeline[r]:
            a = slot.action
            if a.kind not in COMPUTE:
                continue
            label = str(a) if multi else f"{a.kind}{a.microbatch}"
            for t in range(int(slot.start), int(slot.end)):
                grid[r][t] = label
    head = [str(t) for t in range(steps)]
    width = max([len(c) for row in grid for c in row] + [len(h) for h in head] + [1])
    names = [f"rank {r}" for r in range(pp)]
    left = max(len(n) for n in names + ["step"])
    lines = ["step".ljust(left) + " | " + " ".join(h.ljust(width) for h in head)]
    for name, row in zip(names, grid):
        lines.append(name.ljust(left) + " | " + " ".join(c.ljust(width) for c in row))
    return "\n".join(line.rstrip() for line in lines)
