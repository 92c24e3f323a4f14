"""Tensors split by expert over an expert group: each rank holds ``E / ep``
experts of every tensor of a module hinted ``Experts()`` (dim 0 is the expert).

A split tensor carries ``annot_ep`` (the degree) for the code that makes
tensors whole or cuts them (:mod:`annot.runtime.tp.state_dict`, deferred
initialization, gradient reduction and clipping): :func:`expert_degree` reads
it, :func:`own_experts` cuts a whole tensor to this rank's experts and
:func:`gather_experts` puts the ranks' experts back together. The expert dim is
the outer split: a tensor also split over tp is cut to its experts first.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from annot.core.errors import HintError
from annot.runtime.process_groups import current

__all__ = [
    "EP_ATTR",
    "expert_degree",
    "expert_env",
    "expert_group",
    "gather_experts",
    "own_experts",
    "split_experts",
]

EP_ATTR = "annot_ep"

# torch 2.13 renamed all_gather_into_tensor (the old name warns); keep both
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def expert_degree(t: torch.Tensor) -> int:
    """Over how many ranks ``t``'s experts are split (1: not split)."""
    return int(t.__dict__.get(EP_ATTR, 1)) if hasattr(t, "__dict__") else 1


def expert_env() -> tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, size, rank)`` of this rank's expert group; ``(None, 1, 0)``
    without a context or expert parallelism."""
    ctx = current()
    if ctx is None or ctx.mesh.ep == 1:
        return None, 1, 0
    return ctx.ep_group, ctx.mesh.ep, ctx.ep_rank


def expert_group(ep: int, what: str) -> tuple[Optional[dist.ProcessGroup], int]:
    """``(group, rank in it)`` of the current context's expert group, which
    must split over ``ep`` ranks (what ``what`` was split for)."""
    group, size, rank = expert_env()
    if size != ep:
        raise HintError(
            f"{what} is split over ep={ep} but the current mesh has ep={size}; call this inside "
            "annot.runtime.process_groups.use(ctx) with the mesh the model was built for"
        )
    return group, rank


def own_experts(
    t: torch.Tensor, ep: int, what: str = "a tensor", rank: Optional[int] = None
) -> torch.Tensor:
    """This rank's experts of the whole tensor ``t`` (a view of dim 0); the
    rank in the expert group is the current context's unless given."""
    if ep == 1:
        return t
    if rank is None:
        _, rank = expert_group(ep, what)
    n = t.shape[0] // ep
    return t.narrow(0, rank * n, n)


def gather_experts(t: torch.Tensor, ep: int, what: str = "a tensor") -> torch.Tensor:
    """Every rank's experts of ``t``, whole, on each rank of the expert group
    (all of them call it together)."""
    if ep == 1:
        return t
    group, _ = expert_group(ep, what)
    t = t.detach().contiguous()
    out = t.new_empty((ep * t.shape[0], *t.shape[1:]))
    if not t.is_meta:
        _all_gather_single(out, t, group=group)
    return out


def split_experts(module: nn.Module, count: int, ep: int, rank: int) -> None:
    """Keep this rank's experts of each of ``module``'s tensors with dim 0 =
    ``count`` (meta tensors: the shape only), same class, attributes and
    ``requires_grad``."""
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or not t.dim() or t.shape[0] != count:
                    continue
                if getattr(t, "annot_shard_dim", None) == 0:
                    raise HintError(
                        f"{type(mod).__name__}.{name}: a tp hint splits dim 0, the experts' dim, "
                        "which Experts() splits over ep; split each expert inside instead "
                        '(P(None, "tp", ...) on its weights, Experts(partial=True))'
                    )
                n = t.shape[0] // ep
                data = t.detach().narrow(0, rank * n, n)
                data = data if data.is_meta else data.clone()
                new = (
                    type(t)(data, requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter)
                    else data
                )
                new.__dict__.update(t.__dict__)
                new.__dict__[EP_ATTR] = ep
                table[name] = new  # type: ignore[assignment]
