"""The gloo harness itself: results, failures, deadlines."""

import os
import time

import pytest

from annot.testing import RanksFailed, run_ranks


def _rank_times(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank() * scale, t.item()


def _raise_on_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the harness


def _die_on_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def _sleep_forever():
    time.sleep(600)


def test_results_in_rank_order():
    assert run_ranks(_rank_times, 2, 10) == [(0, 3.0), (10, 3.0)]


def test_exception_collected_and_others_killed():
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_one, 2, timeout=60)
    assert "boom on rank one" in str(info.value)
    assert set(info.value.failures) >= {1}  # rank 1 raised
    assert time.monotonic() - t0 < 30


def test_dead_rank_reported():
    with pytest.raises(RanksFailed, match="rank 0 exited with code 3"):
        run_ranks(_die_on_zero, 2, timeout=60)


def test_deadline():
    with pytest.raises(RanksFailed, match="did not finish within 5 s"):
        run_ranks(_sleep_forever, 2, timeout=5)
