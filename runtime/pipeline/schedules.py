"""Pipeline schedules as data: a per-rank list of :class:`Action`.

A schedule is ``list[list[Action]]``, one list per pipeline rank, in the
order that rank executes them. Nothing here runs a model or talks to another
process: the executor (:mod:`annot.runtime.pipeline.executor`) walks the lists, and the
tests check them with no processes at all
(:func:`annot.runtime.pipeline.schedule_check.validate`, :func:`~annot.runtime.pipeline.schedule_check.simulate`,
:func:`~annot.runtime.pipeline.schedule_check.peak_in_flight`,
:func:`annot.runtime.pipeline.schedule_table.format_table`).

Notation (as in ``torch.distributed.pipelining``): ``str(action)`` is
``<stage><KIND><microbatch>``, so ``1F3`` is the forward of stage 1 on
microbatch 3, ``0SEND_F3`` stage 0 sending that microbatch's activations on,
``2RECV_B0`` stage 2 receiving the gradients of its outputs for microbatch 0.

Stages are *virtual* stages ``0 .. pp * chunks - 1``; rank ``r`` holds stages
``r, r + pp, r + 2 pp, ...`` (Megatron's interleaving, "loop" placement; with
``chunks == 1`` rank ``r`` holds stage ``r``), or, placed in a V (``v=True``,
two stages per rank, ZB-V's placement), stages ``r`` and ``2 pp - 1 - r``: the
first and the last stage on rank 0, the two middle ones on rank ``pp - 1``,
which hands values between them locally. How messages travel between ranks (the
communication model) is :mod:`annot.runtime.pipeline.schedule_check`'s.

======================  ================================================
``gpipe(pp, M)``        fill-drain: all forwards, then all backwards
``one_f_one_b(pp, M)``  1F1B (PipeDream-flush): warm-up, then one
                        forward / one backward; rank ``r`` keeps at most
                        ``min(pp - r, M)`` microbatches in flight
``interleaved_1f1b``    Megatron's interleaved 1F1B over ``chunks``
                        virtual stages per rank; needs ``M % pp == 0``
``zero_bubble_h1``      ZB-H1 (Qi et al., 2023): each backward split in
                        ``I`` (input gradients, sent upstream at once)
                        and ``W`` (weight gradients, deferred to fill the
                        bubble); 1F1B's activation memory
``zero_bubble_v``       ZB-V (Qi et al., 2024): two stages per rank placed
                        in a V (rank ``r`` holds ``r`` and ``2 pp - 1 - r``),
                        backward split as in ZB-H1; with ``M >= 2 pp`` the
                        bubble nearly vanishes at 1F1B's activation memory
======================  ================================================

A split backward is two actions: ``I`` computes the gradients of the
stage's inputs (what ``SEND_B`` sends) and ``W`` the gradients of its
weights, later; ``B`` is both at once (torch's notation: ``1I3``, ``1W3``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

from annot.core.errors import PipelineError

__all__ = [
    "Action",
    "F",
    "B",
    "CATEGORY",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble_h1",
    "zero_bubble_v",
    "V_SCHEDULES",
    "rank_stages",
    "get_schedule",
    "schedule_name",
    "forward_only",
    "check_sizes",
    "stage_rank",
]

F = "F"
B = "B"
I = "I"  # noqa: E741 - backward, input gradients only (torch's letter)
W = "W"  # backward, weight gradients only (after I)
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"
KINDS = (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)
COMPUTE = (F, B, I, W)
CATEGORY = {F: "forward", B: "backward", I: "backward", W: "backward"}  # else "p2p"

Schedule = list[list["Action"]]


class Action(NamedTuple):
    """One step of one rank: ``kind`` (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)
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


def stage_rank(stage: int, pp: int, v: bool = False) -> int:
    """The pipeline rank that holds virtual ``stage``: ``stage % pp`` (Megatron's
    interleaving), or in a V (``v``: two stages per rank) ``stage`` on the way
    down and ``2 pp - 1 - stage`` on the way back. The one place the mapping
    lives: the executor, the checks and the stage placement all ask here."""
    if v:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(rank: int, pp: int, chunks: int, v: bool = False) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds, in order (the inverse
    of :func:`stage_rank`)."""
    if v:
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(chunks)]


def check_sizes(pp: int, microbatches: int, chunks: int = 1) -> None:
    for name, v in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"{name}={v!r}: must be an int >= 1")


def _with_comms(
    order: list[list[tuple[str, int, int]]], pp: int, num_stages: int, v: bool = False
) -> Schedule:
    """Insert the p2p actions around each rank's compute order: a RECV just
    before the compute that needs it, a SEND just after the compute that
    produced it (sends are async, so posting early never blocks)."""

    def owner(s: int) -> int:
        return stage_rank(s, pp, v)

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
            elif kind == W:  # weight gradients: nothing crosses
                acts.append(Action(W, s, m))
            else:  # B, or I: the input gradients go upstream
                if s < num_stages - 1 and owner(s + 1) != rank:
                    acts.append(Action(RECV_B, s, m))
                acts.append(Action(kind, s, m))
                if s > 0 and owner(s - 1) != rank:
                    acts.append(Action(SEND_B, s, m))
        out.append(acts)
    return out


def gpipe(pp: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): every forward, then every backward, microbatches in
    order. Activations of all ``M`` microbatches are alive at once."""
    check_sizes(pp, microbatches)
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
    check_sizes(pp, microbatches)
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
    check_sizes(pp, microbatches, chunks)
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


def zero_bubble_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): the
    backward of every stage is split into ``I`` (input gradients, on the
    critical path: the stage before waits for them) and ``W`` (weight
    gradients, which nobody waits for), and the ``W`` s are deferred into
    the time a rank would otherwise idle.

    The order is list-scheduled on the paper's unit costs (F = I = W): a
    free rank runs an ``I`` whose gradients have arrived, else its next
    ``F`` if its input has arrived, else its oldest deferred ``W``. Memory
    is the paper's ZB-H1 bound: rank ``r`` runs a new ``F`` only while fewer
    than 1F1B's ``min(pp - r, M)`` microbatches wait for their ``I``, and
    fewer than ``min(pp, M)`` for their ``W`` (every rank may hold what the
    first rank holds in 1F1B; after ``I`` a microbatch keeps only what its
    weight gradients need). With ``T_F = T_I = T_W`` and ``M >= pp`` the
    step is within ``(pp + 1) // 2`` units of the paper's ``3M + pp - 1``
    (1F1B: ``3M + 3(pp - 1)``), exactly it when ``M == pp``. The
    order is then fixed: at run time every rank follows its list, whatever
    the real costs."""
    check_sizes(pp, microbatches)
    limit = [min(pp - r, microbatches) for r in range(pp)]
    held = min(pp, microbatches)
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> end time
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(pp)]
    next_f, next_i, w_done = [0] * pp, [0] * pp, [0] * pp
    t = 0
    while any(w < microbatches for w in w_done):
        for r in range(pp):
            if order[r] and done[order[r][-1]] > t:
                continue  # busy until its last action ends
            f, i, w = next_f[r], next_i[r], w_done[r]
            grads_in = r == pp - 1 or done.get((I, r + 1, i), t + 1) <= t
            inputs_in = r == 0 or done.get((F, r - 1, f), t + 1) <= t
            if i < f and grads_in:
                unit, next_i[r] = (I, r, i), i + 1
            elif f < microbatches and f - i < limit[r] and f - w < held and inputs_in:
                unit, next_f[r] = (F, r, f), f + 1
            elif w < i:
                unit, w_done[r] = (W, r, w), w + 1
            else:
                continue  # idle: waiting for a message
            order[r].append(unit)
            done[unit] = t + 1
        t += 1
    return _with_comms(order, pp, pp)


def zero_bubble_v(pp: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., 2024, "Pipeline Parallelism with Controllable Memory"):
    ``2 pp`` stages placed in a V (rank ``r`` holds stages ``r`` and
    ``2 pp - 1 - r``, so rank 0 holds the first and the last), each backward
    split into ``I`` and ``W`` as in :func:`zero_bubble_h1`.

    List-scheduled on unit costs (F = I = W) like ZB-H1: a free rank runs the
    ``I`` of its oldest microbatch whose gradients have arrived (the later
    stage first), else a forward whose input has arrived (the later stage
    first: the V's second leg drains toward the loss), else its oldest
    deferred ``W``. Memory: a rank starts a forward of its first stage only
    while fewer than ``pp`` microbatches have passed it without reaching their
    ``W`` there, so it holds about what 1F1B's first rank holds (``pp``
    microbatches of a whole stage: here ``2 pp`` half-size stages' worth at most)."""
    check_sizes(pp, microbatches)
    n = 2 * pp
    done: dict[tuple[str, int, int], int] = {}
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(pp)]
    # per stage: next forward, next input gradient, weight gradients done
    nf, ni, nw = [0] * n, [0] * n, [0] * n
    t = 0

    def ready(key: tuple[str, int, int]) -> bool:
        return done.get(key, t + 1) <= t

    while any(w < microbatches for w in nw):
        for r in range(pp):
            if order[r] and done[order[r][-1]] > t:
                continue  # busy until its last action ends
            first, second = r, n - 1 - r
            unit = None
            candidates = []
            for s in (second, first):  # input gradients, the oldest microbatch first
                m = ni[s]
                if m < nf[s] and (ready((I, s + 1, m)) if s < n - 1 else ready((F, s, m))):
                    candidates.append((m, -s, (I, s, m)))
            if candidates:
                unit = min(candidates)[2]
            if unit is None:
                for s in (second, first):
                    m = nf[s]
                    if m >= microbatches or (s > 0 and not ready((F, s - 1, m))):
                        continue
                    if s == first and m - nw[first] >= pp:
                        continue  # the memory bound: pp microbatches past the first stage
                    unit = (F, s, m)
                    break
            if unit is None:
                olds = [(nw[s], s) for s in (first, second) if nw[s] < ni[s]]
                if olds:
                    m, s = min(olds)
                    unit = (W, s, m)
            if unit is None:
                continue  # idle: waiting for a message
            kind, s, m = unit
            {F: nf, I: ni, W: nw}[kind][s] += 1
            order[r].append(unit)
            done[unit] = t + 1
        t += 1
    return _with_comms(order, pp, n, v=True)


# (pp, microbatches) -> Schedule; the interleaved one also takes chunks
SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zbh1": zero_bubble_h1,
    "zbv": zero_bubble_v,
}

#: the schedules that run two stages per rank placed in a V (``parallelize(placement="v")``)
V_SCHEDULES = ("zbv",)


_ALIASES = {
    "interleaved1f1b": "interleaved",
    "zerobubble": "zbh1",
    "zerobubbleh1": "zbh1",
    "zerobubblev": "zbv",
}


def schedule_name(name: str) -> str:
    """The canonical name of a schedule ("zb-h1" -> "zbh1", "1F1B" -> "1f1b");
    :class:`PipelineError` listing the names for an unknown one."""
    key = name.lower().replace("-", "").replace("_", "") if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise PipelineError(
            f"unknown pipeline schedule {name!r}; expected one of "
            f"{', '.join(repr(n) for n in SCHEDULES)}"
        )
    return key


def get_schedule(name: str, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b", "interleaved" or "zbh1",
    also spelled "zb-h1" or "zero-bubble")."""
    key = schedule_name(name)
    if key == "interleaved":
        return interleaved_1f1b(pp, microbatches, chunks)
    if key in V_SCHEDULES:
        if chunks != 2:
            raise PipelineError(
                f"schedule {name!r} runs two stages per rank placed in a V but chunks={chunks}; "
                "build the model with annot.parallelize(..., chunks=2, placement='v')"
            )
        return SCHEDULES[key](pp, microbatches)
    if chunks != 1:
        raise PipelineError(
            f"schedule {name!r} runs one stage per rank but chunks={chunks}; "
            f"use schedule='interleaved' for {chunks} virtual stages per rank"
        )
    return SCHEDULES[key](pp, microbatches)


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward work (inference / evaluation)."""
    return [[a for a in acts if a.kind in (F, SEND_F, RECV_F)] for acts in schedule]
