"""Value reads: tensor methods that answer a Python value read from the data
(``bool(x)``, ``x.item()``, ``x.tolist()``, ``torch.equal``, ...).

A branch on such a value must take the same path on every pipeline stage, so
the replay (:mod:`annot.runtime.runners.replay`) logs the answers of the stage that
computes them for real (:func:`log_reads`, undone by :func:`unlog`) and
answers the later stages' replay from that log (the ops in :data:`DECISIONS`).
"""

from __future__ import annotations

import torch

__all__ = ["DECISIONS", "log_reads", "unlog"]

# Tensor methods whose answer is a Python value read from the data: a branch on
# them must take the same path on every stage, so their answers are logged.
DECISIONS = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__complex__,
    torch.equal,
    torch.is_nonzero,
    torch.Tensor.__contains__,  # (Python: reads .item() inside, which the replay does not see)
}


_READS = (
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__index__"),
    (torch.Tensor, "__complex__"),
    (torch, "equal"),
    (torch, "is_nonzero"),
    (torch.Tensor, "__contains__"),
)


def log_reads(log: list) -> list:
    """Wrap the value-read methods so their answers are appended to ``log``
    (cheaper than a mode over every op); returns what :func:`unlog` restores.
    A read inside another (``x in t`` calls ``.item()``) is not logged: the
    replay answers the outer one, as its mode sees it."""
    saved = []
    inside = [0]
    for owner, name in _READS:
        own = owner.__dict__.get(name)
        orig = getattr(owner, name)

        def read(*a, _orig=orig, **k):
            if inside[0]:
                return _orig(*a, **k)
            inside[0] += 1
            try:
                value = _orig(*a, **k)
            finally:
                inside[0] -= 1
            log.append(value)
            return value

        saved.append((owner, name, own))
        setattr(owner, name, read)
    return saved


def unlog(saved: list) -> None:
    for owner, name, own in reversed(saved):
        if own is None:
            delattr(owner, name)  # inherited (torch._C.TensorBase) again
        else:
            setattr(owner, name, own)
