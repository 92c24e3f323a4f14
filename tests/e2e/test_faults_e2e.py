"""A rank that raises, hangs or dies mid-step makes every other rank stop with
an error naming it (rank, stage, operation, microbatch), never a hang."""

import time

import pytest

from annot.testing import RanksFailed, run_ranks

TIMEOUT = 6


def _train(kind: str, cache: str):
    import os

    os.environ.update(
        {
            "ANNOT_CACHE_DIR": cache,
            "FAULT_KIND": kind,
            "FAULT_BLOCK": "3",
            "FAULT_CALL": "2",
            "ANNOT_TIMEOUT_S": str(TIMEOUT),
        }
    )
    import torch

    import annot
    from tests.fault_models import Faulty

    model = annot.parallelize(Faulty, mesh=annot.Mesh(pp=3), seed=0, split=["blocks.1", "blocks.2"])

    @annot.jit(model, microbatches=4, timeout_s=TIMEOUT)
    def step(x):
        loss = model(x)
        model.backward(loss)
        return loss

    step(torch.randn(8, 4))
    return "finished"


@pytest.mark.parametrize(
    "kind",
    # a hang waits out the timeout (26 s): with the slow cases for the fast-set budget;
    # tests/runtime/faults/test_failures.py names a hung rank (and a killed one) in the fast set
    [
        "raise",
        pytest.param("hang", marks=pytest.mark.slow),
        pytest.param("kill", marks=pytest.mark.slow),
    ],
)
def test_failing_last_stage_named_by_every_rank(kind, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_train, 3, kind, str(tmp_path), timeout=120, failure_grace=TIMEOUT + 5)
    elapsed = time.monotonic() - t0
    failures = info.value.failures
    # The surviving ranks (0 and 1) stop on their own with a RankFailure naming rank 2.
    for r in (0, 1):
        assert r in failures, f"rank {r} did not stop by itself: {sorted(failures)}"
        assert "RankFailure" in failures[r], failures[r]
        assert "rank 2 (stage 2)" in failures[r], failures[r]
        # A rank that raised or hung reports its own microbatch; a killed one cannot,
        # so the survivors name the microbatch they were waiting on.
        assert ("microbatch 1" if kind != "kill" else "microbatch") in failures[r], failures[r]
    if kind == "raise":
        assert "boom in block 3" in failures[2]
    assert elapsed < 60 + TIMEOUT, elapsed  # no hang: a bound, not a timing assertion
