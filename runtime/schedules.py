"""Pipeline schedules as data: a per-rank list of :class:`Action`.

A schedule is ``list[list[Action]]``, one list per pipeline rank, in the
order that rank executes them. Nothing here runs a model or talks to another
process: the executor (:mod:`annot.runtime.pipeline`) walks the lists, and the
tests check them with no processes at all (:func:`validate`,
:func:`simulate`, :func:`peak_in_flight`, :func:`format_table`).

Notation (as in ``torch.distributed.pipelining``): ``str(action)`` is
``<stage><KIND><microbatch>``, so ``1F3`` is the forward of stage 1 on
microbatch 3, ``0SEND_F3`` stage 0 sending that microbatch's activations on,
``2RECV_B0`` stage 2 receiving the gradients of its outputs for microbatch 0.

Stages are *virtual* stages ``0 .. pp * chunks - 1``; rank ``r`` holds stages
``r, r + pp, r + 2 pp, ...`` (Megatron's interleaving; with ``chunks == 1``
rank ``r`` holds stage ``r``).

Communication model, shared by :func:`simulate` and the executor: a SEND
never blocks (it is an async send, waited at the end of the step); a RECV
blocks until the matching SEND has been posted. Messages are keyed by
``(direction, destination stage, microbatch)``, so a receiver that finds a
different message first keeps it for later: a schedule need not order the
messages of one rank pair the same way on both sides, it only must not
deadlock.

======================  ================================================
``gpipe(pp, M)``        fill-drain: all forwards, then all backwards
``one_f_one_b(pp, M)``  1F1B (PipeDream-flush): warm-up, then one
                        forward / one backward; rank ``r`` keeps at most
                        ``min(pp - r, M)`` microbatches in flight
``interleaved_1f1b``    Megatron's interleaved 1F1B over ``chunks``
                        virtual stages per rank; needs ``M % pp == 0``
======================  ================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from annot.errors import PipelineError

__all__ = [
    "Action",
    "F",
    "B",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "SCHEDULES",
    "Slot",
    "Timeline",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "get_schedule",
    "validate",
    "simulate",
    "peak_in_flight",
    "format_table",
]

F = "F"
B = "B"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"
KINDS = (F, B, SEND_F, RECV_F, SEND_B, RECV_B)
COMPUTE = (F, B)

Schedule = list[list["Action"]]


class Action(NamedTuple):
    """One step of one rank: ``kind`` (F, B, SEND_F, RECV_F, SEND_B, RECV_B)
    on virtual ``stage`` for ``microbatch``. ``str()`` gives ``1F3``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str()``: ``Action.parse("1SEND_F3")``."""
        for kind in sorted(KINDS, key=len, reverse=True):
            head, sep, tail = text.partition(kind)
            if sep and head.isdigit() and tail.isdigit():
                return cls(kind, int(head), int(tail))
        raise PipelineError(
            f"cannot parse action {text!r}: expected <stage><KIND><microbatch> "
            f"with KIND one of {', '.join(KINDS)}, e.g. '1F3'"
        )

    @property
    def message(self) -> Optional[tuple[str, int, int]]:
        """The key of the message this SEND/RECV carries: ``(direction,
        destination stage, microbatch)``; None for compute actions."""
        if self.kind == SEND_F:
            return (F, self.stage + 1, self.microbatch)
        if self.kind == SEND_B:
            return (B, self.stage - 1, self.microbatch)
        if self.kind in (RECV_F, RECV_B):
            return (self.kind[-1], self.stage, self.microbatch)
        return None


# -- building schedules ------------------------------------------------------


def _check_sizes(pp: int, microbatches: int, chunks: int = 1) -> None:
    for name, v in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"{name}={v!r}: must be an int >= 1")


def _with_comms(order: list[list[tuple[str, int, int]]], pp: int, num_stages: int) -> Schedule:
    """Insert the p2p actions around each rank's compute order: a RECV just
    before the compute that needs it, a SEND just after the compute that
    produced it (sends are async, so posting early never blocks)."""

    def owner(s: int) -> int:
        return s % pp

    out: Schedule = []
    for rank, computes in enumerate(order):
        acts: list[Action] = []
        for kind, s, m in computes:
            if kind == F:
                if s > 0 and owner(s - 1) != rank:
                    acts.append(Action(RECV_F, s, m))
                acts.append(Action(F, s, m))
                if s < num_stages - 1 and owner(s + 1) != rank:
                    acts.append(Action(SEND_F, s, m))
            else:
                if s < num_stages - 1 and owner(s + 1) != rank:
                    acts.append(Action(RECV_B, s, m))
                acts.append(Action(B, s, m))
                if s > 0 and owner(s - 1) != rank:
                    acts.append(Action(SEND_B, s, m))
        out.append(acts)
    return out


def gpipe(pp: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): every forward, then every backward, microbatches in
    order. Activations of all ``M`` microbatches are alive at once."""
    _check_sizes(pp, microbatches)
    order = []
    for r in range(pp):
        fwd = [(F, r, m) for m in range(microbatches)]
        bwd = [(B, r, m) for m in range(microbatches)]
        order.append(fwd + bwd)
    return _with_comms(order, pp, pp)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule): rank ``r``
    runs ``min(pp - 1 - r, M)`` warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards. Same bubble as
    GPipe, but at most ``min(pp - r, M)`` microbatches in flight on rank r."""
    _check_sizes(pp, microbatches)
    order = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        acts = [(F, r, m) for m in range(warmup)]
        f, b = warmup, 0
        for _ in range(microbatches - warmup):
            acts.append((F, r, f))
            acts.append((B, r, b))
            f, b = f + 1, b + 1
        acts += [(B, r, m) for m in range(b, microbatches)]
        order.append(acts)
    return _with_comms(order, pp, pp)


def interleaved_1f1b(pp: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: rank ``r`` holds ``chunks`` virtual stages
    ``r, r + pp, ...``; forwards go in groups of ``pp`` microbatches per chunk,
    backwards visit the chunks in reverse. The bubble shrinks by about
    ``chunks`` at the cost of more p2p. Requires ``M % pp == 0`` (Megatron's
    rule). ``chunks == 1`` is plain :func:`one_f_one_b`."""
    _check_sizes(pp, microbatches, chunks)
    if chunks == 1:
        return one_f_one_b(pp, microbatches)
    if microbatches % pp:
        lo = microbatches // pp * pp
        near = f"{lo} or {lo + pp}" if lo else f"{pp}"
        raise PipelineError(
            f"the interleaved schedule needs microbatches to be a multiple of pp "
            f"(Megatron's rule): got microbatches={microbatches}, pp={pp}; use "
            f"microbatches={near}, or schedule='1f1b' which takes any number"
        )
    total = microbatches * chunks
    group = pp * chunks

    def unit(k: int, forward: bool) -> tuple[int, int]:
        in_group = k % group
        chunk = in_group // pp
        if not forward:
            chunk = chunks - 1 - chunk
        mb = (k // group) * pp + in_group % pp
        return chunk, mb

    order = []
    for r in range(pp):
        if microbatches == pp:
            warmup = total
        else:
            warmup = min((pp - r - 1) * 2 + (chunks - 1) * pp, total)
        acts = []

        def fwd(k: int, r: int = r) -> tuple[str, int, int]:
            c, m = unit(k, True)
            return (F, c * pp + r, m)

        def bwd(k: int, r: int = r) -> tuple[str, int, int]:
            c, m = unit(k, False)
            return (B, c * pp + r, m)

        acts += [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(fwd(k + warmup))
            acts.append(bwd(k))
        acts += [bwd(k) for k in range(total - warmup, total)]
        order.append(acts)
    return _with_comms(order, pp, pp * chunks)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def get_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b" or "interleaved")."""
    key = name.lower().replace("-", "").replace("_", "") if isinstance(name, str) else name
    aliases = {
        "gpipe": "gpipe",
        "1f1b": "1f1b",
        "interleaved": "interleaved",
        "interleaved1f1b": "interleaved",
    }
    if key not in aliases:
        raise PipelineError(
            f"unknown pipeline schedule {name!r}; expected one of "
            f"{', '.join(repr(n) for n in SCHEDULES)}"
        )
    key = aliases[key]
    if key == "interleaved":
        return interleaved_1f1b(pp, microbatches, chunks)
    if chunks != 1:
        raise PipelineError(
            f"schedule {name!r} runs one stage per rank but chunks={chunks}; "
            f"use schedule='interleaved' for {chunks} virtual stages per rank"
        )
    return SCHEDULES[key](pp, microbatches)


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward work (inference / evaluation)."""
    return [[a for a in acts if a.kind in (F, SEND_F, RECV_F)] for acts in schedule]


# -- checking and simulating -------------------------------------------------


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
    schedule: Schedule, cost_f: float = 1, cost_b: float = 2, cost_comm: float = 0
) -> Timeline:
    """Run the schedule on paper. Every rank executes its actions in order; F
    takes ``cost_f``, B ``cost_b``; a SEND takes no time and its message
    arrives ``cost_comm`` later; a RECV waits for its message. Raises
    :class:`PipelineError` naming the stuck actions if the schedule deadlocks
    (or receives a message nobody sends)."""
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
                if a.kind == F:
                    end = start + cost_f
                elif a.kind == B:
                    end = start + cost_b
                elif a.kind in (SEND_F, SEND_B):
                    end = start
                    arrivals[a.message] = start + cost_comm
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
) -> None:
    """Check the invariants a schedule must hold to be run; raise
    :class:`PipelineError` on the first violation, saying where.

    - one list per rank, every action on a stage that rank owns;
    - every (stage, microbatch) has exactly one F and one B (no B when
      ``forward_only``); each crossing between ranks exactly one SEND and one
      RECV, and none between stages on the same rank;
    - on each rank: F(s, m) after its inputs arrived (RECV_F, or F(s-1, m)
      locally); B(s, m) after F(s, m) and after its output gradients arrived
      (RECV_B, or B(s+1, m) locally); a SEND after the compute it sends;
    - a simulated run in which every RECV waits for its SEND terminates
      (no deadlock).
    """
    _check_sizes(pp, microbatches, chunks)
    if len(schedule) != pp:
        raise PipelineError(f"the schedule has {len(schedule)} rank lists, expected pp={pp}")
    n = pp * chunks
    last = n - 1

    def where(rank: int, a: Action) -> str:
        return f"rank {rank}: {a}"

    expected: set[Action] = set()
    for s in range(n):
        for m in range(microbatches):
            expected.add(Action(F, s, m))
            if s > 0 and (s - 1) % pp != s % pp:
                expected.add(Action(RECV_F, s, m))
            if s < last and (s + 1) % pp != s % pp:
                expected.add(Action(SEND_F, s, m))
            if forward_only:
                continue
            expected.add(Action(B, s, m))
            if s < last and (s + 1) % pp != s % pp:
                expected.add(Action(RECV_B, s, m))
            if s > 0 and (s - 1) % pp != s % pp:
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
            if a.stage % pp != rank:
                raise PipelineError(
                    f"{where(rank, a)}: stage {a.stage} belongs to rank {a.stage % pp} "
                    f"(rank r holds stages r, r+pp, ...)"
                )
            if a in seen:
                raise PipelineError(f"{where(rank, a)} appears twice")
            if a not in expected:
                raise PipelineError(f"{where(rank, a)} is not expected in this pipeline")
            seen.add(a)
            done = seen
            s, m = a.stage, a.microbatch
            if a.kind == F and s > 0:
                need = Action(RECV_F, s, m) if (s - 1) % pp != rank else Action(F, s - 1, m)
                if need not in done:
                    raise PipelineError(f"{where(rank, a)} runs before its inputs ({need})")
            elif a.kind == B:
                if Action(F, s, m) not in done:
                    raise PipelineError(f"{where(rank, a)} runs before its forward {s}F{m}")
                if s < last:
                    need = Action(RECV_B, s, m) if (s + 1) % pp != rank else Action(B, s + 1, m)
                    if need not in done:
                        raise PipelineError(
                            f"{where(rank, a)} runs before its output gradients ({need})"
                        )
            elif a.kind == SEND_F and Action(F, s, m) not in done:
                raise PipelineError(f"{where(rank, a)} sends before {s}F{m} computed it")
            elif a.kind == SEND_B and Action(B, s, m) not in done:
                raise PipelineError(f"{where(rank, a)} sends before {s}B{m} computed it")
    missing = sorted(expected - seen, key=lambda a: (a.stage, a.microbatch, a.kind))
    if missing:
        shown = ", ".join(str(a) for a in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise PipelineError(f"the schedule is missing {shown}{more}")
    simulate(schedule)


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most activation sets alive at once on ``rank``: (stage, microbatch)
    pairs forwarded but not yet backwarded. With one stage per rank this is
    the number of microbatches in flight."""
    alive = peak = 0
    for a in schedule[rank]:
        if a.kind == F:
            alive += 1
            peak = max(peak, alive)
        elif a.kind == B:
            alive -= 1
    return peak


def format_table(schedule: Schedule, *, cost_f: int = 1, cost_b: int = 1) -> str:
    """A terminal table of the simulated step: one row per rank, one column
    per time step, cells ``F0`` / ``B3`` (``2F0`` when a rank holds several
    stages), ``.`` where the rank idles. An action taking ``k`` steps fills
    ``k`` cells."""
    for name, v in (("cost_f", cost_f), ("cost_b", cost_b)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"format_table needs integer costs >= 1, got {name}={v!r}")
    timeline = simulate(schedule, cost_f, cost_b)
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
