"""A failing rank never leaves the others hanging.

Every blocking wait in the runtime has a timeout, and every rank that stops
says why in torch.distributed's key-value store, so that every other rank can
name the rank that failed *first*, not just its neighbour::

    with guard("forward", stage=1, microbatch=3):
        out = stage(x)                      # an exception here is reported

    with guard("recv activations", stage=1, microbatch=3, peer=src) as timeout_s:
        wait_work(dist.irecv(buf, src), timeout_s)   # a timeout or a lost peer
                                                      # names the culprit

Both raise :class:`annot.core.errors.RankFailure`, e.g. ``rank 3 (stage 1) failed
during forward of microbatch 2: ValueError: boom`` or ``rank 2 (stage 1) did not
respond within 10 s while this rank waited in recv activations of microbatch 4``.

Timeout: ``timeout_s=`` or the environment variable ``ANNOT_TIMEOUT_S``
(default 300 s). Grace: ``grace_s=`` or ``ANNOT_FAULT_GRACE_S`` (default 2 s),
how long a rank whose wait failed looks in the store for a better culprit than
its own peer before it blames the peer (half of it when the peer's connection
closed rather than timed out).

The records of who failed, in torch.distributed's key-value store, are
:mod:`annot.runtime.faults.store`; waiting on one Work with a timeout and telling
a communication failure from any other error, :mod:`annot.runtime.faults.comm_wait`.

What gloo does on teardown (torch 2.13, measured):

- ``destroy_process_group()`` returns at once after a timeout, with only
  point-to-point work pending, or with a collective pending on a subgroup; it
  blocks while a collective of the default group is in flight for a peer that
  is alive but never joins (in the ProcessGroupGloo destructor, which joins its
  worker threads), until that peer exits. ``_abort_process_group()`` blocks the
  same way on gloo (it is meant for NCCL). :func:`abort_process_group` tears
  down on a daemon thread for at most ``wait_s`` (the group is already
  unregistered then: ``is_initialized()`` is False) and, when asked, leaves
  with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch.distributed as dist

from annot.core.errors import AnnotError, RankFailure
from annot.runtime.faults.comm_wait import classify
from annot.runtime.faults.store import (
    BLAME_KEY,
    MAX_ERROR_CHARS,
    PREFIX,
    connect_store,
    first_failure,
    follow_waiting,
    my_rank,
    put_first,
    report_failure,
)

__all__ = [
    "abort_process_group",
    "default_grace",
    "default_timeout",
    "describe",
    "failure",
    "guard",
]

TIMEOUT_ENV = "ANNOT_TIMEOUT_S"
GRACE_ENV = "ANNOT_FAULT_GRACE_S"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 2.0


# -- settings ---------------------------------------------------------------


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise AnnotError(f"{name}={raw!r} is not a positive number of seconds; e.g. {name}=600")
    return value


def default_timeout(timeout_s: Optional[float] = None) -> float:
    """``timeout_s`` if given, else ``$ANNOT_TIMEOUT_S``, else 300 seconds."""
    if timeout_s is not None:
        if not timeout_s > 0:
            raise AnnotError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        return float(timeout_s)
    return _env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def default_grace(grace_s: Optional[float] = None) -> float:
    """``grace_s`` if given, else ``$ANNOT_FAULT_GRACE_S``, else 2 seconds."""
    if grace_s is not None:
        return max(0.0, float(grace_s))
    return _env_seconds(GRACE_ENV, DEFAULT_GRACE_S)


# -- the guard --------------------------------------------------------------


def _who(rank: Any, stage: Any) -> str:
    return f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")


def _during(op: str, microbatch: Any) -> str:
    return op + (f" of microbatch {microbatch}" if microbatch is not None else "")


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    # gloo prefixes its messages with the C++ source location: drop it.
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe(record: dict, me: int, mine: str) -> str:
    """The RankFailure message for ``record`` as seen by rank ``me``, which
    stopped in ``mine`` (e.g. ``"recv activations of microbatch 4"``)."""
    kind = record.get("kind")
    rank = record.get("rank")
    who = _who(rank, record.get("stage"))
    during = _during(str(record.get("op")), record.get("microbatch"))
    reporter = record.get("reporter")
    observer = "this rank" if reporter == me else f"rank {reporter}"
    if kind == "error":
        text = f"{who} failed during {during}: {record.get('error')}"
    elif kind == "timeout":
        text = (
            f"{who} did not respond within {record.get('timeout_s') or 0:g} s"
            f" while {observer} waited in {during}"
        )
    elif kind == "deadlock":
        text = (
            f"ranks {record.get('error')} all wait on the next one (a deadlock: their sends"
            " and receives are posted in orders that never match)"
        )
    else:
        text = f"{who} exited or closed its connection while {observer} waited in {during}"
    if rank != me and (kind == "error" or reporter != me):
        text += f"; this rank ({me}) stopped in {mine}"
    if rank != me and kind == "timeout":
        text += (
            f"\n  If rank {rank} is only slow (a long first step, a big checkpoint), raise"
            f" the timeout: {TIMEOUT_ENV}=600 or timeout_s=600."
        )
    elif rank != me and kind in ("error", "lost"):
        text += f"\n  The cause is in rank {rank}'s own output."
    return text


def _resolve(
    exc: BaseException,
    kind: str,
    *,
    me: int,
    op: str,
    stage: Optional[int],
    microbatch: Optional[int],
    peer: Optional[int],
    peer_stage: Optional[int],
    timeout_s: float,
    grace_s: float,
) -> RankFailure:
    """A communication failed: find who failed first and build the RankFailure."""
    mine = _during(op, microbatch)
    store = connect_store()
    mine_rec = {
        "rank": peer,
        "stage": peer_stage,
        "op": op,
        "microbatch": microbatch,
        "error": _short(exc)[:MAX_ERROR_CHARS],
        "kind": kind,
        "reporter": me,
        "timeout_s": timeout_s,
        "time": time.time(),
    }
    if store is not None and peer is not None:
        try:
            waiting = dict(mine_rec, rank=me, stage=stage, peer=peer, peer_stage=peer_stage)
            store.set(f"{PREFIX}waiting/{me}", json.dumps(waiting))
        except Exception:  # noqa: BLE001 - a dead store: local view only
            store = None
    deadline = time.monotonic() + (grace_s if kind == "timeout" else grace_s / 2)
    found = None
    while store is not None:
        rec = first_failure()
        if rec is not None and rec.get("rank") != me:
            found = rec
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if found is None and peer is not None:
        last, chain = follow_waiting(store, me, peer)
        if chain[-1] in chain[:-1]:
            cycle = chain[chain.index(chain[-1]) :]
            found = dict(mine_rec, kind="deadlock", rank=None, error=" -> ".join(map(str, cycle)))
        else:
            if last is None:  # nobody else waited: my peer is the culprit
                found = mine_rec
            else:  # the last waiter's peer is the culprit, as that waiter saw it
                found = {
                    "rank": last["peer"],
                    "stage": last.get("peer_stage"),
                    "op": last["op"],
                    "microbatch": last["microbatch"],
                    "error": last["error"],
                    "kind": last["kind"],
                    "reporter": last["reporter"],
                    "timeout_s": last["timeout_s"],
                    "time": time.time(),
                }
            if store is not None:
                stood = put_first(store, BLAME_KEY, found, me=me)
                if stood.get("rank") != me:
                    found = stood
    if found is None:
        return RankFailure(
            f"this rank ({me}) {'timed out' if kind == 'timeout' else 'lost a connection'}"
            f" in {mine} and no rank reported a failure: {_short(exc)}",
            rank=None,
            op=op,
            microbatch=microbatch,
        )
    return RankFailure(
        describe(found, me, mine),
        rank=found.get("rank"),
        stage=found.get("stage"),
        op=found.get("op"),
        microbatch=found.get("microbatch"),
    )


@contextlib.contextmanager
def guard(
    op: str,
    *,
    rank: Optional[int] = None,
    stage: Optional[int] = None,
    microbatch: Optional[int] = None,
    peer: Optional[int] = None,
    timeout_s: Optional[float] = None,
    peer_stage: Optional[int] = None,
    comm: Optional[bool] = None,
    grace_s: Optional[float] = None,
) -> Iterator[float]:
    """Turn any failure inside the block into a :class:`RankFailure` that names
    the rank that failed first; yields the timeout (seconds) to wait with.

    ``op`` is what the block does (``"forward"``, ``"recv activations"``),
    ``rank`` this rank (default: the process group's), ``stage`` and
    ``microbatch`` where it is. ``peer`` is the global rank a communication
    waits on (and ``peer_stage`` its stage, for the message); ``comm`` says the
    block communicates (default: ``peer is not None``; set it for collectives).

    - An exception in a block that does not communicate (or one that is not a
      communication failure) is this rank's own: it is reported to the store and
      raised as ``rank R (stage S) failed during OP of microbatch M: Type: msg``.
    - A timeout or a lost connection in a communication: the first failure in
      the store names the culprit if there is one (waiting up to the grace
      period for it to appear); else the chain of waiting ranks from ``peer``;
      else ``peer`` itself. The verdict is written back for the other ranks.

    A RankFailure raised inside passes through unchanged. After a RankFailure
    the process group is unusable: stop, and see :func:`abort_process_group`.
    """
    me = my_rank() if rank is None else rank
    timeout = default_timeout(timeout_s)
    connect_store()  # now, while every rank (and the store's host) is alive
    try:
        yield timeout
    except RankFailure:
        raise
    except Exception as exc:
        raise failure(
            exc,
            op,
            rank=me,
            stage=stage,
            microbatch=microbatch,
            peer=peer,
            timeout_s=timeout,
            peer_stage=peer_stage,
            comm=comm,
            grace_s=grace_s,
        ) from exc


def failure(
    exc: Exception,
    op: str,
    *,
    rank: Optional[int] = None,
    stage: Optional[int] = None,
    microbatch: Optional[int] = None,
    peer: Optional[int] = None,
    timeout_s: Optional[float] = None,
    peer_stage: Optional[int] = None,
    comm: Optional[bool] = None,
    grace_s: Optional[float] = None,
) -> RankFailure:
    """The :class:`RankFailure` :func:`guard` raises for ``exc`` (same
    arguments): for hot paths that catch the exception themselves instead of
    entering a guard per operation (``except Exception as exc: raise
    failure(exc, ...) from exc``), once :func:`guard` connected the store."""
    me = my_rank() if rank is None else rank
    timeout = default_timeout(timeout_s)
    is_comm = (peer is not None) if comm is None else comm
    kind = classify(exc) if is_comm else None
    if kind is None:
        error = _short(exc)
        report_failure(me, stage, op, microbatch, error, kind="error", reporter=me)
        return RankFailure(
            f"{_who(me, stage)} failed during {_during(op, microbatch)}: {error}",
            rank=me,
            stage=stage,
            op=op,
            microbatch=microbatch,
        )
    return _resolve(
        exc,
        kind,
        me=me,
        op=op,
        stage=stage,
        microbatch=microbatch,
        peer=peer,
        peer_stage=peer_stage,
        timeout_s=timeout,
        grace_s=default_grace(grace_s),
    )


# -- leaving ----------------------------------------------------------------


def abort_process_group(*, wait_s: float = 2.0, exit_code: Optional[int] = None) -> bool:
    """Tear down torch.distributed on a failing rank without hanging; True if
    the teardown finished within ``wait_s`` seconds.

    Closing this rank's connections promptly is what tells its peers (they see
    "Connection closed by peer" at once and look up the failure in the store).
    NCCL: ``_abort_process_group()`` (``ncclCommAbort``; destroy would wait for
    kernels that never end). gloo: ``destroy_process_group()``, which returns at
    once unless a collective is running for a hung peer. Either runs on a daemon
    thread for at most ``wait_s``; if it is still blocked, the process should
    leave without its destructors: pass ``exit_code`` to flush stdout/stderr and
    ``os._exit(exit_code)`` after the attempt.
    """
    done = threading.Event()

    def teardown() -> None:
        try:
            if dist.is_available() and dist.is_initialized():
                backend = str(dist.get_backend()).lower()
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if "nccl" in backend and abort is not None:
                    abort()
                else:
                    dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may refuse; we are leaving
            pass
        finally:
            done.set()

    threading.Thread(target=teardown, name="annot-abort", daemon=True).start()
    finished = done.wait(wait_s)
    if exit_code is not None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(exit_code)
    return finished
