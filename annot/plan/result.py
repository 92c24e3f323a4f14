"""The planner's result: :class:`StagePlan`, a plan with its per-stage
figures, printed as a terminal table or given as plain data (JSON); one type
for both unit sources (the segments of a source split,
:mod:`annot.plan.segments`, and the module calls the replay runner cuts
at, :mod:`annot.plan.module_units`), made by :func:`annot.plan.planner.plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from annot.plan.cost_table import format_bytes, format_count, format_seconds

__all__ = ["StagePlan"]

_COST_WORDS = {
    "time": "measured time (forward + backward of one sample microbatch)",
    "flops": "FLOPs (forward + backward of one sample microbatch)",
    "params": "parameter bytes",
}
# module units balance by the parameters each multiplies by (annot.plan.units.Unit.work)
_MODULE_COST_WORDS = {
    **_COST_WORDS,
    "params": "parameters each unit multiplies by (an embedding's table counts zero)",
}

# Units, shared with annot.plan.cost_table's table.
_bytes, _count, _seconds = format_bytes, format_count, format_seconds


@dataclass(frozen=True)
class StagePlan:
    """A plan: ``boundaries`` (module paths where stages 1.. begin, for
    ``split_stages`` / ``parallelize(split=...)``), the ``partition`` over
    the ``segments`` (the units' names: the split point or module call each
    begins at) and their ``costs`` (:class:`annot.plan.cost_segments.SegmentCost`,
    ``.cost`` the scalar balanced). ``units``: with module units, the
    :class:`annot.plan.units.Unit` of each segment (empty for the segments
    of a source split)."""

    class_name: str
    boundaries: tuple[str, ...]
    partition: Any  # annot.plan.partition.Partition
    segments: tuple[str, ...]
    costs: tuple[Any, ...]
    cost: str
    measured: bool
    tp: int = 1
    memory_budget: Optional[int] = None
    warnings: tuple[str, ...] = field(default=())
    # each stage's annot.plan.memory_model.StageMemory (activations in flight)
    stage_detail: tuple[Any, ...] = field(default=())
    timed: bool = True  # False on a meta model: its clock says nothing
    units: tuple[Any, ...] = field(default=())  # annot.plan.units.Unit, per segment

    @property
    def unit_kind(self) -> str:
        """What the plan's units are: "segments" of a source split, or "units"
        (module calls, for the replay runner)."""
        return "units" if self.units else "segments"

    @property
    def unit_costs(self) -> list[float]:
        """Each unit's balanced cost."""
        return [c.cost for c in self.costs]

    @property
    def stage_costs(self) -> list[float]:
        """Each stage's balanced cost."""
        return list(self.partition.stage_costs)

    @property
    def stage_memory(self) -> list[int]:
        """Each stage's bytes per device (:attr:`stage_detail`'s totals)."""
        if self.stage_detail:
            return [d.total for d in self.stage_detail]
        return list(self.partition.stage_memory)

    def stage_units(self, s: int) -> tuple[str, str]:
        """The first and last unit of stage ``s``."""
        a, b = self.partition.bounds[s]
        return self.segments[a], self.segments[b - 1]

    @property
    def n_stages(self) -> int:
        return self.partition.n_stages

    @property
    def imbalance(self) -> float:
        """Slowest stage / mean stage, in the balanced cost."""
        return self.partition.imbalance

    def stages(self) -> list[dict[str, Any]]:
        """Per stage: its segments, first/last segment names, parameters
        (shared ones counted once per stage), FLOPs, measured seconds, memory
        (:attr:`stage_detail`: weights, gradients, optimizer state and the
        activations of the microbatches in flight there), bytes it sends on,
        balanced cost."""
        out = []
        part = self.partition
        for s, (a, b) in enumerate(part.bounds):
            seg = self.costs[a:b]
            n_params, seen = 0, set()
            for c in seg:
                n_params += c.n_params
                for key, numel in c.shared_numel.items():
                    n_params -= numel if key in seen else 0
                    seen.add(key)
            last = s == part.n_stages - 1
            out.append(
                {
                    "stage": s,
                    "segments": [a, b],
                    "first": self.segments[a],
                    "last": self.segments[b - 1],
                    "params": n_params,
                    "flops": sum(c.flops for c in seg) if self.measured else None,
                    "time": sum(c.time for c in seg) if self.measured and self.timed else None,
                    "memory": self.stage_memory[s],
                    # module units do not measure what crosses a cut
                    "sends": None
                    if last or not self.measured or self.units
                    else seg[-1].output_bytes,
                    "cost": part.stage_costs[s],
                }
            )
        return out

    def table(self) -> str:
        """The plan as a terminal table, with the imbalance and any warnings."""
        words = _MODULE_COST_WORDS if self.units else _COST_WORDS
        what = words.get(self.cost, f"{self.cost} (annot.plan.costs.UnitCost)")
        head = [
            f"annot plan: {self.class_name} in {self.n_stages} stages over "
            f"{len(self.segments)} {self.unit_kind}; balanced cost: {what}"
        ]
        if not self.measured:
            head.append(
                "  no sample input: FLOPs, time and activation memory not measured "
                "(give a sample to balance measured time)"
            )
        if self.tp > 1:
            head.append(
                f"  tp={self.tp}: parameters and FLOPs of @shard-ed layers divided by "
                f"{self.tp} (approximate: FLOPs by their parameter share)"
            )
        if self.memory_budget is not None:
            head.append(f"  memory budget per device: {_bytes(self.memory_budget)}")
        header = ("stage", "first", "last", "params", "FLOPs", "time", "memory", "sends")
        rows = []
        for st in self.stages():
            rows.append(
                (
                    str(st["stage"]),
                    st["first"],
                    st["last"],
                    _count(st["params"]),
                    "-" if st["flops"] is None else _count(st["flops"]),
                    "-" if st["time"] is None else _seconds(st["time"]),
                    _bytes(st["memory"]),
                    "-" if st["sends"] is None else _bytes(st["sends"]),
                )
            )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(r: Sequence[str]) -> str:
            return "  ".join(
                v.rjust(w) if i >= 3 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
            ).rstrip()

        out = [*head, line(header), line(["-" * w for w in widths]), *map(line, rows)]
        out += self._memory_lines()
        out.append(f"imbalance (max/mean stage cost): {self.imbalance:.2f}")
        out.append("boundaries: " + (", ".join(self.boundaries) or "(none: one stage)"))
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def _memory_lines(self) -> list[str]:
        """What each stage's memory is: weights, gradients and optimizer state
        (and buffers), and the activations of its microbatches in flight."""
        if not self.stage_detail:
            return []
        out = ["memory: weights+grads+optimizer, activations (microbatches in flight)"]
        for s, d in enumerate(self.stage_detail):
            act = f"{_bytes(d.activations)} ({d.in_flight})" if d.in_flight else "-"
            out.append(f"  stage {s}: {_bytes(d.params.total + d.buffers)}, {act}")
        return out

    def to_json(self) -> dict[str, Any]:
        """The plan as plain data (``json.dumps``-able)."""
        return {
            "class": self.class_name,
            "n_stages": self.n_stages,
            "cost": self.cost,
            "measured": self.measured,
            "tp": self.tp,
            "memory_budget": self.memory_budget,
            "boundaries": list(self.boundaries),
            "units": list(self.segments),
            "stage_costs": self.stage_costs,
            "stage_memory": self.stage_memory,
            "segments": [
                {
                    "name": c.name,
                    "cost": c.cost,
                    "params": c.n_params,
                    "memory": c.memory,
                    **({"time": c.time, "flops": c.flops} if self.measured else {}),
                }
                for c in self.costs
            ],
            "stages": self.stages(),
            "imbalance": self.imbalance,
            "bottleneck": self.partition.bottleneck,
            "warnings": list(self.warnings),
        }
