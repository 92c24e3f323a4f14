"""Shared parity checks: a parallel run against the single-device reference.

Tolerances are written down once, per dtype (float32 here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

RTOL = {torch.float32: 1e-5}
ATOL = {torch.float32: 4e-5}


def assert_close(actual, expected, what: str, dtype=torch.float32) -> None:
    torch.testing.assert_close(
        actual.detach().cpu().to(expected.dtype),
        expected.detach().cpu(),
        rtol=RTOL[dtype],
        atol=ATOL[dtype],
        msg=lambda m: f"{what}: {m}",
    )


def gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    """All-gather a tensor sharded on its last dim over ``group``."""
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def compare_state(model, ref, what: str) -> None:
    full = model.full_state_dict()
    for k, v in ref.state_dict().items():
        assert k in full, f"{what}: key {k} missing from the parallel model's state dict"
        assert_close(full[k], v, f"{what}: {k}")


def compare_grads(model, ref, what: str) -> None:
    grads = model.full_grads()
    for k, p in ref.named_parameters():
        assert p.grad is not None, f"reference {k} has no grad"
        assert k in grads, f"{what}: no gradient for {k} in the parallel model"
        assert_close(grads[k], p.grad, f"{what}: grad {k}")
