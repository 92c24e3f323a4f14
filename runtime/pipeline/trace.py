"""Record what each rank did and when, as a Chrome trace (opens in Perfetto).

A :class:`Tracer` collects complete events (``"ph": "X"``) on one rank with
``time.perf_counter_ns``; :func:`to_chrome_trace` merges the events of every
rank into one JSON object, one process row per rank (``pid``) and one thread
row per pipeline stage (``tid``)::

    tracer = Tracer(rank=0)
    with tracer.span("0F3", cat="forward", args={"microbatch": 3}, tid=0):
        ...
    write_chrome_trace("step.json", {0: tracer.events})   # ui.perfetto.dev

:func:`schedule_to_chrome_trace` draws a schedule from
:func:`annot.runtime.pipeline.schedule_check.simulate` the same way, with no processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

__all__ = ["Tracer", "to_chrome_trace", "write_chrome_trace", "schedule_to_chrome_trace"]

Events = list[dict[str, Any]]
EventsByRank = Union[Mapping[int, Events], Sequence[Events]]

# One cost unit of a simulated schedule is drawn as this many microseconds.
_SIM_UNIT_US = 1000.0


_NO_SPAN = contextlib.nullcontext()


class Tracer:
    """Collects Chrome ``X`` events for one rank. ``enabled=False`` makes
    :meth:`span` a no-op, so callers need no ``if``."""

    def __init__(self, rank: int = 0, *, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.events: Events = []

    def span(
        self,
        name: str,
        cat: str = "",
        args: Optional[dict[str, Any]] = None,
        *,
        tid: int = 0,
    ) -> contextlib.AbstractContextManager[None]:
        """Time the body; record it as one event on thread row ``tid``. The
        event is recorded even if the body raises (its args get ``error``)."""
        if not self.enabled:
            return _NO_SPAN
        return self._span(name, cat, args, tid)

    @contextlib.contextmanager
    def _span(
        self, name: str, cat: str, args: Optional[dict[str, Any]], tid: int
    ) -> Iterator[None]:
        start = time.perf_counter_ns()
        event: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start / 1000.0,
            "dur": 0.0,
            "pid": self.rank,
            "tid": tid,
            "args": dict(args or {}),
        }
        try:
            yield
        except BaseException as exc:
            event["args"]["error"] = type(exc).__name__
            raise
        finally:
            event["dur"] = (time.perf_counter_ns() - start) / 1000.0
            self.events.append(event)

    def clear(self) -> None:
        self.events = []


def _by_rank(events_by_rank: EventsByRank) -> dict[int, Events]:
    if isinstance(events_by_rank, Mapping):
        return {int(r): list(evs or []) for r, evs in events_by_rank.items()}
    return {r: list(evs or []) for r, evs in enumerate(events_by_rank)}


def to_chrome_trace(events_by_rank: EventsByRank, *, align: bool = True) -> dict[str, Any]:
    """Merge per-rank events (a mapping rank -> events, or a list indexed by
    rank) into the Chrome trace JSON object ``{"traceEvents": [...]}``.

    Every event gets ``pid = rank``; ``process_name`` ("rank r") and
    ``thread_name`` ("stage s") metadata events label the rows. With
    ``align`` the earliest event starts at ts 0 (perf_counter is one clock
    for all processes of a host, so ranks on one host stay comparable)."""
    by_rank = _by_rank(events_by_rank)
    start = min((e["ts"] for evs in by_rank.values() for e in evs), default=0.0)
    shift = start if align else 0.0
    out: Events = []
    for rank in sorted(by_rank):
        out.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        out.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for tid in sorted({e.get("tid", 0) for e in by_rank[rank]}):
            out.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": f"stage {tid}"},
                }
            )
        for e in sorted(by_rank[rank], key=lambda e: e["ts"]):
            event = dict(e)
            event["pid"] = rank
            event["ts"] = e["ts"] - shift
            event.setdefault("ph", "X")
            event.setdefault("cat", "")
            event.setdefault("tid", 0)
            event.setdefault("args", {})
            out.append(event)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Union[str, os.PathLike], events_by_rank: EventsByRank) -> str:
    """Write :func:`to_chrome_trace` as JSON to ``path``; return the path.
    Open it at https://ui.perfetto.dev or chrome://tracing."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events_by_rank), f)
    return path


def schedule_to_chrome_trace(
    schedule, cost_f: float = 1, cost_b: float = 2, *, cost_w: Optional[float] = None
) -> dict[str, Any]:
    """Draw a schedule as a Chrome trace from
    :func:`annot.runtime.pipeline.schedule_check.simulate` (one cost unit = 1 ms, the
    same costs): one process per rank, one thread per stage, an ``X`` event
    per F/B/I/W and an instant event (``"ph": "i"``) per SEND/RECV."""
    from annot.runtime.pipeline.schedule_check import simulate
    from annot.runtime.pipeline.schedules import CATEGORY, COMPUTE

    timeline = simulate(schedule, cost_f, cost_b, cost_w=cost_w)
    by_rank: dict[int, Events] = {}
    for rank in range(len(timeline)):
        evs: Events = []
        for slot in timeline[rank]:
            a = slot.action
            event = {
                "name": str(a),
                "cat": CATEGORY.get(a.kind, "p2p"),
                "ph": "X" if a.kind in COMPUTE else "i",
                "ts": slot.start * _SIM_UNIT_US,
                "pid": rank,
                "tid": a.stage,
                "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind},
            }
            if a.kind in COMPUTE:
                event["dur"] = (slot.end - slot.start) * _SIM_UNIT_US
            else:
                event["s"] = "t"  # instant event scoped to its thread row
            evs.append(event)
        by_rank[rank] = evs
    return to_chrome_trace(by_rank, align=False)
