"""What a pipeline stage holds on one device during training, in bytes, from
counts and shapes alone (no weight is ever allocated).

A stage's memory is

* **weights**, **gradients**, a **master** copy and **optimizer** state, per
  parameter element by :class:`Training`'s precision and optimizer:

  ==============  =======  =====  ======  ==========================
  precision       weights  grads  master  optimizer (AdamW: 2 states)
  ==============  =======  =====  ======  ==========================
  fp32            4        4      0       2 x 4
  bf16-autocast   4        4      0       2 x 4   (annot's ``precision="bf16"``:
                                                  float32 weights, bf16 compute)
  bf16            2        2      4       2 x 4   (bf16 weights with float32
                                                  master copies: both counted)
  ==============  =======  =====  ======  ==========================

  Adam and AdamW also keep a float32 ``step`` per parameter tensor (4 bytes
  each), as ``torch.optim`` does; SGD (with momentum) one state, "none" none.
  With ``fsdp`` the master copy and optimizer state are divided by dp, and
  so are weights and gradients without a pipeline (a pipeline stage holds
  its weights and gradients whole during a step, as annot's FSDP2 does).
* **activations**: the bytes one microbatch's forward saves for backward
  (:class:`annot.plan.saved_bytes.SavedBytes`, measured on meta at the
  microbatch size and sequence length asked for) times the microbatches the
  schedule keeps in flight on that stage (:func:`in_flight`: 1F1B holds up to
  pp on stage 0, GPipe all of them). With activation checkpointing each
  block keeps only what its checkpoint saves (its inputs) per microbatch in
  flight, plus the full activations of one block while backward recomputes
  it. Plus, once, the most bytes backward holds at once in the tensors it
  makes (gradients on their way: for the loss, those of the logits),
  measured on meta as well (:class:`annot.plan.saved_bytes.BackwardPeak`).

Communication buffers, the allocator's slack, temporaries within an op and
the framework's own memory are left out.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch.nn as nn

from annot.core.errors import AnnotError, PartitionError

__all__ = [
    "OPTIMIZER_STATES",
    "Activations",
    "PRECISIONS",
    "ParamBytes",
    "StageMemory",
    "Training",
    "in_flight",
    "param_bytes",
    "stage_memory",
]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # float32 states per element
_STEP_BYTES = {"adamw": 4, "adam": 4}  # the float32 step tensor per parameter tensor
# bytes per element: weights, gradients, master copy
PRECISIONS = {"fp32": (4, 4, 0), "bf16-autocast": (4, 4, 0), "bf16": (2, 2, 4)}
SCHEDULES = ("1f1b", "gpipe", "zbh1")  # one stage per rank


@dataclass(frozen=True)
class Training:
    """How the model is trained, as far as memory goes (see the module docstring)."""

    optimizer: str = "adamw"
    precision: str = "fp32"
    microbatches: int = 8
    schedule: str = "1f1b"
    recompute: bool = False  # activation recompute of every block
    fsdp: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise PartitionError(
                f"optimizer={self.optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}"
            )
        if self.precision not in PRECISIONS:
            raise PartitionError(
                f"precision={self.precision!r}; expected one of {sorted(PRECISIONS)}"
            )
        if self.schedule not in SCHEDULES:
            raise PartitionError(f"schedule={self.schedule!r}; expected one of {SCHEDULES}")
        n = self.microbatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PartitionError(f"microbatches={n!r}; expected an int >= 1")

    @property
    def activation_dtype_bytes(self) -> int:
        """Bytes per activation element: 2 under bf16, else 4."""
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class ParamBytes:
    """Bytes of the parameter side of a stage."""

    weights: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer

    def __add__(self, other: ParamBytes) -> ParamBytes:
        return ParamBytes(
            self.weights + other.weights,
            self.grads + other.grads,
            self.master + other.master,
            self.optimizer + other.optimizer,
        )


def param_bytes(
    numel: int, tensors: int, trainable: bool, setup: Training, dp: int = 1, pp: int = 1
) -> ParamBytes:
    """The bytes ``numel`` elements in ``tensors`` parameter tensors take under
    ``setup`` on one device (with ``fsdp``, this rank's share over ``dp``)."""
    w, g, m = PRECISIONS[setup.precision]
    states = OPTIMIZER_STATES[setup.optimizer]
    if not trainable:
        return ParamBytes(weights=numel * w)
    whole = 1 if (not setup.fsdp or pp > 1) else dp  # weights and grads
    shard = dp if setup.fsdp else 1  # master copy and optimizer state
    return ParamBytes(
        weights=math.ceil(numel / whole) * w,
        grads=math.ceil(numel / whole) * g,
        master=math.ceil(numel / shard) * m,
        optimizer=math.ceil(numel / shard) * 4 * states
        + tensors * _STEP_BYTES.get(setup.optimizer, 0),
    )


@dataclass(frozen=True)
class StageMemory:
    """One stage's bytes on a device; ``activations`` for ``in_flight``
    microbatches, with ``recompute`` (the one block backward recomputes at a
    time under activation checkpointing) and ``transient`` (the most
    backward holds at once in the gradients on their way) included."""

    params: ParamBytes
    buffers: int
    activations: int
    in_flight: int
    recompute: int = 0
    transient: int = 0

    @property
    def total(self) -> int:
        return self.params.total + self.buffers + self.activations


def in_flight(schedule: str, pp: int, microbatches: int) -> list[int]:
    """The most microbatches whose activations each pipeline rank holds at once
    under ``schedule``: :func:`annot.runtime.pipeline.schedule_check.peak_in_flight` over
    the schedule as data (1F1B: ``min(pp - r, M)`` on rank r; GPipe: M)."""
    from annot.runtime.pipeline.schedule_check import peak_in_flight
    from annot.runtime.pipeline.schedules import get_schedule

    if pp == 1:  # no pipeline: the microbatches accumulate one after another
        return [1]
    try:
        sched = get_schedule(schedule, pp, microbatches)
    except AnnotError as exc:  # the schedule's own refusal
        raise PartitionError(f"schedule {schedule!r} at pp={pp}: {exc}") from None
    return [peak_in_flight(sched, r) for r in range(pp)]


@dataclass(frozen=True)
class Activations:
    """A stage's activation figures: bytes kept ``per_microbatch`` for
    backward, the microbatches ``in_flight``, the block backward
    ``recompute``-s under checkpointing, backward's ``transient``."""

    per_microbatch: int = 0
    in_flight: int = 0
    recompute: int = 0
    transient: int = 0


def stage_memory(
    modules: Iterable[nn.Module],
    acts: Activations,
    setup: Training,
    *,
    tp: int = 1,
    sharded: Collection[int] = frozenset(),
    dp: int = 1,
    pp: int = 1,
) -> StageMemory:
    """The bytes of a stage that holds ``modules`` (each parameter and buffer
    once; the parameters whose ids are in ``sharded`` at ``1/tp``) with
    ``acts``, under ``setup``."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            params.setdefault(id(p), p)
        for t in m.buffers():
            buffers[id(t)] = t.numel() * t.element_size()
    total = ParamBytes()
    for pid, p in params.items():
        numel = math.ceil(p.numel() / tp) if pid in sharded else p.numel()
        total = total + param_bytes(numel, 1, p.requires_grad, setup, dp, pp)
    return StageMemory(
        params=total,
        buffers=sum(buffers.values()),
        activations=acts.per_microbatch * acts.in_flight + acts.recompute + acts.transient,
        in_flight=acts.in_flight,
        recompute=acts.recompute,
        transient=acts.transient,
    )
