"""Run a function on N real torch.distributed ranks (gloo) on this machine.

The one multi-rank harness for annot's tests and benchmarks, on public API
only: a rendezvous store in the parent on a port the OS picks (a rank that
finishes first cannot take it down), one fresh process per rank with
torchrun's environment variables, a per-rank log prefix, every rank killed on the first
failure with every rank's traceback collected, a hard deadline, and the
process group destroyed in ``finally``.

Each rank is a new process forked from a server that imported torch (and
transformers, where installed) once (multiprocessing's ``forkserver``, its
``preload``), not a new interpreter importing them again: most of a
multi-rank test's time was that start-up. The rank gets the caller's
environment, working directory, ``sys.path`` and standard output and error
as they are at the call (not as they were when the server started).
``ANNOT_RANKS_START=spawn`` starts fresh interpreters instead.

    def check(scale):                       # module level: it is pickled
        import torch.distributed as dist
        return dist.get_rank() * scale

    assert run_ranks(check, 2, 10) == [0, 10]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from annot.core.errors import AnnotError

__all__ = ["run_ranks", "RanksFailed", "free_port"]


class RanksFailed(AnnotError):
    """One or more ranks raised, died or ran past the deadline."""

    def __init__(self, message: str, failures: dict[int, str]):
        self.failures = failures
        super().__init__(message)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Prefixed:
    def __init__(self, stream, prefix: str):
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _CallerFd:
    """The caller's file descriptor ``fd`` (its stdout or stderr now, which
    pytest may have redirected), handed to the rank as it starts."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


# what the rank server imports once, each rank then starts with them loaded
PRELOAD = [
    "annot.testing",
    "torch",
    "torch.distributed",
    "annot.build.parallelize",
    "annot.training.jit",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]


def _context():
    if os.environ.get("ANNOT_RANKS_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (once)
    return ctx


def _child(rank, world_size, port, fn, args, kwargs, queue, env, pg_timeout, caller):
    environ, cwd, path, out_fd, err_fd = caller
    os.environ.clear()  # the caller's, not the rank server's
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
    )
    os.environ.update(env)
    sys.stdout = _Prefixed(sys.stdout, f"[rank{rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank{rank}] ")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        # The parent hosts the store (see run_ranks): a rank that finishes or
        # dies first takes nothing down that the others still use.
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=pg_timeout)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(*args, **kwargs)
        # Pickled here, so tensors travel by value (not as shared memory that dies
        # with this process).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer may be gone already
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    pg_timeout: float = 60.0,
    failure_grace: float = 2.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each
    rank's result (rank order). ``fn`` and its arguments must be picklable
    (a module-level function).

    On the first rank that raises or exits non-zero, every other rank is killed
    and :class:`RanksFailed` is raised with every traceback collected (after
    ``failure_grace`` seconds in which the others may report their own view of
    the failure). Ranks still running after ``timeout`` seconds are killed the
    same way.
    """
    from torch.distributed import TCPStore

    ctx = _context()
    queue = ctx.Queue()
    # The rendezvous store lives here, in the parent, on a port the OS picks:
    # with the store on rank 0 (torch's env:// default), rank 0 returning or
    # refusing first broke the pipe of a rank still making its process groups.
    store = TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=pg_timeout),
    )
    port = store.port
    caller = (dict(os.environ), os.getcwd(), list(sys.path), _CallerFd(1), _CallerFd(2))
    procs = [
        ctx.Process(
            target=_child,
            args=(
                r,
                world_size,
                port,
                fn,
                args,
                kwargs,
                queue,
                dict(env or {}),
                pg_timeout,
                caller,
            ),
            name=f"annot-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            _drain(queue, results, failures)
            _reap(procs, queue, results, failures)
            if failures:
                break
            if time.monotonic() > deadline:
                for r in range(world_size):
                    if r not in results and r not in failures:
                        failures[r] = f"rank {r} did not finish within {timeout:.0f} s"
                break
            time.sleep(0.05)
        if failures:
            # Give the others a moment to report their own view (a RankFailure
            # naming the failed rank is useful), then kill them all.
            grace = time.monotonic() + failure_grace
            while time.monotonic() < grace and len(results) + len(failures) < world_size:
                _drain(queue, results, failures)
                _reap(procs, queue, results, failures)
                time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        queue.close()
        del store  # the ranks are gone: nothing uses it any more
    if failures:
        first = min(failures)
        report = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RanksFailed(
            f"{len(failures)} of {world_size} ranks failed (first: rank {first}):\n{report}",
            failures,
        )
    return [results[r] for r in range(world_size)]


def _reap(procs, queue, results, failures) -> None:
    """Record ranks that exited without reporting (killed, os._exit, segfault)."""
    for r, p in enumerate(procs):
        if r in results or r in failures or p.is_alive():
            continue
        time.sleep(0.2)  # its last message may still be in the pipe
        _drain(queue, results, failures)
        if r not in results and r not in failures:
            failures[r] = f"rank {r} exited with code {p.exitcode} without a result"


def _drain(queue, results, failures) -> None:
    while True:
        try:
            rank, status, payload = queue.get_nowait()
        except (queue_mod.Empty, EOFError, OSError):
            return
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
