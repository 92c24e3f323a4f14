"""Mesh coordinates and peer ranks, without processes: a dp x pp x tp mesh is
laid out tp fastest (torch's DeviceMesh order), so tp peers are adjacent
ranks, pipeline peers are tp ranks apart and dp replicas pp * tp apart."""

import itertools

from annot import Mesh
from annot.runtime.process_groups import ParallelContext


def test_peer_ranks_on_a_dp_pp_tp_mesh():
    mesh = Mesh(dp=2, pp=3, tp=2)
    for rank in range(mesh.size):
        ctx = ParallelContext(mesh=mesh, rank=rank, world_size=mesh.size)
        dp, pp, tp = mesh.coords(rank)
        assert (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank) == (dp, pp, tp)
        assert mesh.rank_of(dp, pp, tp) == rank
        base = dp * 6 + pp * 2
        assert ctx.axis_ranks("tp") == [base, base + 1]
        assert ctx.axis_ranks("pp") == [dp * 6 + p * 2 + tp for p in range(3)]
        assert ctx.axis_ranks("dp") == [d * 6 + pp * 2 + tp for d in range(2)]
        for axis in ("dp", "pp", "tp"):
            assert rank in ctx.axis_ranks(axis)


def test_axis_groups_partition_the_world():
    mesh = Mesh(dp=2, pp=2, tp=2)
    for axis in ("dp", "pp", "tp"):
        groups = {
            tuple(ParallelContext(mesh=mesh, rank=r, world_size=8).axis_ranks(axis))
            for r in range(8)
        }
        members = sorted(itertools.chain.from_iterable(groups))
        assert members == list(range(8)), axis  # every rank in exactly one group
