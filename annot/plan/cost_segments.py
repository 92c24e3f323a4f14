"""The segments the cost model measures (:mod:`annot.plan.cost`):
:class:`Segment` (the callable, the modules it owns, a name), what one costs
(:class:`SegmentCost`), and :func:`as_segments`, which takes each of the ways
:func:`annot.plan.cost.profile_segments` accepts a segment (an
``nn.Module``, a :class:`Segment`, a callable with ``.modules``, or a plain
callable with the modules listed apart) to a :class:`Segment`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from annot.core.errors import PartitionError

__all__ = ["Segment", "SegmentCost", "as_segments"]


@dataclass(frozen=True)
class Segment:
    """A segment: the callable, the modules whose parameters it owns, a name."""

    fn: Callable[..., Any]
    modules: tuple[nn.Module, ...] = ()
    name: str = ""


@dataclass(frozen=True)
class SegmentCost:
    """What one segment costs; sizes in bytes, time in seconds, per microbatch."""

    name: str
    params: int
    n_params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    flops: int
    forward_flops: int
    time: float
    output_bytes: int
    shared: dict[str, int] = field(default_factory=dict)  # key -> param+grad+state bytes
    shared_numel: dict[str, int] = field(default_factory=dict)  # key -> elements
    cost: float = 0.0  # the scalar the partitioner balances

    @property
    def memory(self) -> int:
        """Bytes on a device: parameters, grads, optimizer state, buffers, activations."""
        return self.params + self.grads + self.optimizer + self.buffers + self.activations


def as_segments(segments: Sequence[Any], modules: Optional[Sequence[Sequence[nn.Module]]]):
    if modules is not None and len(modules) != len(segments):
        raise PartitionError(
            f"modules has {len(modules)} entries for {len(segments)} segments; give one list "
            "of owned modules per segment, e.g. modules=[[model.wte], [model.h[0]], ...]"
        )
    out = []
    for i, seg in enumerate(segments):
        if isinstance(seg, Segment):
            s = seg
        elif isinstance(seg, nn.Module):
            s = Segment(seg, (seg,), f"{i}:{type(seg).__name__}")
        elif callable(seg) and hasattr(seg, "modules"):
            s = Segment(seg, tuple(seg.modules), getattr(seg, "name", "") or "")
        elif callable(seg):
            s = Segment(seg, (), getattr(seg, "__name__", "") or "")
        else:
            raise PartitionError(
                f"segment {i} is a {type(seg).__name__}; expected an nn.Module, a Segment(fn, "
                "modules, name) or a callable seg(*state) -> state"
            )
        if modules is not None:
            s = Segment(s.fn, tuple(modules[i]), s.name)
        bad = [m for m in s.modules if not isinstance(m, nn.Module)]
        if bad:
            raise PartitionError(
                f"segment {i}: owned modules must be nn.Module objects, got {type(bad[0]).__name__}"
            )
        out.append(Segment(s.fn, s.modules, s.name or f"segment{i}"))
    return out
