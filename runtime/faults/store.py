"""The failure records of :mod:`annot.runtime.faults.failures` in torch.distributed's
key-value store: a rank reports its own failure or blames another
(:func:`report_failure`), every rank reads the first one without blocking
(:func:`first_failure`), and the chain of waiting ranks leads to the one that
hung or died (:func:`follow_waiting`).

The store (keys under ``annot/``):

- ``annot/failure/self``: the first rank that reported its own failure (an
  exception in its compute, a bad message it received). First writer wins.
- ``annot/failure/blame``: the first rank that another rank blamed (it did not
  respond in time, or its connection closed without a report). First writer
  wins, except that a rank still alive replaces a blame that names itself.
- ``annot/waiting/<rank>``: written by a rank whose wait on ``peer`` failed.
  Following these from one's own peer (0 waited on 1, 1 waited on 2) reaches
  the rank that is not itself waiting on anyone: the one that hung or died.

The store is a ``torch.distributed.TCPStore`` client connected to the store of
the default group (``MASTER_ADDR:MASTER_PORT``, which torchrun and the env://
init both serve), made when the first guard is entered, while every rank is
still alive. Without it (no environment, store host gone) each rank only
reports what it saw itself.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "BLAME_KEY",
    "MAX_ERROR_CHARS",
    "PREFIX",
    "connect_store",
    "first_failure",
    "follow_waiting",
    "my_rank",
    "put_first",
    "report_failure",
    "set_store",
]

PREFIX = "annot/"
_SELF_KEY = PREFIX + "failure/self"
BLAME_KEY = PREFIX + "failure/blame"
_STORE_TIMEOUT_S = 5.0
MAX_ERROR_CHARS = 2000


def my_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


_store_state: dict[str, Any] = {"pid": None, "store": None}


def set_store(store: Any) -> None:
    """Use ``store`` (any ``torch.distributed.Store``, e.g. a ``HashStore`` in a
    test) for failure records; ``None`` disables the side channel."""
    _store_state.update(pid=os.getpid(), store=store)


def connect_store() -> Any:
    """The store for failure records, connected on first use; None when there is
    none (no process group, no ``MASTER_ADDR``/``MASTER_PORT``, or unreachable)."""
    if _store_state["pid"] == os.getpid():
        return _store_state["store"]
    if not (dist.is_available() and dist.is_initialized()):
        return None  # not yet: try again once the process group exists
    store = None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            store = dist.TCPStore(
                addr,
                int(port),
                is_master=False,
                timeout=timedelta(seconds=_STORE_TIMEOUT_S),
            )
        except Exception:  # noqa: BLE001 - degrade to local messages
            store = None
    set_store(store)
    return store


def _get(store: Any, key: str) -> Optional[dict]:
    """The JSON record under ``key``, or None, without blocking on a missing key."""
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key))
    except Exception:  # noqa: BLE001 - a dead store reads as empty
        return None


def put_first(store: Any, key: str, record: dict, me: Optional[int] = None) -> dict:
    """Write ``record`` unless ``key`` holds one already; return whichever holds.
    A record that names ``me`` (a live rank blamed by mistake) is replaced."""
    text = json.dumps(record)
    try:
        held = store.compare_set(key, "", text)
        first = json.loads(held)
        if me is not None and first.get("rank") == me and first != record:
            first = json.loads(store.compare_set(key, held.decode(), text))
        return first
    except Exception:  # noqa: BLE001 - a dead store: keep our own view
        return record


def report_failure(
    rank: int,
    stage: Optional[int],
    op: str,
    microbatch: Optional[int],
    error: str,
    *,
    kind: Optional[str] = None,
    reporter: Optional[int] = None,
    timeout_s: Optional[float] = None,
) -> dict:
    """Record that ``rank`` failed (first writer wins); return the record that
    now stands: ours, or the one written before it.

    ``kind``: ``"error"`` (the rank reports its own exception; the default when
    ``rank`` is the reporter), ``"timeout"`` (did not respond within
    ``timeout_s``) or ``"lost"`` (its connection closed; the default otherwise).
    ``reporter`` (default: this rank) is the rank that saw it.
    """
    reporter = my_rank() if reporter is None else reporter
    kind = kind or ("error" if rank == reporter else "lost")
    record = {
        "rank": rank,
        "stage": stage,
        "op": op,
        "microbatch": microbatch,
        "error": error[:MAX_ERROR_CHARS],
        "kind": kind,
        "reporter": reporter,
        "timeout_s": timeout_s,
        "time": time.time(),
    }
    store = connect_store()
    if store is None:
        return record
    key = _SELF_KEY if kind == "error" else BLAME_KEY
    return put_first(store, key, record, me=None if kind == "error" else my_rank())


def first_failure() -> Optional[dict]:
    """The first failure recorded by any rank, without blocking: a rank's own
    report wins over another rank's blame. None if nothing is recorded (or there
    is no store). Keys: rank, stage, op, microbatch, error, kind, reporter,
    timeout_s, time."""
    store = connect_store()
    if store is None:
        return None
    return _get(store, _SELF_KEY) or _get(store, BLAME_KEY)


def follow_waiting(store: Any, me: int, peer: int) -> tuple[Optional[dict], list]:
    """Follow ``annot/waiting/<rank>`` records from ``peer``; return the waiting
    record of the last rank in the chain (``peer`` is its culprit) and the chain."""
    chain = [me, peer]
    last = None
    while store is not None:
        rec = _get(store, f"{PREFIX}waiting/{chain[-1]}")
        if rec is None or not isinstance(rec.get("peer"), int):
            break
        last = rec
        chain.append(rec["peer"])
        if rec["peer"] in chain[:-1]:
            break
    return last, chain
