"""HF Llama (8 layers) in a pipeline: annot's automatic split vs a uniform one vs
torch.distributed.pipelining with the same uniform split done by hand.

    python benchmarks/pp_llama.py        # a few minutes on 2 CPU cores
    BENCH_PP=4 BENCH_STEPS=4 python benchmarks/pp_llama.py    # one pp, fewer steps
    BENCH_SPLITS=uniform BENCH_RUNNER=replay python benchmarks/pp_llama.py

The model is ``LlamaForCausalLM`` built from a small config, unmodified; annot
cuts it inside the nested ``LlamaModel.forward``: at whole blocks by the nested
source split (the default runner since 2026-11-27), inside a block by the
replay (annot.runtime.runners.replay). Per pp
(2 and 4), three systems, steps interleaved (annot-auto, annot-uniform,
torch, ...), 1F1B, 8 microbatches:

* **auto**: ``annot.plan.planner.plan(units=ModuleUnits(), cost="time")`` on one
  microbatch: each block part (attention | MLP) timed, median of 7 forwards;
* **uniform**: the blocks spread evenly (``annot.hf.stages_from_hf_config``);
* **torch**: ``PipelineStage`` + ``Schedule1F1B`` over hand-written stage
  modules (embedding + blocks, blocks, blocks + norm + head) at the uniform
  split; its tracer cannot take the HF model.

Printed: median step time and ratios, and for annot the measured max/mean
stage time (each stage's forward + backward busy time from the pipeline trace
of three traced steps run after the timed ones, median over them; the timed
steps run untraced, as torch's do: until 2026-11-27 14:30 UTC they were
traced, a span per action on annot's side only). Timings on this shared machine move by 10-20% between
runs; read the ratios.

Results (one run, BENCH_STEPS=8, 2-core CPU, 2-4 gloo ranks sharing it):

     pp   auto ms  uniform ms  torch ms  auto/torch  uniform/torch  max/mean auto  uniform
      2     204.1       204.0     178.1        1.15           1.14           1.01     1.02
      4     248.1       229.8     195.7        1.27           1.17           1.03     1.09

    auto at pp=2: ['model.layers.4.self_attn'] (predicted max/mean 1.00)
    auto at pp=4: ['model.layers.1.mlp.down_proj', 'model.layers.4',
                   'model.layers.6.self_attn.v_proj'] (predicted 1.02)
    measured busy ms per stage at pp=4: auto [125.4, 132.7, 127.5, 134.2]

Reading it. annot pipelines the unmodified HF model, which torch's tracer
cannot. The automatic split is balanced: max/mean 1.01 at pp=2 and 1.03-1.09
at pp=4 over five runs. At pp=4 it begins two stages inside a block part (the
parts alone give 1.08 predicted, 1.03-1.13 measured). It is not the fastest
here: with 4 ranks on 2 cores the step time follows the total work, not the
slowest stage, and the automatic split's step was 5-8% above the uniform
one's in 3 of 4 runs. Each stage replays the earlier stages' Python on meta;
a block of another stage is one cached meta call and the glue's meta ops come
from a shape cache (annot.runtime.runners.meta_ops.MetaOps). The first version was
2.8x / 4.4x torch's step, a later one 1.39x / 1.71x. The goal step <= 1.0x
torch is not met.

Issue 33 item 4, uniform split only (BENCH_SPLITS=uniform BENCH_STEPS=5), three runs
on a machine loaded by other jobs, uniform/torch at pp=2 / pp=4: 8 layers 1.14-1.26 /
1.19-1.61; 32 layers (BENCH_LAYERS=32) 1.02-1.20 / 1.01-1.16.

2026-11-27 evening, the default runner now the nested source split
(BENCH_SPLITS=uniform BENCH_STEPS=5, three runs): 8 layers 1.00-1.07 / 1.03-1.14.
The automatic split (BENCH_STEPS=5, one run) plans whole blocks at pp=2
(['model.layers.4'], run by the source split: 1.01x torch) and, at pp=4, block
parts (predicted max/mean 1.05 against the whole blocks' 1.17, more than the
planner's 5% bar: the replay runs it), 1.31x torch: with 4 ranks on 2 cores the
step follows the total CPU, not the slowest stage, so the better balance does
not pay here.
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

STEPS = int(os.environ.get("BENCH_STEPS", "6"))
LAYERS = int(os.environ.get("BENCH_LAYERS", "8"))
# "auto,uniform" (default) or "uniform": the automatic split is planned and timed too
SPLITS = tuple(os.environ.get("BENCH_SPLITS", "auto,uniform").split(","))
# the uniform split's runner: "auto" (the nested source split, the stage methods
# annot rewrite --pp prints), or "replay" to measure the replay on the same plan
RUNNER = os.environ.get("BENCH_RUNNER", "auto")
MICRO = 8
BATCH, SEQ = 16, 64


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _stage_times(events: list, n_stages: int) -> list[float]:
    busy = [0.0] * n_stages
    for e in events:
        if e.get("cat") in ("forward", "backward") and "stage" in e.get("args", {}):
            busy[e["args"]["stage"]] += e["dur"]
    return busy


def torch_pipeline(cfg, uniform: list):
    """torch.distributed.pipelining at the ``uniform`` split on this rank: the
    stage modules written by hand (embedding + blocks, blocks, blocks + norm +
    head), 1F1B over MICRO microbatches; returns ``(step(ids), stage)``."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    full = LlamaForCausalLM(cfg)
    rank, pp = dist.get_rank(), dist.get_world_size()
    blocks = [int(b.rsplit(".", 1)[1]) for b in uniform]
    lo = ([0] + blocks)[rank]
    hi = (blocks + [cfg.num_hidden_layers])[rank]

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = full.model.embed_tokens if rank == 0 else None
            self.layers = nn.ModuleList(full.model.layers[lo:hi])
            self.rotary = full.model.rotary_emb
            self.norm = full.model.norm if rank == pp - 1 else None
            self.head = full.lm_head if rank == pp - 1 else None

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            pe = self.rotary(h, pos)
            for layer in self.layers:
                h = layer(h, position_embeddings=pe, position_ids=pos)
            return self.head(self.norm(h)) if self.head is not None else h

    def loss_fn(logits, ids):
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    stage = PipelineStage(Part(), rank, pp, torch.device("cpu"))
    sched = Schedule1F1B(stage, MICRO, loss_fn=loss_fn)

    def torch_step(ids):
        if rank == 0:
            sched.step(ids)
        elif rank == pp - 1:
            sched.step(target=ids)
        else:
            sched.step()

    return torch_step, stage


def _rank(pp: int, auto_split: list, cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    import annot
    from annot.hf import stages_from_hf_config

    torch.set_num_threads(1)
    cfg = _config()
    with torch.device("meta"):
        uniform = stages_from_hf_config(LlamaForCausalLM(cfg), pp)
    steps, traced = {}, {}
    models = {}
    for name, split in (("auto", auto_split), ("uniform", uniform)):
        if name not in SPLITS:
            continue
        model = annot.parallelize(
            LlamaForCausalLM,
            cfg,
            mesh=annot.Mesh(pp=pp),
            seed=0,
            split=split,
            runner=RUNNER if name == "uniform" else "auto",
        )
        models[name] = model

        def train(ids, model=model):
            logits = model(ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            model.backward(loss)
            return loss

        # the timed steps run untraced (torch's are); the stage times come
        # from traced steps run after them
        steps[name] = annot.jit(model, microbatches=MICRO, schedule="1f1b")(train)
        traced[name] = annot.jit(model, microbatches=MICRO, schedule="1f1b", trace=True)(train)

    torch_step, stage = torch_pipeline(cfg, uniform)
    rank = dist.get_rank()

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    names = [n for n in ("auto", "uniform") if n in SPLITS] + ["torch"]
    times = {n: [] for n in names}
    busy = {n: [] for n in names if n != "torch"}
    for i in range(STEPS + 1):
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "torch":
                torch_step(ids)
            else:
                steps[name](ids)
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
            for m in models.values():
                m.zero_grad(set_to_none=True)
            stage.submod.zero_grad(set_to_none=True)
    for name, step in traced.items():
        for i in range(4):
            dist.barrier()
            step(ids)
            models[name].zero_grad(set_to_none=True)
            if i:
                mine = _stage_times(step.trace_events(), pp)[rank]
                parts = [None] * pp
                dist.all_gather_object(parts, mine)
                busy[name].append(parts)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio, stage_ms = {}, {}
    for name, rows in busy.items():
        per_stage = [statistics.median(r[s] for r in rows) for s in range(pp)]
        ratio[name] = max(per_stage) / (sum(per_stage) / pp)
        stage_ms[name] = [round(t / 1e3, 1) for t in per_stage]  # trace durations are in us
    return med, ratio, uniform, stage_ms


def main() -> None:
    import torch
    from transformers import LlamaForCausalLM

    from annot.plan.module_units import ModuleUnits
    from annot.plan.planner import plan as plan_stages
    from annot.testing import run_ranks

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    g = torch.Generator().manual_seed(1)
    sample = {"input_ids": torch.randint(0, 512, (BATCH // MICRO, SEQ), generator=g)}
    print(f"HF Llama, {LAYERS} layers, batch {BATCH} x {SEQ} tokens, {MICRO} microbatches, 1F1B")
    print(
        f"{'pp':>3} {'auto ms':>9} {'uniform ms':>11} {'torch ms':>9} {'auto/torch':>11} "
        f"{'uniform/torch':>14} {'max/mean auto':>14} {'uniform':>8}"
    )
    nan = float("nan")
    for pp in (int(x) for x in os.environ.get("BENCH_PP", "2,4").split(",")):
        t0 = time.perf_counter()
        plan = (
            plan_stages(model, pp, units=ModuleUnits(), sample=sample, cost="time")
            if "auto" in SPLITS
            else None
        )
        planned = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as cache:
            res = run_ranks(_rank, pp, pp, plan.boundaries if plan else [], cache, timeout=900)
        med, ratio, uniform, stage_ms = res[0]
        auto_ms = med.get("auto", nan)
        print(
            f"{pp:>3} {auto_ms * 1e3:>9.1f} {med['uniform'] * 1e3:>11.1f} "
            f"{med['torch'] * 1e3:>9.1f} {auto_ms / med['torch']:>11.2f} "
            f"{med['uniform'] / med['torch']:>14.2f} {ratio.get('auto', nan):>14.2f}"
            f" {ratio['uniform']:>8.2f}"
        )
        if plan is not None:
            print(
                f"    auto split {plan.boundaries} (planned in {planned:.1f} s, predicted "
                f"max/mean {plan.imbalance:.2f}); uniform {uniform}"
            )
        print(f"    measured busy ms per stage: {stage_ms}")


if __name__ == "__main__":
    main()
