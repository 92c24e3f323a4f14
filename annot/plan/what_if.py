"""Which pp x tp x dp fits N devices of M bytes, and how balanced is it:
``annot plan ... --world-size N --memory 80GiB``.

For every factorisation ``pp * tp * dp == N`` (tp dividing the model's head
counts where it has them), :func:`what_if` plans the units measured once
(:func:`annot.plan.module_units.measure_units`, on the meta device) at that pp and
tp through :func:`annot.plan.planner.plan` (module units), the planner ``annot plan
--pp`` and ``parallelize`` use, and reports:

* the slowest stage per device: the plan's largest stage cost at that tp
  (the layers tp splits count ``1/tp``, the rest whole);
* the pipeline bubble ``(p - 1) / (m + p - 1)`` for ``m`` microbatches;
* each stage's memory (:mod:`annot.plan.memory_model`), and whether
  every stage fits;
* the boundaries.

Fitting choices come first, each group ordered by slowest x (1 + bubble),
a figure that leaves out communication (tp's all-reduces, pp's sends, dp's
gradient reduction) and how well each kernel runs at its size.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from annot.core.errors import AnnotError

__all__ = ["Choice", "Progress", "factorisations", "format_what_if", "what_if"]


class Progress:
    """Notes on stderr, shown once the work has taken more than ``after``
    seconds (quick plans print nothing)."""

    def __init__(self, after: float = 2.0, stream: Any = None):
        self.t0 = time.perf_counter()
        self.after = after
        self.stream = stream

    def note(self, text: str) -> None:
        spent = time.perf_counter() - self.t0
        if spent >= self.after:
            out = self.stream or sys.stderr
            out.write(f"[{spent:5.1f} s] {text}\n")
            out.flush()


@dataclass(frozen=True)
class Choice:
    """One pp x tp x dp: its plan (None where it was refused), the slowest
    stage per device, the bubble and whether every stage fits."""

    pp: int
    tp: int
    dp: int
    plan: Any  # annot.plan.result.StagePlan
    bubble: float
    fits: bool
    refusal: Optional[str] = None

    @property
    def slowest(self) -> float:
        return max(self.plan.stage_costs) if self.plan is not None else float("inf")

    @property
    def score(self) -> float:
        """Slowest stage x (1 + bubble): lower is faster (communication left out)."""
        return self.slowest * (1 + self.bubble)


def factorisations(world: int) -> list[tuple[int, int, int]]:
    """Every (pp, tp, dp) with pp * tp * dp == world."""
    out = []
    for pp in range(1, world + 1):
        if world % pp:
            continue
        for tp in range(1, world // pp + 1):
            if (world // pp) % tp == 0:
                out.append((pp, tp, world // pp // tp))
    return out


def _tp_problem(model: Any, tp: int) -> Optional[str]:
    """Why the model cannot run at ``tp`` (a head count it does not divide)."""
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads", "n_head"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n % tp:
            return f"tp={tp} does not divide {name}={n}"
    return None


def what_if(
    measures: Any, world: int, memory: int, progress: Optional[Progress] = None
) -> list[Choice]:
    """Every pp x tp x dp of ``world`` devices for the measured units
    (:class:`annot.plan.module_units.UnitMeasures`), under ``memory`` bytes per
    device; fitting choices first, each group by :attr:`Choice.score`."""
    from annot.plan import planner
    from annot.plan.module_units import ModuleUnits, StageMemoryError
    from annot.plan.unit_figures import tp_sharded

    setup = measures.setup
    m = setup.microbatches
    out: list[Choice] = []
    sharded: dict[int, set[int]] = {}
    combos = factorisations(world)
    for k, (pp, tp, dp) in enumerate(combos):
        if progress is not None:
            progress.note(f"planning pp={pp} tp={tp} dp={dp} ({k + 1}/{len(combos)})")
        bubble = (pp - 1) / (m + pp - 1)
        problem = _tp_problem(measures.model, tp)
        if problem is None and pp > len(measures.fine):
            problem = f"{len(measures.fine)} places a stage can begin, fewer than pp={pp}"
        if problem is not None:
            out.append(Choice(pp, tp, dp, None, bubble, False, problem))
            continue
        if tp > 1 and tp not in sharded:
            sharded[tp] = tp_sharded(measures.model, tp)
        try:
            units = ModuleUnits(measures=measures, sharded=sharded.get(tp))
            plan = planner.plan(measures.model, pp, units=units, tp=tp, dp=dp, memory=memory)
            out.append(Choice(pp, tp, dp, plan, bubble, True))
        except StageMemoryError as exc:
            out.append(Choice(pp, tp, dp, exc.plan, bubble, False))
        except AnnotError as exc:
            out.append(Choice(pp, tp, dp, None, bubble, False, str(exc)))
    return sorted(out, key=lambda c: (not c.fits, c.plan is None, c.score, c.pp, c.tp))


def _compact(boundaries: Sequence[str]) -> str:
    """``model.layers.{10, 20, 30.mlp}`` for boundaries that share a prefix."""
    if not boundaries:
        return "(one stage)"
    prefix = os.path.commonprefix(boundaries).rpartition(".")[0]
    if len(boundaries) < 2 or not prefix:
        return ", ".join(boundaries)
    return f"{prefix}.{{{', '.join(b[len(prefix) + 1 :] for b in boundaries)}}}"


def format_what_if(choices: list[Choice], world: int, memory: int, cost: str) -> str:
    """The table: one row per choice, then each stage's memory and the split."""
    from annot.plan.cost_table import format_bytes, format_count

    what = {"flops": "FLOPs", "params": "weighted params", "time": "s"}[cost]
    top_bytes = max((max(c.plan.stage_memory) for c in choices if c.plan is not None), default=1)
    unit, scale = next(
        ((u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top_bytes >= b),
        ("B", 1),
    )
    head = (
        f"{'pp':>3} {'tp':>3} {'dp':>3}  {'slowest stage/device':>20} {'bubble':>7} "
        f"{'slowest x (1+bubble)':>21} {'max stage memory':>17}  fits"
    )
    rows = [
        f"{world} devices, {format_bytes(memory)} each; cost: {what} per device (the layers "
        "tp splits count 1/tp)",
        head,
        "-" * len(head),
    ]
    for c in choices:
        if c.plan is None:
            rows.append(f"{c.pp:>3} {c.tp:>3} {c.dp:>3}  refused: {c.refusal}")
            continue
        mem = c.plan.stage_memory
        top = max(range(len(mem)), key=mem.__getitem__)
        slowest = format_count(c.slowest) if cost != "time" else f"{c.slowest:.4g}"
        score = format_count(c.score) if cost != "time" else f"{c.score:.4g}"
        rows.append(
            f"{c.pp:>3} {c.tp:>3} {c.dp:>3}  {slowest:>20} {c.bubble:>7.3f} {score:>21} "
            f"{format_bytes(mem[top]) + f' (s{top})':>17}  {'yes' if c.fits else 'no'}"
        )
        rows.append(f"      stage memory ({unit}): " + " ".join(f"{b / scale:.1f}" for b in mem))
        rows.append("      split: " + _compact(c.plan.boundaries))
    rows.append(
        "slowest x (1 + bubble) leaves out communication (tp all-reduces, pipeline sends, "
        "dp gradient reduction) and kernel efficiency at each size; compare choices with it, "
        "then measure"
    )
    return "\n".join(rows)
