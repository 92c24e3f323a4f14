"""Waiting on one ``torch.distributed`` Work with a timeout (:func:`wait_work`),
and telling a communication failure (a timeout, a lost peer) from any other
error (:func:`classify`): the backend side of :mod:`annot.runtime.faults.failures`.

What gloo does (torch 2.13, measured):

- ``Work.wait(timeout=timedelta(...))`` raises ``RuntimeError: ... Timed out
  waiting 1000ms for recv operation to complete`` and closes *every* connection
  of that process group (later calls: "Application timeout caused pair
  closure"), so the group is unusable after a timeout and the peers of the
  timed-out rank see "Connection closed by peer" at once.
- A peer that exits (even ``os._exit``) shows at once as ``RuntimeError: ...
  Connection closed by peer``.
- ``Work.is_completed()`` of a gloo recv stays False until ``wait()`` is called,
  so a gloo wait cannot be sliced into short polls: it is one ``wait(timeout)``.
  (NCCL is the other way round: :func:`wait_work` polls ``is_completed()``.)
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["CommTimeout", "classify", "wait_work"]


class CommTimeout(TimeoutError):
    """A communication did not complete within its timeout (raised by
    :func:`wait_work` on backends whose ``Work`` is polled)."""


def wait_work(work: Any, timeout_s: float, *, backend: Optional[str] = None) -> None:
    """Wait for one ``torch.distributed`` Work, at most ``timeout_s`` seconds.

    gloo: ``work.wait(timeout=...)`` (a timeout raises RuntimeError and, in
    gloo, breaks the whole group). Other backends (NCCL): poll
    ``work.is_completed()`` from the host, then ``work.wait()`` to order the
    current stream after it; :class:`CommTimeout` past the deadline.
    """
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if "gloo" in str(backend).lower():
        if work.wait(timeout=timedelta(seconds=timeout_s)) is False:
            raise RuntimeError("connection closed: the operation was aborted")
        return
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CommTimeout(f"timed out after {timeout_s:g} s waiting for the operation")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()


_LOST_MARKS = (
    "pair closure",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "remote worker",
    "socket closed",
    "end of file",
    "communicator was aborted",
    "remote process exited",
    "network error",
    "ncclremoteerror",
)
_TIMEOUT_MARKS = ("timed out", "timeout", "deadline exceeded")


def classify(exc: BaseException) -> Optional[str]:
    """``"timeout"``, ``"lost"`` (a peer's connection went away), or None when
    ``exc`` is not a communication failure."""
    if isinstance(exc, CommTimeout):
        return "timeout"
    if not isinstance(exc, (RuntimeError, OSError)):
        return None
    text = str(exc).lower()
    if any(mark in text for mark in _LOST_MARKS):
        return "lost"
    if any(mark in text for mark in _TIMEOUT_MARKS):
        return "timeout"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return "timeout" if isinstance(exc, TimeoutError) else "lost"
    return None
