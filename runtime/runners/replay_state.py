"""The state of the replay on this rank (:mod:`annot.runtime.runners.replay`):
the (stage, microbatch) forward under way, whether it replays an earlier
stage's part or runs its own for real, and the logged module calls open in it."""

from __future__ import annotations

from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from annot.runtime.runners.replay import ReplayStage

__all__ = ["ACTIVE", "Call", "Run", "StageDone", "replaying", "running_live"]


class StageDone(BaseException):
    """This stage's part of the forward is over (raised at the next boundary).

    A ``BaseException``, so model code's ``except Exception`` does not catch
    it; the pipeline executor does, around the step body."""


class Run:
    """One (stage, microbatch) forward on this rank."""

    def __init__(self, stage: ReplayStage, received: Optional[dict], record: bool):
        self.stage = stage
        self.index = stage.index
        self.received = received
        self.crossed = 0  # boundaries passed so far in this forward
        self.replaying = stage.index > 0
        self.decisions_in = list(received["d"]) if received else []
        self.pos = 0
        self.decisions_out: list = []
        self.record = record
        self.outputs: Optional[dict] = None
        self.grad_mode = torch.is_grad_enabled()
        self.top_code: Optional[CodeType] = None  # the frame where the walk stops (the runner's)
        self.mode: Any = None  # the replay mode while replaying
        self.patches: list = []  # value reads logged while running for real
        # The output log of the modules other stages hold as placeholders, by
        # (key, how many calls of it came before in this forward): what the
        # owner recorded (received) and what goes on (received + this stage's).
        self.logged = {(e[0], e[1]): e for e in received["m"]} if received else {}
        self.log_out: list = list(received["m"]) if received and record else []
        self.calls: dict[str, int] = {}  # logged modules (by key) entered so far, with counts
        self.entered: list[str] = []  # ... in order
        self.open: list[Call] = []  # the logged calls under way, innermost last


ACTIVE: list[Run] = []


def replaying() -> bool:
    """True while this rank replays an earlier stage's part of forward."""
    return bool(ACTIVE) and ACTIVE[-1].replaying


def running_live() -> Optional[int]:
    """The stage this rank runs for real right now (between its boundaries),
    else None (replaying, or no stage running)."""
    return ACTIVE[-1].index if ACTIVE and not ACTIVE[-1].replaying else None


@dataclass(slots=True)
class Call:
    """A logged module's call under way (see :func:`install_output_log`)."""

    key: str
    n: int  # calls of it before this one in the forward
    start: int  # the value-read log's length when it began
    inner: int  # len(run.entered) when it began
    lists: list  # the collectors' lists, and their lengths when it began
    sizes: list
    module: nn.Module
    kind: str  # "own", "absent", "shadow"; "answered" once answered from the log
