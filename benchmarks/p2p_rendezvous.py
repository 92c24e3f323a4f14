"""How long a gloo message takes when its sender is busy, by which side
posted first: the mechanism under a pipeline's message latency on a machine
with few cores.

    python benchmarks/p2p_rendezvous.py     # four cases, 40 messages each, seconds

gloo moves a message only into a posted receive. A send that finds its
receive posted writes the bytes at once, from the caller's thread; a send
posted first only announces itself, and its bytes leave when the receiver's
"ready" notice reaches the sender's network thread (``gloo_tcp_loop``).
Rank 1 sends 8 KiB to rank 0 and then computes for 6 ms (torch matmuls,
Python, or a sleep: no compute); rank 0 posts the receive 1 ms after the
send (``send first``) or 1 ms before it (``recv first``) and waits. Printed:
the median time rank 0 waits past the later of the two posts.

Results (2026-11-27, this 2-core machine; ms, the range over two or three
runs):

    send first, torch     0.84 - 3.26
    send first, python    0.55 - 2.60
    send first, sleep     0.05 - 0.08
    recv first, torch     0.12 - 0.13
    recv first, python    0.12 - 0.18

Read: with both cores busy, the sender's network thread waits for a core
while its main thread computes, and the message waits with it (ms, against
tens of us). A pipeline rank that sends and then computes is that sender;
torch.distributed.pipelining waits each send with the next receive (its
batches), annot waits sends at the end of the step. Waiting annot's sends at
the next receive (as torch's batches do) and posting the receive right after
the send both measured no gain on ``pp.py`` (a) (2026-11-27, alternated steps,
within this machine's noise; the second worse in three runs of three).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = (
    "send first, torch",
    "send first, python",
    "send first, sleep",
    "recv first, torch",
    "recv first, python",
)


def _rank(case: str) -> float:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    a, b = torch.randn(256, 1024), torch.randn(1024, 256)
    buf = torch.zeros(8192, dtype=torch.uint8)
    send_first = case.startswith("send first")

    def compute(seconds: float) -> None:
        if case.endswith("sleep"):  # no compute: the network thread has a core
            time.sleep(seconds)
            return
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            if case.endswith("python"):
                sum(range(1000))
            else:
                torch.mm(a, b)

    waits = []
    for _ in range(40):
        dist.barrier()
        if rank == 1:
            if not send_first:
                time.sleep(0.001)
            work = dist.isend(buf, 0)
            compute(0.006)
            work.wait()
        else:
            if send_first:
                time.sleep(0.001)
            start = time.perf_counter()
            dist.irecv(buf, 1).wait()
            waits.append(time.perf_counter() - start - (0.0 if send_first else 0.001))
    return statistics.median(waits) * 1e3 if waits else 0.0


def main() -> None:
    from annot.testing import run_ranks

    for case in CASES:
        ms = run_ranks(_rank, 2, case, timeout=300)[0]
        print(f"{case:<22} rank 0 waits {ms:6.2f} ms past the later post")


if __name__ == "__main__":
    main()
