"""Automatic partitioning vs the usual rules, on a model with uneven layers.

    python benchmarks/partition.py        # 1-2 minutes on 2 CPU cores (4 when loaded)

The model is GPT-like with what breaks simple rules: a large embedding (cheap
to run, heavy in parameters), a large LM head (heavy in both), and blocks of
mixed MLP widths (some 4x wider than the others). Three ways to place the
stage boundaries:

* **annot**: :func:`annot.plan.planner.plan` (``units=SourceSegments(...)``) with ``cost="time"`` on one
  microbatch (per-segment forward + backward times, exact min-bottleneck);
* **uniform**: the same number of blocks per stage, the embedding with the
  first, the head with the last (torchtitan / torch.distributed.pipelining's
  default);
* **deepspeed**: DeepSpeed's ``partition_method="parameters"``: the
  parameter count of each layer (embedding, each block, final norm, head),
  balanced by ``deepspeed.runtime.utils.partition_balanced``, reimplemented
  below as DeepSpeed does it today (a DP over (layer, stage) that minimises
  the largest minus the smallest stage sum; ties go to the later cut).

Part 1 runs each stage of each split whole on one sample microbatch
(:func:`annot.plan.planner.measure_split`: forward + backward, one torch thread;
each stage's fastest of 8 interleaved rounds) and prints max/mean of the
stage times, next to max/mean of the stages' counted FLOPs (noise-free).
Part 2 times the partitioner on 10 000 segments into 64 stages. Part 3 runs
real pipeline steps (``annot.parallelize(..., split=...)`` +
``@annot.jit(model, microbatches=8)``, 1F1B, gloo) for annot's split and the
uniform one in the same run, interleaved, and prints the median and the
fastest step and their ratios. Rank processes use one torch thread each.

Results (one run, 1 min 9 s; 2-core CPU shared with other engineers' jobs,
load average 4.5; sample microbatch 2 x 32 tokens):

    part 1: max/mean stage cost (time: measured; FLOPs: counted)
      pp  rule        time FLOPs  boundaries
       2  annot       1.03  1.12  blocks.14                      (ms: 13.9 14.7)
       2  uniform     1.19  1.29  blocks.12                      (ms: 11.4 16.9)
       2  deepspeed   1.03  1.12  blocks.14                      (ms: 13.9 14.7)
       4  annot       1.14  1.18  blocks.7, blocks.14, blocks.20 (ms: 6.1 6.6 6.3 7.6)
       4  uniform     1.53  1.53  blocks.6, blocks.12, blocks.18 (ms: 5.3 5.2 6.5 10.6)
       4  deepspeed   1.22  1.15  blocks.5, blocks.14, blocks.21 (ms: 4.5 8.4 7.5 7.1)
      planning (profile 27 segments x 7 rounds + partition): 3.9 s (pp=2), 1.7 s (pp=4)

    part 2: partitioner, 10 000 segments into 64 stages: 9.0 ms (median of 5)

    part 3: step time, 8 microbatches of 8 x 32 tokens (median, fastest of 7)
      pp  annot s        uniform s      auto/uniform
       2  0.480  0.370   0.481  0.419   1.00  0.88
       4  0.492  0.444   0.496  0.438   0.99  1.01

Reading it. The goal (annot <= 1.10) is met at pp=2 and missed at pp=4
(1.14): the planner's segment profile predicted 1.04, but the last stage,
holding the 1 MiB LM head and the cross-entropy, runs ~15% slower as a whole
stage than the sum of its segments on this CPU (probably the cache: each
segment is timed on its own, with its weights warm); a measure-and-replan loop (measure_split, rescale, plan
again) would close that and is not done. Uniform splits pay for the head
(the last stage is 1.5x the mean at pp=4); DeepSpeed's parameter rule
charges the embedding as if it computed, leaving stage 0 light. Timings on
this machine vary by 10-20% from run to run; FLOPs do not. Part 3 shows no
step-time gain on 2 shared cores: with two to four ranks and other jobs on
two cores, a rank that waits for its neighbour hands its core to someone
else, so the step time follows the total work, not the slowest stage; the
ratio needs a core (or a GPU) per stage to show the imbalance.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = []

MICROBATCHES = 8
ROUNDS = 8  # stage-time rounds per split (part 1), interleaved across the splits
PLAN_BATCH = 2  # sequences (of block_size tokens) in the planner's sample microbatch (part 1)
MB_BATCH = 8  # sequences per microbatch in the pipeline steps (part 3)
STEP_ROUNDS = 7  # timed pipeline steps per split (part 3), after 2 warm-up steps


# ---- the model ------------------------------------------------------------------------


@dataclass
class UnevenConfig:
    vocab: int = 4096
    n_embd: int = 64
    n_head: int = 4
    block_size: int = 32
    # MLP hidden width of each block, in multiples of n_embd: 16 is 4x the usual 4
    widths: tuple = field(
        default=(4, 4, 4, 4, 16, 4, 4, 4, 4, 16, 4, 4, 16, 4, 16, 4, 4, 16, 16, 4, 4, 16, 4, 16)
    )


class Block(nn.Module):
    def __init__(self, cfg: UnevenConfig, width: int):
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, width * d)
        self.down = nn.Linear(width * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class UnevenGPT(nn.Module):
    def __init__(self, cfg: UnevenConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg, w) for w in cfg.widths])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.head(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def layers(model: UnevenGPT) -> list[tuple[str, list[nn.Module]]]:
    """The layers as a DeepSpeed PipelineModule would list them, each named by
    the annot boundary that begins it."""
    out = [("wte", [model.wte, model.wpe])]
    out += [(f"blocks.{i}", [b]) for i, b in enumerate(model.blocks)]
    return out + [("ln_f", [model.ln_f]), ("head", [model.head])]


# ---- the three rules --------------------------------------------------------------------


def uniform_split(model: UnevenGPT, n_stages: int) -> list[str]:
    """Equal numbers of blocks per stage (the first ones get one more when it
    does not divide); the embedding goes with the first, the head with the last."""
    n = len(model.blocks)
    per, extra = divmod(n, n_stages)
    starts, at = [], 0
    for s in range(n_stages - 1):
        at += per + (1 if s < extra else 0)
        starts.append(at)
    return [f"blocks.{b}" for b in starts]


def deepspeed_parameters_split(model: UnevenGPT, n_stages: int) -> list[str]:
    """``partition_method="parameters"``: trainable parameter counts per layer,
    split by DeepSpeed's ``partition_balanced`` (its current dynamic program:
    minimise the largest minus the smallest stage sum; on ties the later cut)."""
    named = layers(model)
    weights = [
        sum(p.numel() for m in mods for p in m.parameters() if p.requires_grad) for _, mods in named
    ]
    n, m = len(weights), n_stages
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    hi = np.full((n + 1, m + 1), np.inf)  # largest stage sum of the best split of [0, i) into j
    lo = np.full((n + 1, m + 1), np.inf)  # its smallest stage sum
    gap = np.full((n + 1, m + 1), np.inf)  # hi - lo, minimised
    cut = np.zeros((n + 1, m + 1), dtype=int)
    hi[0, 0] = gap[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k, j - 1], part), min(lo[k, j - 1], part)
                if gap[i, j] >= top - bottom:
                    gap[i, j], hi[i, j], lo[i, j], cut[i, j] = top - bottom, top, bottom, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(int(cut[parts[-1], j]))
    parts.reverse()  # [0, start of stage 1, ..., n]
    return [named[p][0] for p in parts[1:-1]]


# ---- part 1: stage times of each split ----------------------------------------------------


def sample(cfg: UnevenConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=g)
    return idx, torch.randint(0, cfg.vocab, (batch, cfg.block_size), generator=g)


def stage_times(model, splits: dict[str, list[str]], mb) -> dict[str, list[float]]:
    """Forward + backward seconds of each stage: its fastest over ``ROUNDS``
    rounds, each round running every distinct split once (the median of 2
    runs). On a busy machine a run of a few milliseconds is often preempted;
    the fastest is the closest to its cost."""
    from annot.plan.planner import measure_split

    distinct = {tuple(split) for split in splits.values()}
    runs: dict[tuple, list[list[float]]] = {k: [] for k in distinct}
    for _ in range(ROUNDS):
        for split in sorted(distinct):
            costs = measure_split(model, UnevenGPT, list(split), sample=mb, repeats=2, rounds=1)
            runs[split].append([c.time for c in costs])
    best = {k: [min(r[s] for r in v) for s in range(len(v[0]))] for k, v in runs.items()}
    return {name: best[tuple(split)] for name, split in splits.items()}


def imbalance(times: list[float]) -> float:
    return max(times) / (sum(times) / len(times))


# ---- part 3: pipeline steps on gloo ranks -------------------------------------------------


def _rank_steps(cfg: UnevenConfig, splits: dict[str, list[str]], pp: int, batch: int):
    import torch.distributed as dist

    import annot

    torch.set_num_threads(1)
    steps = {}
    for name, split in splits.items():
        model = annot.parallelize(UnevenGPT, cfg, mesh=annot.Mesh(pp=pp), seed=0, split=split)

        def step(x, y, model=model):
            _, loss = model(x, y)
            model.backward(loss)
            return loss

        steps[name] = annot.jit(model, microbatches=MICROBATCHES, schedule="1f1b")(step)
    x, y = sample(cfg, batch, seed=1)
    times: dict[str, list[float]] = {k: [] for k in splits}
    for r in range(2 + STEP_ROUNDS):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(x, y)
            dist.barrier()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def main() -> None:
    from annot.plan.partition import evaluate, partition
    from annot.plan.planner import plan as plan_stages
    from annot.plan.segment_plan import SourceSegments
    from annot.testing import run_ranks
    from benchmarks.partition_speed import median_time

    torch.set_num_threads(1)
    cfg = UnevenConfig()
    torch.manual_seed(0)
    model = UnevenGPT(cfg)
    mb = sample(cfg, batch=PLAN_BATCH)  # one microbatch
    params = {
        name: sum(p.numel() for m in mods for p in m.parameters()) for name, mods in layers(model)
    }
    sizes = [params[f"blocks.{i}"] for i in range(len(cfg.widths))]
    print(
        f"model: vocab {cfg.vocab}, width {cfg.n_embd}, {len(cfg.widths)} blocks of MLP widths "
        f"{list(cfg.widths)} x {cfg.n_embd}; parameters: embedding {params['wte']}, head "
        f"{params['head']}, blocks {min(sizes)}..{max(sizes)}"
    )
    print(
        f"sample microbatch: {tuple(mb[0].shape)} tokens; torch threads: 1; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )

    chosen: dict[int, dict[str, list[str]]] = {}
    print("part 1: max/mean stage cost of each rule's split")
    print("  time: each stage run whole, forward + backward, fastest of the rounds")
    print("  FLOPs: the sum of its segments' counted FLOPs (no noise)")
    print(f"  {'pp':>2}  {'rule':<10} {'time':>5} {'FLOPs':>5}  {'plan s':>6}  boundaries")
    for pp in (2, 4):
        t0 = time.perf_counter()
        plan = plan_stages(
            model, pp, units=SourceSegments(UnevenGPT, rounds=7), sample=mb, cost="time"
        )
        plan_s = time.perf_counter() - t0
        splits = {
            "annot": list(plan.boundaries),
            "uniform": uniform_split(model, pp),
            "deepspeed": deepspeed_parameters_split(model, pp),
        }
        chosen[pp] = splits
        times = stage_times(model, splits, mb)
        flops = [float(c.flops) for c in plan.costs]
        for name, split in splits.items():
            cuts = [plan.segments.index(b) for b in split]
            by_flops = evaluate(flops, None, cuts).imbalance
            extra = f"{plan_s:6.1f}" if name == "annot" else " " * 6
            stages = " ".join(f"{t * 1e3:.1f}" for t in times[name])
            print(
                f"  {pp:>2}  {name:<10} {imbalance(times[name]):5.2f} {by_flops:5.2f}  {extra}  "
                f"{', '.join(split)}   (ms: {stages})"
            )
    print("  goal for annot: <= 1.10\n")

    rng = np.random.default_rng(0)
    costs = rng.uniform(0.5, 1.5, 10_000).tolist()
    seconds, _ = median_time(lambda: partition(costs, None, 64))
    print(
        f"part 2: partitioner, 10 000 segments into 64 stages: {seconds * 1e3:.1f} ms (median of 5)\n"
    )

    print(
        f"part 3: pipeline step time, {MICROBATCHES} microbatches of {MB_BATCH} x "
        f"{cfg.block_size} tokens, 1F1B, gloo (median and fastest of {STEP_ROUNDS} steps)"
    )
    print(f"  {'pp':>2}  {'annot s':>13}  {'uniform s':>13}  {'auto/uniform':>12}")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ANNOT_CACHE_DIR"] = cache
        for pp in (2, 4):
            splits = {k: chosen[pp][k] for k in ("annot", "uniform")}
            out = run_ranks(_rank_steps, pp, cfg, splits, pp, MB_BATCH * MICROBATCHES, timeout=600)
            (a_med, a_min), (u_med, u_min) = out[0]["annot"], out[0]["uniform"]
            print(
                f"  {pp:>2}  {a_med:6.3f} {a_min:6.3f}  {u_med:6.3f} {u_min:6.3f}  "
                f"{a_med / u_med:5.2f} {a_min / u_min:6.2f}"
            )
    print(f"  ({os.cpu_count()} CPU cores: at pp=4 four rank processes share them)")


if __name__ == "__main__":
    # Run as benchmarks.partition, so the ranks import the same model class.
    from benchmarks.partition import main as _main

    _main()
