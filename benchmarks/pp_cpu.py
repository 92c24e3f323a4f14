"""Where a pipeline step's CPU goes, annot beside torch.distributed.pipelining:
each rank's CPU per step, main thread and the rest, steps interleaved
(annot, torch, ...).

    python benchmarks/pp_cpu.py                     # pp.py (a)'s MLP stack, pp=2, 1F1B
    python benchmarks/pp_cpu.py tiny                # pp.py (c)'s tiny model
    BENCH_PP=4 python benchmarks/pp_cpu.py llama    # pp_llama.py's HF Llama, uniform split
    BENCH_RUNNER=replay BENCH_PP=4 python benchmarks/pp_cpu.py llama   # (default: source)

Wall time on this 2-core machine moves with whatever else runs; CPU time
moves much less, so costs of a few percent show. And with more ranks than
cores (pp=4 here) the step follows the ranks' total CPU, not the slowest
stage. Per rank it prints the CPU of a step of each system: the main
thread's (``time.thread_time``, median: the Python, the ops, posting and
unpacking messages) and the other threads' (the scheduler's count in
``/proc/self/task/*/schedstat``, mean over the steps: gloo's loop thread,
which moves the bytes), then the sums over ranks and rank 0's wall time.
``benchmarks/pp_profile.py`` splits the wall time of one rank's step by kind
of work instead.

Results (2026-11-27; ms a step, all ranks; annot / torch):

    model                  pp  main thread          other threads   wall (rank 0)
    mlp (BENCH_STEPS=30)    2  62.9 / 57.0 = 1.10   9.6 / 4.9       1.17
    tiny (BENCH_STEPS=30)   2  14.6 / 11.2 = 1.31   9.0 / 3.2       1.50
    llama, source           4  245.2 / 227.8 = 1.08 22.4 / 25.0     1.06
    llama, replay (STEPS=8) 4  300.2 / 240.1 = 1.25 28.1 / 26.6     1.17

(The two llama rows' other threads, and the first two rows before
2026-11-27, were counted in 10 ms clock ticks minus the main thread's exact
time, which credited the other threads with the main thread's rounding.)

Read: on HF Llama at pp=4 the step follows the CPU (the replay's 25% more is
its re-run of earlier stages' Python on meta; the source runner's 8% is the
messages' and the step body's Python). On the MLP stack and the tiny model
at pp=2, gloo's loop threads spend 2-3x torch's CPU on annot's steps, though
a step makes the same system calls (``strace -c`` on the tiny model, per
step: epoll_wait 82 vs 89, writev 111 vs 108, recvfrom 196 vs 198) and
``perf`` finds the kernel's epoll path in both: not found why. The latency
side is ``benchmarks/p2p_rendezvous.py``: a send posted before its receive
waits for the sender's loop thread, which a busy core delays by ms. The tiny
model shows the fixed cost: 110-280 us more main-thread CPU a microbatch on
each rank (runs of 2026-11-27), of which the messages' Python is under half
(``pp_profile.py``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = int(os.environ.get("BENCH_STEPS", "10"))
RUNNER = os.environ.get("BENCH_RUNNER", "source")  # llama: "source", "replay" or "auto"


def _thread_cpu() -> dict[str, float]:
    """Seconds of CPU of each thread of this process but the main one so far,
    by thread name (threads of one name summed): the scheduler's own count
    (``/proc/.../schedstat``, nanoseconds), else its clock ticks (10 ms, each
    charged to whichever thread runs at the tick)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main:  # measured by time.thread_time
            continue
        task = f"/proc/self/task/{tid}"
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            if os.path.exists(f"{task}/schedstat"):
                with open(f"{task}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            else:
                with open(f"{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def _systems(kind: str):
    """This rank's two step functions (annot's, torch's) and the zero-grad
    callable between steps."""
    import torch
    import torch.distributed as dist

    pp = dist.get_world_size()
    if kind == "llama":
        import torch.nn.functional as F
        from transformers import LlamaForCausalLM

        import annot
        from annot.hf import stages_from_hf_config
        from benchmarks.pp_llama import BATCH, MICRO, SEQ, _config, torch_pipeline

        cfg = _config()
        with torch.device("meta"):
            uniform = stages_from_hf_config(LlamaForCausalLM(cfg), pp)
        model = annot.parallelize(
            LlamaForCausalLM, cfg, mesh=annot.Mesh(pp=pp), seed=0, split=uniform, runner=RUNNER
        )

        @annot.jit(model, microbatches=MICRO, schedule="1f1b")
        def annot_step(ids):
            logits = model(ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            model.backward(loss)
            return loss

        their_step, stage = torch_pipeline(cfg, uniform)
        ids = torch.randint(
            0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
        )
        params = list(model.parameters()) + list(stage.submod.parameters())
        return (lambda: annot_step(ids)), (lambda: their_step(ids)), params

    from benchmarks.pp import pipelines, torch_step
    from benchmarks.pp_models import MLPStack

    if kind == "tiny":
        kw, microbatches, batch = {"width": 8, "depth": 4}, 16, 16
    else:
        kw, microbatches, batch = {"width": 256, "depth": 8}, 8, 32
    model, annot_step, submod, sched = pipelines(MLPStack, kw, "1f1b", microbatches)
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(batch, kw["width"], generator=g),
        torch.randn(batch, kw["width"], generator=g),
    )

    return (
        (lambda: annot_step(x, y)),
        (lambda: torch_step(sched, x, y)),
        list(model.parameters()) + list(submod.parameters()),
    )


def _rank(kind: str, cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    annot_step, torch_step, params = _systems(kind)
    steps = {"annot": annot_step, "torch": torch_step}
    main = {n: [] for n in steps}
    wall = {n: [] for n in steps}
    other = dict.fromkeys(steps, 0.0)  # summed: /proc counts in clock ticks (10 ms)
    for i in range(STEPS + 2):
        order = list(steps) if i % 2 else list(steps)[::-1]
        for name in order:
            dist.barrier()
            threads, cpu, t = _thread_cpu(), time.thread_time(), time.perf_counter()
            steps[name]()
            cpu = time.thread_time() - cpu
            after = _thread_cpu()
            dist.barrier()
            if i >= 2:  # warm
                wall[name].append(time.perf_counter() - t)
                main[name].append(cpu)
                # (a thread that ended between the readings takes its CPU with it)
                other[name] += sum(max(0.0, v - threads.get(k, 0.0)) for k, v in after.items())
            for p in params:
                p.grad = None
    return {
        n: (
            statistics.median(main[n]) * 1e3,
            other[n] / STEPS * 1e3,
            statistics.median(wall[n]) * 1e3,
        )
        for n in steps
    }


def main() -> None:
    from annot.testing import run_ranks

    kind = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    pp = int(os.environ.get("BENCH_PP", "2"))
    with tempfile.TemporaryDirectory() as cache:
        results = run_ranks(_rank, pp, kind, cache, timeout=1800)
    label = f"{kind}" + (f" (runner={RUNNER})" if kind == "llama" else "")
    print(f"{label}, pp={pp}, 1F1B: ms of CPU a step (main thread / other threads)")
    print(f"{'rank':>6}{'annot':>18}{'torch':>18}{'main annot/torch':>18}")
    for r, res in enumerate(results):
        a, b = res["annot"], res["torch"]
        print(f"{r:>6}{a[0]:>10.1f} /{a[1]:>6.1f}{b[0]:>10.1f} /{b[1]:>6.1f}{a[0] / b[0]:>18.2f}")
    total = {n: [sum(res[n][k] for res in results) for k in range(2)] for n in ("annot", "torch")}
    a, b = total["annot"], total["torch"]
    print(f"{'all':>6}{a[0]:>10.1f} /{a[1]:>6.1f}{b[0]:>10.1f} /{b[1]:>6.1f}{a[0] / b[0]:>18.2f}")
    wa, wb = results[0]["annot"][2], results[0]["torch"][2]
    print(f"wall ms a step (rank 0): annot {wa:.1f}, torch {wb:.1f}, ratio {wa / wb:.2f}")


if __name__ == "__main__":
    main()
