"""Which local names are live, and which are defined, between pieces of code:
a small algebra of effects, and the liveness computed with it.

The stage splitter cuts ``forward`` into stage methods; what one stage must
hand to the next is exactly the set of names that are *defined* before the
cut and *live* after it (read later before being unconditionally
reassigned). This module computes both over :class:`Effects`, with no
knowledge of stages or of syntax (:mod:`annot.rewriters.analysis.statement_effects`
gives the effects of libcst statements)::

    units = [statement_effects(s) for s in func.body.body]
    for cut in crossings(units, params=("idx", "targets")):
        cut.names            # crossing values, in order of first use after the cut
        cut.maybe_unbound    # the ones assigned on some paths only

A piece of code is summarised as an :class:`Effects`: its upward-exposed
reads (in source order) and, per name it touches, the set of ways the name
may end up (``B`` bound, ``D`` deleted, ``U`` untouched). :func:`sequence`
runs pieces one after another; :func:`branch` runs one of them, merging
those sets, so a name assigned in one branch only is *maybe* defined;
:func:`repeat` adds ``U`` (a loop may run zero times); ``return`` /
``raise`` paths are dropped from what follows, ``break`` / ``continue``
paths are carried to the end of their loop. The analysis is conservative:
it may report a value that is not needed, never drop one that is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "BOUND",
    "DELETED",
    "EMPTY",
    "MAYBE_BOUND",
    "UNTOUCHED",
    "Crossing",
    "Effects",
    "Status",
    "bind",
    "branch",
    "crossings",
    "live_sets",
    "loop_piece_effects",
    "merge",
    "ordered",
    "read",
    "repeat",
    "sequence",
    "unbind",
]

Status = Mapping[str, frozenset]
UNTOUCHED = frozenset("U")
BOUND = frozenset("B")
DELETED = frozenset("D")
MAYBE_BOUND = frozenset("BU")


def ordered(*parts: Iterable[str]) -> tuple[str, ...]:
    """The names of ``parts``, each once, in order of first appearance."""
    return tuple(dict.fromkeys(n for part in parts for n in part))


def _compose(first: Status, second: Status) -> dict[str, frozenset]:
    """Status after running ``first`` then ``second``."""
    out = dict(first)
    for name, s in second.items():
        out[name] = (s - UNTOUCHED) | first.get(name, UNTOUCHED) if "U" in s else s
    return out


def merge(*alternatives: Status) -> dict[str, frozenset]:
    """Status after one of ``alternatives`` ran (a name one of them leaves alone is ``U`` there)."""
    names = ordered(*(a.keys() for a in alternatives))
    return {n: frozenset().union(*(a.get(n, UNTOUCHED) for a in alternatives)) for n in names}


@dataclass(frozen=True, eq=False)
class Effects:
    """What running a piece of code does to the local names of its function.

    ``reads``: names read before this code (re)binds them, in source order.
    ``status``: for each name the code binds or deletes, the outcomes
    possible on the paths that reach its end: ``B`` (bound), ``D`` (deleted),
    ``U`` (left as it was). ``terminates``: no path reaches the end (every
    path returns, raises, breaks or continues). ``jumps``: the status on the
    paths that leave by ``break`` / ``continue`` (None when there are none).
    ``assigned``: every name bound or deleted anywhere (the code's locals).
    """

    reads: tuple[str, ...] = ()
    status: Status = field(default_factory=dict)
    terminates: bool = False
    jumps: Optional[Status] = None
    assigned: frozenset = frozenset()

    @property
    def binds(self) -> frozenset:
        """Names bound on every path that reaches the end."""
        return frozenset(n for n, s in self.status.items() if s == BOUND)

    @property
    def may_binds(self) -> frozenset:
        """Names bound on some path that reaches the end."""
        return frozenset(n for n, s in self.status.items() if "B" in s)

    @property
    def kills(self) -> frozenset:
        """Names whose earlier value is gone at the end (rebound or deleted on every path)."""
        return frozenset(n for n, s in self.status.items() if "U" not in s)


EMPTY = Effects()


def sequence(*parts: Effects) -> Effects:
    """The effects of running ``parts`` one after another."""
    out = EMPTY
    for b in parts:
        out = _then(out, b)
    return out


def _then(a: Effects, b: Effects) -> Effects:
    if a.terminates:  # b is unreachable; its names are still locals of the scope
        return Effects(a.reads, a.status, True, a.jumps, a.assigned | b.assigned)
    jumps = a.jumps
    if b.jumps is not None:
        later = _compose(a.status, b.jumps)
        jumps = later if jumps is None else merge(jumps, later)
    kills = a.kills
    return Effects(
        ordered(a.reads, (n for n in b.reads if n not in kills)),
        _compose(a.status, b.status),
        b.terminates,
        jumps,
        a.assigned | b.assigned,
    )


def branch(*alternatives: Effects) -> Effects:
    """Exactly one of ``alternatives`` runs."""
    live = [a for a in alternatives if not a.terminates]
    jumps = [a.jumps for a in alternatives if a.jumps is not None]
    return Effects(
        ordered(*(a.reads for a in alternatives)),
        merge(*(a.status for a in live)) if live else {},
        not live,
        merge(*jumps) if jumps else None,
        frozenset().union(*(a.assigned for a in alternatives)),
    )


def _iteration(body: Effects) -> Effects:
    """One loop iteration: it ends normally or by ``break`` / ``continue``."""
    ends = [] if body.terminates else [body.status]
    if body.jumps is not None:
        ends.append(body.jumps)
    return Effects(body.reads, merge(*ends) if ends else {}, False, None, body.assigned)


def repeat(body: Effects) -> Effects:
    """Zero or more iterations of ``body``."""
    it = _iteration(body)
    return Effects(it.reads, merge({}, it.status), False, None, it.assigned)


def loop_piece_effects(
    iter_reads: Effects, target: Effects, body: Effects, orelse: Optional[Effects] = None
) -> Effects:
    """One or more iterations of a ``for`` loop (a piece of a split loop,
    which always runs at least once), then ``orelse`` if given."""
    once = _iteration(sequence(target, body))
    twice = _then(once, once)
    eff = Effects(once.reads, merge(once.status, twice.status), False, None, once.assigned)
    return sequence(iter_reads, eff, orelse or EMPTY)


def read(name: str) -> Effects:
    """``name`` is read."""
    return Effects(reads=(name,))


def bind(name: str, maybe: bool = False) -> Effects:
    """``name`` is bound (on some paths only, with ``maybe``)."""
    return Effects(status={name: MAYBE_BOUND if maybe else BOUND}, assigned=frozenset((name,)))


def unbind(name: str) -> Effects:
    """``del name``: read, then deleted."""
    return Effects(reads=(name,), status={name: DELETED}, assigned=frozenset((name,)))


# ---- crossings ----------------------------------------------------------------


@dataclass(frozen=True)
class Crossing:
    """The values that cross one cut between statements.

    ``names``: defined before the cut and read after it, in order of first
    use after the cut. ``maybe_unbound``: those assigned on some paths only
    (the code before the cut may leave them unassigned).
    """

    names: tuple[str, ...]
    maybe_unbound: frozenset = frozenset()


def live_sets(units: Sequence[Effects], live_out: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """The names live before each unit and after the last (``len(units) + 1`` entries)."""
    live: list[tuple[str, ...]] = [()] * (len(units) + 1)
    live[-1] = ordered(live_out)
    for i in range(len(units) - 1, -1, -1):
        u = units[i]
        after = () if u.terminates else tuple(n for n in live[i + 1] if n not in u.kills)
        live[i] = ordered(u.reads, after)
    return live


def crossings(
    units: Sequence[Effects], params: Iterable[str], live_out: Iterable[str] = ()
) -> list[Crossing]:
    """What crosses each cut of ``units`` (before the first, between each
    pair, after the last): ``len(units) + 1`` :class:`Crossing`.

    ``params`` are the names bound on entry (the function's parameters; leave
    out ``self`` so it never crosses). ``live_out`` are names read after the
    last unit (none for a whole function body).
    """
    live = live_sets(units, live_out)
    must = set(params)
    may = set(must)
    out = []
    for i in range(len(units) + 1):
        names = tuple(n for n in live[i] if n in may)
        out.append(Crossing(names, frozenset(n for n in names if n not in must)))
        if i == len(units) or units[i].terminates:
            continue
        for n, s in units[i].status.items():
            if "D" in s or ("U" not in s and "B" not in s):
                must.discard(n)
            elif "U" not in s:
                must.add(n)
            if "B" in s:
                may.add(n)
            elif "U" not in s:
                may.discard(n)
    return out
