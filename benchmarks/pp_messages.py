"""One pipeline message's cost: annot's ``send_pytree`` / ``recv_pytree`` vs
plain ``isend`` / ``irecv`` of preallocated buffers, two gloo ranks ping-ponging
a (4, 256) float32 activation (4 KiB), rounds interleaved, median per round
trip (two messages).

    python benchmarks/pp_messages.py     # N=1000 rounds each, under a minute

Rows: ``annot`` (steady shapes: after the first message, a repeated header),
``plain`` (isend of the tensor, irecv into a preallocated one), ``plain 8k``
(8 KiB buffers, annot's first-message size here), ``fresh`` (plain with a new
tensor each message), ``timeout`` (plain, waits with a timeout as annot's do).
Then, the CPU of one message's calls with the caches left cold between them
by a matmul (a pipeline's compute does that): annot's steady message against
a plain isend/irecv, the sender's and the receiver's CPU summed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N = int(os.environ.get("N", "1000"))


def _rank() -> dict:
    import torch
    import torch.distributed as dist

    from annot.runtime.pipeline.p2p import recv_pytree, send_pytree

    torch.set_num_threads(1)
    r = dist.get_rank()
    peer = 1 - r
    x = torch.randn(4, 256, requires_grad=True)
    buf = torch.empty(4, 256)
    big_out, big_in = torch.zeros(8192, dtype=torch.uint8), torch.empty(8192, dtype=torch.uint8)
    limit = timedelta(seconds=300)

    def annot() -> None:
        if r == 0:
            send_pytree(x, peer, what="activations", stage=0, microbatch=1, tag=(0, 1, 1)).wait()
            recv_pytree(peer, what="gradients", stage=0, microbatch=1, tagged=True)
        else:
            recv_pytree(peer, what="activations", stage=1, microbatch=1, tagged=True)
            send_pytree(x, peer, what="gradients", stage=1, microbatch=1, tag=(1, 0, 1)).wait()

    def pair(out, into, **wait):
        def run() -> None:
            a, b = out(), into()
            if r == 0:
                dist.isend(a, peer).wait(**wait)
                dist.irecv(b, peer).wait(**wait)
            else:
                dist.irecv(b, peer).wait(**wait)
                dist.isend(a, peer).wait(**wait)

        return run

    rows = {
        "annot": annot,
        "plain": pair(x.detach, lambda: buf),
        "plain 8k": pair(lambda: big_out, lambda: big_in),
        "fresh": pair(lambda: x.detach().clone(), lambda: torch.empty(4, 256)),
        "timeout": pair(x.detach, lambda: buf, timeout=limit),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(50):
        for fn in rows.values():
            fn()
    dist.barrier()
    for _ in range(N):
        for name, fn in rows.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    out = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out.update(_cold(r, peer, x))
    return out


def _cold(r: int, peer: int, x) -> dict:
    """CPU (``time.thread_time``) of one message's calls, sender and
    receiver side summed, with a matmul between calls that leaves the caches
    cold, as a pipeline's forward and backward do: annot's steady message
    against a plain ``isend`` of the tensor and ``irecv`` into a new one."""
    import torch
    import torch.distributed as dist

    from annot.runtime.pipeline.p2p import recv_pytree, send_pytree

    w, a = torch.randn(1024, 1024), torch.randn(64, 1024)
    cpu: dict[str, list[float]] = {"annot cold": [], "plain cold": []}
    handles = []
    for i in range(N // 4 + 10):
        for name in cpu:
            (a @ w).sum()  # the caches go cold
            t = time.thread_time()
            if r == 0 and name == "annot cold":
                handles.append(send_pytree({"x": x}, peer, tag=(0, 1, i)))
            elif r == 0:
                handles.append(dist.isend(x.detach(), peer))
            elif name == "annot cold":
                recv_pytree(peer, tagged=True)
            else:
                b = torch.empty(4, 256)
                dist.irecv(b, peer).wait()
                b.requires_grad_()
            if i >= 10:
                cpu[name].append(time.thread_time() - t)
        if len(handles) > 8:
            for h in handles:
                h.wait()
            handles = []
    for h in handles:
        h.wait()
    return {k: statistics.mean(v) * 1e6 for k, v in cpu.items()}


def main() -> None:
    from annot.testing import run_ranks

    sender, receiver = run_ranks(_rank, 2, timeout=600)
    print("us per round trip (two messages), median of", N)
    for name, us in sender.items():
        if "cold" not in name:
            print(f"{name:10} {us:8.0f} {us / sender['plain']:6.2f}x plain")
    print("CPU us of one message's calls (send + receive), caches cold, mean of", N // 4)
    cold = {k: sender[k] + receiver[k] for k in ("annot cold", "plain cold")}
    for name, us in cold.items():
        print(f"{name:10} {us:8.0f} {us / cold['plain cold']:6.2f}x plain")


if __name__ == "__main__":
    main()
