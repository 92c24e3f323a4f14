"""Raw parameters split over tp: ``P("tp", None)`` on a parameter emits
``shard_parameter(nn.Parameter(...), dim=0, tp=N)``, which keeps this rank's
slice as a :class:`ShardedParameter` recording the split for
``annot.runtime.tp.state_dict``. The rewritten code imports ``shard_parameter``
from :mod:`annot.runtime.tp.layers`, which re-exports it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from annot.core.errors import HintError
from annot.runtime.tp.checks import check_degree, mesh_for, tp_context
from annot.runtime.tp.comm import split_local

__all__ = ["ShardedParameter", "shard_parameter"]


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` holding this rank's slice of a full parameter.

    ``annot_shard_dim`` is the split dim and ``annot_tp`` the degree; both
    survive ``copy.deepcopy`` (plain ``nn.Parameter`` drops attributes there),
    pickling and ``.to()``.
    """

    # set by shard_parameter (annotations only: a parameter without them has none)
    annot_shard_dim: int
    annot_shard_chunks: int
    annot_tp: int

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        result = super().__deepcopy__(memo)
        result.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return result

    # torch's stub gives Tensor.__repr__ a keyword-only parameter with no name
    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"Parameter containing (tp shard dim={self.annot_shard_dim} of "
            f"tp={self.annot_tp}):\n{self.detach()!r}"
        )


def shard_parameter(
    param: torch.Tensor, *, dim: int, chunks: int = 1, tp: int = 1
) -> ShardedParameter:
    """This rank's contiguous ``1/tp`` slice of ``param`` along ``dim`` (of each
    of ``chunks`` equal blocks), as a new parameter (same ``requires_grad``)
    that records ``dim``, ``chunks`` and ``tp`` for ``annot.runtime.tp.state_dict``. The
    full ``param`` is not kept."""
    name = "shard_parameter"
    check_degree(name, tp)
    if not -param.dim() <= dim < param.dim():
        raise HintError(
            f"{name}: dim={dim} is out of range for a {param.dim()}-D parameter of shape "
            f"{tuple(param.shape)}"
        )
    dim %= param.dim()
    size = param.shape[dim]
    if size % (tp * chunks):
        raise HintError(
            f"{name}: dim {dim} of shape {tuple(param.shape)} has size {size}, which is not "
            f"divisible by tp({tp}) * chunks({chunks}); split another dim or pad this one"
        )
    mesh_for(name, tp)
    data = param.detach()
    if tp > 1:
        data = split_local(data, dim, chunks, tp, tp_context(name, tp).tp_rank).clone()
    out = ShardedParameter(data, requires_grad=param.requires_grad)
    out.annot_shard_dim = dim
    out.annot_shard_chunks = chunks
    out.annot_tp = tp
    return out
