"""Pipeline parallelism, side by side in one run; prints ratios (this machine is noisy).

    python benchmarks/pp.py          # a few minutes on 2 CPU cores

(a) step time, annot vs torch.distributed.pipelining (PipelineStage + ScheduleGPipe /
    Schedule1F1B) on the same model, split and microbatches, pp=2 (goal <= 0.9);
(b) pipeline efficiency with fixed-cost stages (sleeping forward 20 ms, backward 40 ms,
    so two shared CPU cores do not distort it) against the theory m / (m + p - 1)
    (goal >= 0.95 of theory), for both systems;
(c) per-microbatch runtime overhead: a tiny model, step time / microbatches.

Each system's steps are interleaved with the other's (annot, torch, annot, ...); the
median is reported.
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

REPEATS = int(os.environ.get("BENCH_STEPS", "10"))


def _rank(kind: str, schedule: str, microbatches: int, cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import annot
    from benchmarks.pp_models import MLPStack, SleepStack

    torch.set_num_threads(1)
    pp = dist.get_world_size()
    rank = dist.get_rank()
    if kind == "mlp":
        cls, kw, batch, width = MLPStack, {"width": 256, "depth": 8}, 32, 256
    elif kind == "tiny":
        cls, kw, batch, width = MLPStack, {"width": 8, "depth": 4}, microbatches, 8
    else:
        cls, kw, batch, width = SleepStack, {"depth": pp}, microbatches, 4
    depth = kw["depth"]
    cut = depth // pp
    split = [f"blocks.{cut * s}" for s in range(1, pp)]

    model = annot.parallelize(cls, mesh=annot.Mesh(pp=pp), seed=0, split=split, **kw)

    @annot.jit(model, microbatches=microbatches, schedule=schedule)
    def annot_step(x, y):
        _, loss = model(x, y)
        model.backward(loss)
        return loss

    # torch.distributed.pipelining: the same blocks, split by hand into stage modules.
    torch.manual_seed(0)
    full = cls(**kw)
    blocks = list(full.blocks[rank * cut : (rank + 1) * cut])
    if rank == pp - 1 and hasattr(full, "head"):
        blocks.append(full.head)
    submod = torch.nn.Sequential(*blocks)
    stage = PipelineStage(submod, rank, pp, torch.device("cpu"), group=dist.group.WORLD)
    sched_cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = sched_cls(
        stage,
        n_microbatches=microbatches,
        loss_fn=lambda out, tgt: torch.nn.functional.mse_loss(out, tgt),
    )

    def torch_step(x, y):
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    ta, tb = [], []
    for i in range(REPEATS + 2):
        for fn, acc in ((lambda: annot_step(x, y), ta), (lambda: torch_step(x, y), tb)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            if i >= 2:
                acc.append(time.perf_counter() - t)
            for p in list(model.parameters()) + list(submod.parameters()):
                p.grad = None
    return statistics.median(ta), statistics.median(tb)


def measure(kind, schedule, microbatches, pp=2):
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_rank, pp, kind, schedule, microbatches, cache, timeout=900)
    return res[0]


def main() -> None:
    rows = []
    for schedule in ("gpipe", "1f1b"):
        a, b = measure("mlp", schedule, 8)
        rows.append((f"(a) step, MLP stack pp=2 M=8 {schedule}", a, b, a / b, "<= 0.9"))
    m, p, f, bw = 8, 2, 0.020, 0.040
    theory = m / (m + p - 1)
    for schedule in ("gpipe", "1f1b"):
        a, b = measure("sleep", schedule, m, pp=p)
        ideal = m * (f + bw)  # one stage's busy time
        rows.append(
            (
                f"(b) efficiency/theory, sleep stages {schedule} (annot, torch)",
                (ideal / a) / theory,
                (ideal / b) / theory,
                (ideal / a) / (ideal / b),
                ">= 0.95",
            )
        )
    a, b = measure("tiny", "1f1b", 16)
    rows.append(("(c) per-microbatch time, tiny model 1f1b M=16", a / 16, b / 16, a / b, "lower"))
    print(f"{'measurement':58} {'annot':>10} {'torch':>10} {'ratio':>7}  goal")
    for name, x, y, r, goal in rows:
        fx = f"{x:10.3f}" if name.startswith("(b)") else f"{x * 1000:8.2f}ms"
        fy = f"{y:10.3f}" if name.startswith("(b)") else f"{y * 1000:8.2f}ms"
        print(f"{name:58} {fx} {fy} {r:7.3f}  {goal}")


if __name__ == "__main__":
    main()
