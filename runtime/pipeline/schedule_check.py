"""Checking and simulating pipeline schedules (:mod:`annot.runtime.pipeline.schedules`).

:func:`validate` names the first invariant a schedule breaks, :func:`simulate`
runs it on paper (and finds deadlocks), :func:`peak_in_flight` counts the
activation sets alive on a rank. All with no processes.

Communication model, shared by :func:`simulate` and the executor: a SEND
never blocks (it is an async send, waited at the end of the step); a RECV
blocks until the matching SEND has been posted. Messages are keyed by
``(direction, destination stage, microbatch)``, so a receiver that finds a
different message first keeps it for later: a schedule need not order the
messages of one rank pair the same way on both sides, it only must not
deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

from annot.core.errors import PipelineError
from annot.runtime.pipeline.schedules import (
    COMPUTE,
    KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
    check_sizes,
    stage_rank,
)

__all__ = ["Slot", "Timeline", "simulate", "validate", "peak_in_flight"]


@dataclass(frozen=True)
class Slot:
    """When one action ran in a simulated step."""

    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """A simulated step: ``ranks[r]`` is rank r's slots in execution order."""

    ranks: list[list[Slot]]

    def __getitem__(self, rank: int) -> list[Slot]:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def makespan(self) -> float:
        return max((s.end for slots in self.ranks for s in slots), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.ranks[rank] if s.action.kind in COMPUTE)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step over all ranks: ``1 - busy / (pp * makespan)``."""
        total = self.makespan * len(self.ranks)
        if total == 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.ranks))) / total


def simulate(
    schedule: Schedule,
    cost_f: float = 1,
    cost_b: float = 2,
    cost_comm: float = 0,
    *,
    cost_w: float | None = None,
) -> Timeline:
    """Run the schedule on paper. Every rank executes its actions in order; F
    takes ``cost_f``, B ``cost_b``; a split backward's W takes ``cost_w``
    (default half of B) and its I the rest, so a split backward costs what B
    does; a SEND takes no time and its message arrives ``cost_comm`` later;
    a RECV waits for its message. Raises :class:`PipelineError` naming the
    stuck actions if the schedule deadlocks (or receives a message nobody
    sends)."""
    cost_w = cost_b / 2 if cost_w is None else cost_w
    cost = {F: cost_f, B: cost_b, I: cost_b - cost_w, W: cost_w}
    pp = len(schedule)
    pc = [0] * pp
    clock = [0.0] * pp
    slots: list[list[Slot]] = [[] for _ in range(pp)]
    arrivals: dict[tuple[str, int, int], float] = {}
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            acts = schedule[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                start = clock[r]
                if a.kind in COMPUTE:
                    end = start + cost[a.kind]
                elif a.kind in (SEND_F, SEND_B):
                    end = start
                    key = a.message
                    assert key is not None, "a send carries a message"
                    arrivals[key] = start + cost_comm
                else:
                    if a.message not in arrivals:
                        break
                    start = end = max(start, arrivals[a.message])
                slots[r].append(Slot(a, start, end))
                clock[r] = end
                pc[r] += 1
                progress = True
    stuck = [
        f"rank {r} waits at {schedule[r][pc[r]]}" for r in range(pp) if pc[r] < len(schedule[r])
    ]
    if stuck:
        raise PipelineError(
            "the schedule deadlocks: " + "; ".join(stuck) + " (no rank can make progress; "
            "every RECV needs its SEND to come earlier in the sender's list)"
        )
    return Timeline(slots)


def validate(
    schedule: Schedule,
    pp: int,
    microbatches: int,
    chunks: int = 1,
    *,
    forward_only: bool = False,
    v: bool = False,
) -> None:
    """Check the invariants a schedule must hold to be run; raise
    :class:`PipelineError` on the first violation, saying where.

    - one list per rank, every action on a stage that rank owns;
    - every (stage, microbatch) has exactly one F and either one B or one I
      and one W (no backward when ``forward_only``); each crossing between
      ranks exactly one SEND and one RECV, and none between stages on the
      same rank;
    - on each rank: F(s, m) after its inputs arrived (RECV_F, or F(s-1, m)
      locally); B or I (s, m) after F(s, m) and after its output gradients
      arrived (RECV_B, or the B or I of (s+1, m) locally); W(s, m) after
      I(s, m); a SEND after the compute it sends;
    - a simulated run in which every RECV waits for its SEND terminates
      (no deadlock).
    """
    check_sizes(pp, microbatches, chunks)
    if len(schedule) != pp:
        raise PipelineError(f"the schedule has {len(schedule)} rank lists, expected pp={pp}")
    n = pp * chunks
    last = n - 1

    def where(rank: int, a: Action) -> str:
        return f"rank {rank}: {a}"

    def owner(s: int) -> int:
        return stage_rank(s, pp, v)

    split = {(a.stage, a.microbatch) for acts in schedule for a in acts if a.kind in (I, W)}
    expected: set[Action] = set()
    for s in range(n):
        for m in range(microbatches):
            expected.add(Action(F, s, m))
            if s > 0 and owner(s - 1) != owner(s):
                expected.add(Action(RECV_F, s, m))
            if s < last and owner(s + 1) != owner(s):
                expected.add(Action(SEND_F, s, m))
            if forward_only:
                continue
            if (s, m) in split:
                expected |= {Action(I, s, m), Action(W, s, m)}
            else:
                expected.add(Action(B, s, m))
            if s < last and owner(s + 1) != owner(s):
                expected.add(Action(RECV_B, s, m))
            if s > 0 and owner(s - 1) != owner(s):
                expected.add(Action(SEND_B, s, m))
    seen: set[Action] = set()
    for rank, acts in enumerate(schedule):
        for a in acts:
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise PipelineError(f"rank {rank}: {a!r} is not an Action of kind {KINDS}")
            if not (0 <= a.stage < n and 0 <= a.microbatch < microbatches):
                raise PipelineError(
                    f"{where(rank, a)} is out of range: stages are 0..{last}, "
                    f"microbatches 0..{microbatches - 1}"
                )
            if owner(a.stage) != rank:
                raise PipelineError(
                    f"{where(rank, a)}: stage {a.stage} belongs to rank {owner(a.stage)} "
                    f"(rank r holds stages {'r and 2 pp - 1 - r' if v else 'r, r+pp, ...'})"
                )
            if a in seen:
                raise PipelineError(f"{where(rank, a)} appears twice")
            if a not in expected:
                raise PipelineError(f"{where(rank, a)} is not expected in this pipeline")
            seen.add(a)
            done = seen
            s, m = a.stage, a.microbatch
            if a.kind == F and s > 0:
                need = Action(RECV_F, s, m) if owner(s - 1) != rank else Action(F, s - 1, m)
                if need not in done:
                    raise PipelineError(f"{where(rank, a)} runs before its inputs ({need})")
            elif a.kind in (B, I):
                if Action(F, s, m) not in done:
                    raise PipelineError(f"{where(rank, a)} runs before its forward {s}F{m}")
                if s < last:
                    need = Action(RECV_B, s, m)
                    if owner(s + 1) == rank:
                        need = Action(I if (s + 1, m) in split else B, s + 1, m)
                    if need not in done:
                        raise PipelineError(
                            f"{where(rank, a)} runs before its output gradients ({need})"
                        )
            elif a.kind == W and Action(I, s, m) not in done:
                raise PipelineError(f"{where(rank, a)} runs before its input gradients {s}I{m}")
            elif a.kind == SEND_F and Action(F, s, m) not in done:
                raise PipelineError(f"{where(rank, a)} sends before {s}F{m} computed it")
            elif a.kind == SEND_B:
                grad = Action(I if (s, m) in split else B, s, m)
                if grad not in done:
                    raise PipelineError(f"{where(rank, a)} sends before {grad} computed it")
    missing = sorted(expected - seen, key=lambda a: (a.stage, a.microbatch, a.kind))
    if missing:
        shown = ", ".join(str(a) for a in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise PipelineError(f"the schedule is missing {shown}{more}")
    simulate(schedule)


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most activation sets alive at once on ``rank``: (stage, microbatch)
    pairs forwarded but not yet backwarded (a split backward frees them at
    W). With one stage per rank this is the number of microbatches in
    flight."""
    alive = peak = 0
    for a in schedule[rank]:
        if a.kind == F:
            alive += 1
            peak = max(peak, alive)
        elif a.kind in (B, W):
            alive -= 1
    return peak
