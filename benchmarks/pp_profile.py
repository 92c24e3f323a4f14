"""Where a pipeline step's time goes, annot beside torch.distributed.pipelining.

    python benchmarks/pp_profile.py              # the tiny model of pp.py (c), 1f1b
    python benchmarks/pp_profile.py mlp gpipe    # the MLP stack of pp.py (a)

Both run the same model, split and microbatches at pp=2 (steps interleaved,
annot, torch, annot, ...). Per rank it prints the mean time per microbatch
of each kind of work: compute (forward, backward), posting the messages
(annot's SEND; torch's batch_isend_irecv, which posts its sends and the
receives it fuses with them) and waiting for them (annot's RECV, which also
unpacks the message; torch's wait on the batch). annot's figures are its own
trace (``jit(..., trace=True)``); torch's come from timing its schedule's
methods (``forward_one_chunk``, ``backward_one_chunk``, ``_batch_p2p``,
``_wait_batch_p2p``, ``_maybe_compute_loss``), private names that may move in
another torch version. ``other`` is the step's median time per microbatch
less the rows: for annot, sending the step's outputs to every rank,
splitting the batch (and, with ``post_receives=True``, posting each receive
one action early, outside the traced actions); noise can make it negative.

Compute that takes the same time on both sides, with more time waiting on
annot's, says the difference is in the messages' latency, not in the work
each rank does.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = int(os.environ.get("BENCH_STEPS", "20"))
_KIND = re.compile(r"^\d+([A-Z_]+)\d+$")  # "0SEND_F3" -> "SEND_F"
# annot's actions and torch's timed methods, in the same rows
ROWS = [
    ("forward", ("F",), ("forward", "loss")),
    ("backward", ("B", "I", "W"), ("backward",)),
    ("post messages", ("SEND_F", "SEND_B"), ("post",)),
    ("wait for messages", ("RECV_F", "RECV_B"), ("wait",)),
]


def _timed(owner: object, name: str, key: str, acc: dict) -> None:
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(owner, name, timed)


def _rank(kind: str, schedule: str, cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as torch_schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from benchmarks.pp import pipelines
    from benchmarks.pp_models import MLPStack

    torch.set_num_threads(1)
    rank = dist.get_rank()
    if kind == "tiny":
        kw, microbatches, batch = {"width": 8, "depth": 4}, 16, 16
    else:
        kw, microbatches, batch = {"width": 256, "depth": 8}, 8, 32
    model, annot_step, submod, sched = pipelines(MLPStack, kw, schedule, microbatches, trace=True)
    theirs: dict[str, float] = defaultdict(float)
    _timed(_PipelineStageBase, "forward_one_chunk", "forward", theirs)
    _timed(_PipelineStageBase, "backward_one_chunk", "backward", theirs)
    _timed(torch_schedules, "_batch_p2p", "post", theirs)
    _timed(torch_schedules, "_wait_batch_p2p", "wait", theirs)
    _timed(torch_schedules.PipelineScheduleSingle, "_maybe_compute_loss", "loss", theirs)

    x, y = torch.randn(batch, kw["width"]), torch.randn(batch, kw["width"])
    ours: dict[str, float] = defaultdict(float)
    steps = {"annot": [], "torch": []}
    for i in range(STEPS + 3):
        if i == 3:  # warm: count from here
            theirs.clear()
        for name in ("annot", "torch"):
            dist.barrier()
            t = time.perf_counter()
            if name == "annot":
                annot_step(x, y)
            elif rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            if i >= 3:
                steps[name].append(time.perf_counter() - t)
            for p in list(model.parameters()) + list(submod.parameters()):
                p.grad = None
        if i >= 3:
            for event in annot_step.trace_events():
                match = _KIND.match(event["name"])
                if match and event.get("ph") == "X":
                    ours[match.group(1)] += event["dur"] / 1e6
    n = STEPS * microbatches
    return (
        {k: v / n for k, v in ours.items()},
        {k: v / n for k, v in theirs.items()},
        statistics.median(steps["annot"]) / microbatches,
        statistics.median(steps["torch"]) / microbatches,
    )


def main() -> None:
    from annot.testing import run_ranks

    kind = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    schedule = sys.argv[2] if len(sys.argv) > 2 else "1f1b"
    with tempfile.TemporaryDirectory() as cache:
        results = run_ranks(_rank, 2, kind, schedule, cache, timeout=900)
    print(f"{kind} model, pp=2, {schedule}: microseconds per microbatch")
    print(f"{'':20}" + "".join(f"{f'rank {r} annot':>14}{'torch':>9}" for r in range(2)))
    for label, ours_keys, theirs_keys in ROWS:
        cells = ""
        for ours, theirs, _, _ in results:
            a = sum(ours.get(k, 0.0) for k in ours_keys) * 1e6
            b = sum(theirs.get(k, 0.0) for k in theirs_keys) * 1e6
            cells += f"{a:14.0f}{b:9.0f}"
        print(f"{label:20}{cells}")
    cells = ""
    for ours, theirs, step_a, step_b in results:  # what no row timed (between the actions)
        a = step_a - sum(ours.get(k, 0.0) for _, keys, _ in ROWS for k in keys)
        b = step_b - sum(theirs.get(k, 0.0) for _, _, keys in ROWS for k in keys)
        cells += f"{a * 1e6:14.0f}{b * 1e6:9.0f}"
    print(f"{'other':20}{cells}")
    cells = "".join(f"{a * 1e6:14.0f}{b * 1e6:9.0f}" for _, _, a, b in results)
    print(f"{'step / microbatches':20}{cells}")


if __name__ == "__main__":
    main()
