"""The two stage runners on the same plan: the source split (the root's forward cut
into stage methods by the rewriter) against the replay (forward cut at run time at
module calls, earlier stages replayed on meta), both built by ``annot.parallelize``
with the same boundaries (``runner="source"`` / ``runner="replay"``).

    python benchmarks/runners.py          # a few minutes on 2 CPU cores
    BENCH_STEPS=20 python benchmarks/runners.py

Models, each with its blocks looped over in the root's forward (the only place
the source split can cut): examples/gpt's GPT (4 layers, n_embd 128, 16 x 64
tokens) and benchmarks/pp_models' MLPStack (8 residual MLPs, width 256, batch 32);
pp=2 and pp=4 (4 ranks on 2 cores: both runners equally oversubscribed), 1F1B,
8 microbatches. Each rank builds both models and interleaves their steps
(source, replay, source, ...); the median step of each is reported, and the
ratio source / replay (below 0.95: the source split is the 5% faster fast path).

HF Llama (8 layers, cut in ``LlamaModel.forward``): ``runner="source"`` runs the
nested split (the root's stage methods call the base model's).

Results (this 2-core CPU machine, quiet, 2026-11-26 evening, BENCH_STEPS=10):

    model     pp  source ms  replay ms  source/replay
    gpt        2      66.76      75.31          0.886
    gpt        4     102.13     117.27          0.871
    mlp        2      54.55      63.76          0.856
    mlp        4      72.32      91.77          0.788
    llama      2     138.78     142.12          0.976
    llama      4     167.84     192.28          0.873

(Earlier that day, shared with other work: gpt 0.939 / 0.778, mlp 0.962 / 0.677,
llama 0.959 / 0.894.) 2026-11-27, ``BENCH_MODELS=llama``, two runs on the
build of that day (the replay's message and frame-walk costs cut): llama pp=2
0.914 / 0.915, pp=4 0.882 / 0.891.

The source split is 5% faster or more on every model here (the replay's cost
grows with the stages it replays on meta), so it is the build's fast path
wherever the rewriter can cut, the nested split included
(annot.plan.stage_points.choose_runner). tests/test_runners.py checks both give
identical losses and gradients.
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
MICROBATCHES = 8


def _model(kind: str, pp: int):
    import torch

    if kind == "gpt":
        from examples.gpt.model import GPT, GPTConfig

        cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128)
        split = [f"h.{cfg.n_layer // pp * s}" for s in range(1, pp)]
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (16, 64), generator=g)
        return GPT, (cfg,), split, (x, x)
    if kind == "llama":  # blocks in a nested forward (LlamaForCausalLM -> LlamaModel)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )
        split = [f"model.layers.{8 // pp * s}" for s in range(1, pp)]
        ids = torch.randint(0, 512, (16, 64), generator=torch.Generator().manual_seed(0))
        return LlamaForCausalLM, (cfg,), split, (ids, ids)
    from benchmarks.pp_models import MLPStack

    split = [f"blocks.{8 // pp * s}" for s in range(1, pp)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 256, generator=g), torch.randn(32, 256, generator=g)
    return MLPStack, (256, 8), split, (x, y)


def _rank(kind: str, cache: str) -> tuple[float, float]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist

    import annot

    torch.set_num_threads(1)
    pp = dist.get_world_size()
    cls, args, split, (x, y) = _model(kind, pp)
    steps = []
    for runner in ("source", "replay"):
        model = annot.parallelize(
            cls, *args, mesh=annot.Mesh(pp=pp), seed=0, split=split, runner=runner
        )
        assert model.report.runner == runner

        def step(x, y, model=model):
            if kind == "llama":
                loss = model(input_ids=x, labels=y, use_cache=False).loss
            else:
                _, loss = model(x, y)
            model.backward(loss)
            return loss

        steps.append((model, annot.jit(model, microbatches=MICROBATCHES)(step)))
    times: list[list[float]] = [[], []]
    for i in range(REPEATS + 2):
        for k, (model, step) in enumerate(steps):
            dist.barrier()
            t = time.perf_counter()
            step(x, y)
            dist.barrier()
            if i >= 2:
                times[k].append(time.perf_counter() - t)
            for p in model.parameters():
                p.grad = None
    return statistics.median(times[0]), statistics.median(times[1])


def measure(kind: str, pp: int) -> tuple[float, float]:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        return run_ranks(_rank, pp, kind, cache, timeout=900)[0]


def main() -> None:
    print(f"{'model':8} {'pp':>3} {'source ms':>10} {'replay ms':>10} {'source/replay':>14}")
    for kind in os.environ.get("BENCH_MODELS", "gpt,mlp,llama").split(","):
        for pp in (2, 4):
            s, r = measure(kind, pp)
            print(f"{kind:8} {pp:3d} {s * 1e3:10.2f} {r * 1e3:10.2f} {s / r:14.3f}")


if __name__ == "__main__":
    main()
