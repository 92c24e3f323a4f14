"""Mixed precision: ``precision="bf16"`` runs forward under ``torch.autocast``.

Parameters, gradients, optimizer state and the dp / tied-weight gradient
reductions stay float32 (the master weights); matmuls and the activations
between them (tp collectives, pipeline sends) run in bfloat16. The loss runs
inside the autocast region, as torch recommends: ``F.cross_entropy`` autocasts
to float32, and annot's vocab-parallel cross-entropy computes in float32 on
low-precision logits. Backward runs outside autocast, in the dtypes forward
chose. fp16 would need loss scaling and is not offered.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from annot.core.errors import HintError

__all__ = ["PRECISIONS", "parse_precision", "forward_context", "backward_context"]

PRECISIONS: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16}


def parse_precision(precision: Optional[str]) -> Optional[torch.dtype]:
    """The autocast dtype for ``precision`` (None: plain float32)."""
    if precision is None:
        return None
    if precision not in PRECISIONS:
        extra = " (fp16 needs loss scaling; use bf16)" if precision == "fp16" else ""
        raise HintError(
            f"parallelize: precision={precision!r}{extra}; expected one of "
            f"{', '.join(map(repr, PRECISIONS))} or None"
        )
    return PRECISIONS[precision]


def forward_context(device: torch.device, dtype: Optional[torch.dtype]):
    """Where forward (and the loss) runs: autocast to ``dtype`` on ``device``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def backward_context(device: torch.device, dtype: Optional[torch.dtype]):
    """Where backward runs: autocast off, even inside a forward region."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
