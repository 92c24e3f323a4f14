"""annot.runtime.faults.failures: a failing, hanging or dead rank makes every other rank raise
RankFailure naming it, within the timeout (real gloo ranks), and the pieces
(store records, culprit chain, messages) in one process."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from annot.core.errors import AnnotError, RankFailure
from annot.runtime.faults import comm_wait
from annot.runtime.faults import failures as faults
from annot.runtime.faults import store as fault_store
from annot.runtime.faults.failures import abort_process_group, guard
from annot.testing import RanksFailed, run_ranks

TIMEOUT_S = 5.0
FAULT_ENV = {"ANNOT_FAULT_GRACE_S": "1"}


@pytest.fixture
def store():
    s = dist.HashStore()
    fault_store.set_store(s)
    yield s
    fault_store.set_store(None)


@pytest.fixture
def no_store():
    fault_store.set_store(None)


# -- one process ------------------------------------------------------------


def test_default_timeout(monkeypatch):
    monkeypatch.delenv("ANNOT_TIMEOUT_S", raising=False)
    assert faults.default_timeout() == 300.0
    monkeypatch.setenv("ANNOT_TIMEOUT_S", "12.5")
    assert faults.default_timeout() == 12.5
    assert faults.default_timeout(3) == 3.0
    monkeypatch.setenv("ANNOT_TIMEOUT_S", "soon")
    with pytest.raises(AnnotError, match=r"ANNOT_TIMEOUT_S='soon' is not a positive number"):
        faults.default_timeout()


def test_classify_gloo_messages():
    closed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
        " [127.0.0.1]:28826. This is typically caused by a remote worker crashing."
    )
    timed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting"
        " 1000ms for recv operation to complete"
    )
    assert comm_wait.classify(closed) == "lost"
    assert comm_wait.classify(RuntimeError("Connection reset by peer")) == "lost"
    assert comm_wait.classify(RuntimeError("Application timeout caused pair closure")) == "lost"
    assert comm_wait.classify(timed) == "timeout"
    assert comm_wait.classify(comm_wait.CommTimeout("x")) == "timeout"
    assert comm_wait.classify(ValueError("Connection closed")) is None
    assert comm_wait.classify(RuntimeError("shape mismatch")) is None


def test_local_failure_is_reported_and_named(store):
    with pytest.raises(RankFailure) as info, guard("forward", rank=3, stage=1, microbatch=2):
        raise ValueError("boom")
    err = info.value
    assert str(err) == "rank 3 (stage 1) failed during forward of microbatch 2: ValueError: boom"
    assert (err.rank, err.stage, err.op, err.microbatch) == (3, 1, "forward", 2)
    assert isinstance(err.__cause__, ValueError)
    first = fault_store.first_failure()
    assert first["rank"] == 3
    assert first["kind"] == "error"
    assert first["error"] == "ValueError: boom"


def test_first_writer_wins_and_own_report_beats_blame(store):
    assert fault_store.first_failure() is None
    fault_store.report_failure(2, 1, "recv grads", 0, "RuntimeError: closed", reporter=1)
    fault_store.report_failure(5, None, "recv grads", 0, "RuntimeError: closed", reporter=4)
    assert fault_store.first_failure()["rank"] == 2  # a blame, the first one
    fault_store.report_failure(3, 1, "forward", 0, "ValueError: a", reporter=3)
    fault_store.report_failure(4, 2, "forward", 0, "ValueError: b", reporter=4)
    first = fault_store.first_failure()
    assert (first["rank"], first["kind"], first["error"]) == (3, "error", "ValueError: a")


def test_timeout_without_store_blames_the_peer(no_store):
    timed = RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    with (
        pytest.raises(RankFailure) as info,
        guard(
            "recv activations", rank=1, stage=0, microbatch=4, peer=2, peer_stage=1, timeout_s=10
        ),
    ):
        raise timed
    text = str(info.value)
    assert text.splitlines()[0] == (
        "rank 2 (stage 1) did not respond within 10 s while this rank waited in"
        " recv activations of microbatch 4"
    )
    assert "ANNOT_TIMEOUT_S=600" in text
    assert (info.value.rank, info.value.stage, info.value.microbatch) == (2, 1, 4)


def test_lost_peer_follows_the_waiting_chain(store):
    # rank 1 already found that rank 2 went away while it waited on it
    store.set(
        "annot/waiting/1",
        json.dumps(
            {
                "rank": 1,
                "stage": 1,
                "peer": 2,
                "peer_stage": 2,
                "op": "recv grads",
                "microbatch": 0,
                "error": "RuntimeError: closed",
                "kind": "lost",
                "reporter": 1,
                "timeout_s": 5.0,
            }
        ),
    )
    with (
        pytest.raises(RankFailure) as info,
        guard("recv grads", rank=0, stage=0, microbatch=0, peer=1, grace_s=0.1),
    ):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert info.value.rank == 2
    assert info.value.stage == 2
    assert str(info.value).startswith(
        "rank 2 (stage 2) exited or closed its connection while rank 1 waited in recv grads"
        " of microbatch 0; this rank (0) stopped in recv grads of microbatch 0"
    )
    assert fault_store.first_failure()["rank"] == 2  # the verdict is shared


def test_a_live_rank_replaces_a_blame_naming_it(store):
    fault_store.report_failure(1, 1, "recv grads", 0, "timeout", kind="timeout", reporter=0)
    with (
        pytest.raises(RankFailure) as info,
        guard("recv grads", rank=1, stage=1, microbatch=0, peer=2, grace_s=0.1),
    ):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    assert info.value.rank == 2
    assert fault_store.first_failure()["rank"] == 2


def test_waiting_cycle_is_a_deadlock(store):
    store.set(
        "annot/waiting/1",
        json.dumps(
            {
                "rank": 1,
                "stage": 1,
                "peer": 0,
                "peer_stage": 0,
                "op": "recv grads",
                "microbatch": 0,
                "error": "",
                "kind": "timeout",
                "reporter": 1,
                "timeout_s": 5.0,
            }
        ),
    )
    with (
        pytest.raises(RankFailure, match=r"ranks 0 -> 1 -> 0 all wait on the next one"),
        guard("recv activations", rank=0, stage=0, microbatch=0, peer=1, grace_s=0.1),
    ):
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")


def test_rank_failure_passes_through_and_non_comm_errors_are_local(store):
    inner = RankFailure("rank 7 failed", rank=7)
    with pytest.raises(RankFailure) as info, guard("recv x", rank=0, peer=1):
        raise inner
    assert info.value is inner
    with (
        pytest.raises(RankFailure, match=r"^rank 0 failed during recv x: KeyError: 'k'"),
        guard("recv x", rank=0, peer=1),
    ):
        raise KeyError("k")


def test_abort_without_process_group_returns():
    assert abort_process_group(wait_s=1.0) is True


# -- real gloo ranks: a 3-rank pipeline chain 0 -> 1 -> 2 -------------------


def _chain(mode: str, timeout_s: float):
    """Forward to the last stage, then wait for gradients back: rank 0 waits on
    rank 1, which waits on rank 2. Rank 2 fails in ``mode``."""
    from annot.runtime.pipeline.p2p import recv_pytree, send_pytree

    rank = dist.get_rank()
    kw = dict(microbatch=0, timeout_s=timeout_s)
    start = time.monotonic()
    try:
        if rank == 0:
            send_pytree(torch.ones(4), 1, what="activations", stage=0, peer_stage=1, **kw).wait()
            recv_pytree(1, what="grads", stage=0, peer_stage=1, **kw)
        elif rank == 1:
            x = recv_pytree(0, what="activations", stage=1, peer_stage=0, **kw)
            with guard("forward", stage=1, microbatch=0):
                y = x * 2
            send_pytree(y, 2, what="activations", stage=1, peer_stage=2, **kw).wait()
            recv_pytree(2, what="grads", stage=1, peer_stage=2, **kw)
        else:
            x = recv_pytree(1, what="activations", stage=2, peer_stage=1, **kw)
            if mode == "raise":
                with guard("forward", stage=2, microbatch=0):
                    raise ValueError("boom")
            elif mode == "hang":
                time.sleep(timeout_s + 60)
            elif mode == "exit":
                os._exit(7)
    except RankFailure as err:
        elapsed = time.monotonic() - start
        finished = abort_process_group(wait_s=1.0)
        took = time.monotonic() - start - elapsed
        raise AssertionError(
            f"RankFailure(rank={err.rank}, stage={err.stage}) after {elapsed:.1f} s"
            f" (abort finished={finished} in {took:.1f} s): {err}"
        ) from err
    return "finished"


def _run_chain(mode: str) -> tuple[dict, float]:
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_chain, 3, mode, TIMEOUT_S, timeout=TIMEOUT_S + 60, env=FAULT_ENV)
    return info.value.failures, time.monotonic() - start


def _seen(failures: dict, rank: int) -> tuple[str, str, float, str, str]:
    text = failures[rank]
    m = re.search(
        r"RankFailure\(rank=(\S+), stage=(\S+)\) after ([\d.]+) s"
        r" \(abort finished=(\w+) in ([\d.]+) s\): (.*)",
        text,
    )
    assert m, f"rank {rank} did not raise RankFailure:\n{text}"
    assert float(m.group(5)) < 5.0  # abort_process_group is bounded (wait_s=1), generous
    return m.group(1), m.group(2), float(m.group(3)), m.group(4), m.group(6)


def test_rank_that_raises_is_named_by_all():
    failures, wall = _run_chain("raise")
    for r in (0, 1):
        rank, stage, elapsed, finished, message = _seen(failures, r)
        assert (rank, stage) == ("2", "2"), failures[r]
        assert message.startswith(
            "rank 2 (stage 2) failed during forward of microbatch 0: ValueError: boom;"
            f" this rank ({r}) stopped in recv grads of microbatch 0"
        ), message
        assert elapsed < TIMEOUT_S + 5  # no-hang bound, generous
        assert finished == "True"
    assert "rank 2 (stage 2) failed during forward of microbatch 0: ValueError: boom" in failures[2]
    assert wall < TIMEOUT_S + 45


@pytest.mark.slow  # 10-17 s: keeps the README's test command under 10 minutes
def test_rank_that_hangs_is_named_by_all():
    failures, wall = _run_chain("hang")
    for r in (0, 1):
        rank, stage, elapsed, finished, message = _seen(failures, r)
        assert (rank, stage) == ("2", "2"), failures[r]
        assert "rank 2 (stage 2) did not respond within 5 s while " in message, message
        assert elapsed < TIMEOUT_S + 5  # no-hang bound, generous
        assert finished == "True"  # the timeout already closed the group
    assert wall < TIMEOUT_S + 45


def test_rank_that_dies_is_named_by_all():
    failures, wall = _run_chain("exit")
    assert "exited with code 7" in failures[2]
    for r in (0, 1):
        rank, stage, elapsed, finished, message = _seen(failures, r)
        assert (rank, stage) == ("2", "2"), failures[r]
        observer = "this rank" if r == 1 else "rank 1"
        assert message.startswith(
            f"rank 2 (stage 2) exited or closed its connection while {observer} waited in"
            " recv grads of microbatch 0"
        ), message
        assert finished == "True"
        assert elapsed < TIMEOUT_S + 5
    assert wall < TIMEOUT_S + 45


def _abort_with_collective_in_flight():
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(4)  # alive but never joins the all_reduce
        return None
    dist.all_reduce(torch.ones(2), async_op=True)
    start = time.monotonic()
    finished = abort_process_group(wait_s=1.0)
    return finished, time.monotonic() - start, dist.is_initialized()


def test_abort_is_bounded_with_a_collective_in_flight():
    # gloo's destroy_process_group blocks here until rank 1 exits
    (finished, took, initialized), _ = run_ranks(_abort_with_collective_in_flight, 2, timeout=60)
    assert finished is False
    assert took < 5.0  # bounded by wait_s=1, generous
    assert initialized is False
