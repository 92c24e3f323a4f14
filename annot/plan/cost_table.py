"""The partition plan as a terminal table (:func:`format_partition_table`),
from the cost model's measurements (:mod:`annot.plan.cost`), and the units
it prints sizes, counts and times in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from annot.plan.cost_segments import SegmentCost

__all__ = ["format_bytes", "format_count", "format_partition_table", "format_seconds"]


def _human(x: float, units: Sequence[str], base: float) -> str:
    for unit in units[:-1]:
        if abs(x) < base:
            return f"{x:.0f} {unit}" if unit == units[0] else f"{x:.1f} {unit}"
        x /= base
    return f"{x:.1f} {units[-1]}"


def format_bytes(x: float) -> str:
    """``1536 -> '1.5 KiB'``"""
    return _human(x, ("B", "KiB", "MiB", "GiB", "TiB"), 1024)


def format_count(x: float) -> str:
    """``1500000 -> '1.5 M'``"""
    return _human(x, ("", "K", "M", "G", "T"), 1000).strip()


def format_seconds(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def format_partition_table(
    partition: Any, names: Optional[Sequence[str]], costs: Sequence[SegmentCost]
) -> str:
    """The plan as a terminal table: per stage its first and last segment,
    parameters (shared ones counted once per stage), FLOPs, measured time,
    memory (as the partitioner charged it), the bytes it sends to the next
    stage; then the imbalance (max / mean of the balanced cost)."""
    names = list(names) if names is not None else [c.name for c in costs]
    header = ("stage", "first", "last", "params", "FLOPs", "time", "memory", "sends")
    rows = []
    for s, (a, b) in enumerate(partition.bounds):
        seg = costs[a:b]
        n_params = sum(c.n_params for c in seg)
        seen: dict[str, int] = {}
        for c in seg:
            for key, numel in c.shared_numel.items():
                n_params -= numel if key in seen else 0
                seen[key] = numel
        last = s == len(partition.bounds) - 1
        rows.append(
            (
                str(s),
                names[a],
                names[b - 1],
                format_count(n_params),
                format_count(sum(c.flops for c in seg)),
                format_seconds(sum(c.time for c in seg)),
                format_bytes(partition.stage_memory[s]),
                "-" if last else format_bytes(costs[b - 1].output_bytes),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 5, 6, 7}

    def line(r):
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
        ).rstrip()

    out = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
    out.append(f"imbalance (max/mean stage cost): {partition.imbalance:.2f}")
    return "\n".join(out)
