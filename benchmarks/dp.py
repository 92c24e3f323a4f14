"""Data parallelism, side by side in one run; prints ratios (this machine is noisy).

    python benchmarks/dp.py            # about a minute on 2 CPU cores

The dp=2 gradient average of a small GPT (benchmarks/bench_models.py, 3.4 M
parameters, 13 MiB of float32 gradients), two ways on the same 2 ranks:
one flat all-reduce after the backward (``overlap_grad_reduce=False``) and
buckets all-reduced while the backward runs (annot's default,
:mod:`annot.runtime.grads.buckets`):

(a) ``model.backward(loss)`` step, 25 MiB buckets (DDP's default: here a 1.5 MiB
    first bucket, then the rest in one), overlapped / flat
(b) the same with 2 MiB buckets (7 buckets)
(c) an ``@annot.jit`` step of 4 microbatches (only the last one's backward
    overlaps), 2 MiB buckets, overlapped / flat
(d) what the overlapped path adds: copying every averaged gradient back from the
    buckets into ``.grad``, per step, against the flat path's step
(e) the reduction left after the backward (``finish_gradients``), 2 MiB buckets,
    overlapped / flat: what the overlap hid
(f) ``model.backward(loss)`` step with FSDP2 (``fsdp=True``: parameters,
    gradients and AdamW state sharded over dp, all-gathered per block in
    forward and backward, gradients reduce-scattered) / replicated (25 MiB
    buckets); and the bytes each rank holds (parameters, gradients at their
    parameter's size, AdamW state), FSDP2 / replicated

Each timing is the median of interleaved repeats (flat, overlapped, flat, ...),
the slower rank's. A step is forward, backward, reduction, AdamW.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.timing import time_pair  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "20"))
BATCH, SEQ = 8, 64


def _rank(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from benchmarks.bench_models import BenchConfig, BenchGPT

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    cfg = BenchConfig()
    mesh = annot.Mesh(dp=2)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x = torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=g)

    def build(**options):
        model = annot.parallelize(BenchGPT, cfg, mesh=mesh, seed=0, **options)
        return model, torch.optim.AdamW(model.parameters())

    def plain_step(model, opt):
        def step():
            model.backward(model(x, y))
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def jit_step(model, opt):
        @annot.jit(model, microbatches=4)
        def train(a, b):
            loss = model(a, b)
            model.backward(loss)
            return loss

        def step():
            train(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    flat = build(overlap_grad_reduce=False)
    big = build()
    small = build(bucket_cap_mb=2.0)
    out = {}
    out["a"] = time_pair(plain_step(*flat), plain_step(*big))
    out["b"] = time_pair(plain_step(*flat), plain_step(*small))
    out["c"] = time_pair(jit_step(*flat), jit_step(*small))
    out["buckets"] = [len(m.grad_buckets.buckets) for m, _ in (big, small)]
    out["early"] = [m.grad_buckets.last_step.before_finish for m, _ in (big, small)]
    # (d) the copy back, alone: every gradient from a flat buffer into .grad
    model, _ = small
    model.backward(model(x, y))
    params = [p for p in model.parameters() if p.requires_grad]
    flat_buf = torch.cat([p.grad.reshape(-1) for p in params])
    copies = []
    for _ in range(STEPS):
        t = time.perf_counter()
        offset = 0
        for p in params:
            p.grad.copy_(flat_buf[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        copies.append(time.perf_counter() - t)
    out["d"] = (statistics.median(copies), out["b"][0])
    # (e) backward and finish_gradients timed apart (ParallelModel.backward's steps)
    finish: dict = {"flat": [], "small": []}
    for _ in range(STEPS):
        for name, (m, opt) in (("flat", flat), ("small", small)):
            m.begin_grad_reduce()
            m.arm_grad_reduce()
            m(x, y).backward()
            t = time.perf_counter()
            m.finish_gradients()
            finish[name].append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
    out["e"] = tuple(statistics.median(finish[k]) for k in ("flat", "small"))
    # (f) FSDP2 against the replicated model, and what each rank holds
    sharded = build(fsdp=True)
    out["f"] = time_pair(plain_step(*big), plain_step(*sharded))

    def held(model, opt) -> int:
        params = sum(
            p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            for p in model.parameters()
        )
        return 2 * 4 * params + annot.state_bytes(opt)

    out["bytes"] = [held(*big), held(*sharded)]
    return out


def main() -> None:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_rank, 2, cache, timeout=900)
    pick = {k: (max(r[k][0] for r in res), max(r[k][1] for r in res)) for k in "abcdef"}
    big, small = res[0]["buckets"]
    early = res[0]["early"]
    rows = [
        (f"(a) backward, 25 MiB buckets ({big}): overlapped / flat", "a"),
        (f"(b) backward, 2 MiB buckets ({small}): overlapped / flat", "b"),
        ("(c) jit, 4 microbatches, 2 MiB buckets: overlapped / flat", "c"),
        ("(d) copy back into .grad / flat step", "d"),
        ("(e) reduction left after the backward: overlapped / flat", "e"),
        ("(f) backward step, FSDP2 / replicated (25 MiB buckets)", "f"),
    ]
    print(f"buckets launched during the backward: {early[0]} of {big}, {early[1]} of {small}")
    print(f"{'measurement':58} {'flat':>10} {'overlap':>10} {'ratio':>7}")
    for name, k in rows:
        fl, ov = pick[k]
        if k == "d":
            fl, ov = ov, fl
        print(f"{name:58} {fl * 1000:9.2f}ms {ov * 1000:9.2f}ms {ov / fl:7.3f}")
    rep, shd = (max(r["bytes"][i] for r in res) for i in (0, 1))
    print(
        f"bytes held per rank (parameters, gradients, AdamW state): replicated "
        f"{rep / 2**20:.1f} MiB, FSDP2 {shd / 2**20:.1f} MiB, ratio {shd / rep:.3f} (dp=2)"
    )


if __name__ == "__main__":
    main()
