"""``annot plan``'s memory per stage, predicted from shapes, against a real
pipeline training step on gloo ranks.

    python benchmarks/plan_memory.py                      # 4 stages, the size below
    python benchmarks/plan_memory.py --hidden 2048 --intermediate 5632 --layers 16 \\
        --heads 16 --kv-heads 4                           # the issue's 852.6M Llama

1. The plan: :func:`annot.plan.planner.plan` (``units=ModuleUnits()``) on the meta
   device (no weight allocated) for a ``LlamaForCausalLM`` (untied head) at
   ``--pp`` stages, one microbatch of ``--microbatch-size`` x ``--seq-len``
   tokens with labels (the loss inside the model), AdamW in float32, 1F1B
   over ``--microbatches``.
2. The run: ``annot.parallelize(..., split=<the plan's boundaries>)`` on
   ``--pp`` gloo ranks, AdamW. A first step makes the gradients and the
   optimizer state; then ``zero_grad(set_to_none=False)`` keeps the gradient
   buffers, the peak RSS is reset (``/proc/self/clear_refs``) and one step
   (forward and backward of every microbatch, under 1F1B) is measured.
   Each rank's allocations above 64 KiB are mmapped (``mallopt``), so memory
   freed is memory returned and RSS follows the live tensors.

Per stage it prints the predicted weights + gradients + optimizer state and
the bytes the rank holds (its parameters, their ``.grad`` and
``annot.state_bytes(opt)``: equal, to the byte), and the predicted
activations (bytes saved for backward x the microbatches 1F1B keeps in
flight there) against the measured ones: peak RSS during the step - RSS just
before it. The measured figure also holds what the model keeps besides:
received activations and their gradients, the loss's logits gradient, the
allocator's rounding. Results: the README, "Plans beyond the machine".
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["rank_step"]

MIB = 1024**2


def _config(args):
    from transformers import LlamaConfig

    from benchmarks.pretrained_memory import llama_config  # one copy of the shape options

    return LlamaConfig(**llama_config(args))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def rank_step(cfg, split: list[str], batch: int, seq: int, microbatches: int) -> dict:
    """One rank: build its stage, take a warm-up step, then measure one."""
    import ctypes

    import torch
    from transformers import LlamaForCausalLM

    import annot
    from benchmarks.pretrained_memory import peak_rss_bytes

    # allocations above 64 KiB mmapped, and returned when freed (mallopt: the
    # environment variables are read when the process starts, before this runs)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)
    libc.mallopt(-1, 65536)  # M_TRIM_THRESHOLD
    pp = torch.distributed.get_world_size()
    model = annot.parallelize(LlamaForCausalLM, cfg, mesh=annot.Mesh(pp=pp), seed=0, split=split)
    opt = torch.optim.AdamW([p for p in model.parameters() if not p.is_meta], lr=1e-4)

    @annot.jit(model, microbatches=microbatches, schedule="1f1b")
    def step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch * microbatches, seq), generator=g)
    step(ids)
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradient buffers stay: they are held, not activations
    held = [p for p in model.parameters() if not p.is_meta]
    state = sum(p.numel() * p.element_size() for p in held)
    state += sum(p.grad.numel() * p.grad.element_size() for p in held if p.grad is not None)
    state += annot.state_bytes(opt)
    torch.distributed.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss()
    step(ids)
    peak = peak_rss_bytes()
    return {"held": state, "activations": peak - before, "rank": torch.distributed.get_rank()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args(argv)

    import torch
    from transformers import LlamaForCausalLM

    from annot.plan.memory_model import Training
    from annot.plan.module_units import ModuleUnits
    from annot.plan.planner import plan as plan_stages
    from annot.testing import run_ranks

    cfg = _config(args)
    with torch.device("meta"):
        ref = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in ref.parameters())
    ids = torch.zeros(args.microbatch_size, args.seq_len, dtype=torch.long, device="meta")
    setup = Training(optimizer="adamw", microbatches=args.microbatches, schedule="1f1b")
    plan = plan_stages(
        ref,
        args.pp,
        units=ModuleUnits(),
        sample={"input_ids": ids, "labels": ids, "use_cache": False},
        setup=setup,
    )
    print(
        f"LlamaForCausalLM {n / 1e6:.1f}M parameters, pp={args.pp}, AdamW fp32, 1F1B over "
        f"{args.microbatches} microbatches of {args.microbatch_size} x {args.seq_len} tokens"
    )
    print(f"split={plan.boundaries}")
    results = run_ranks(
        rank_step,
        args.pp,
        cfg,
        plan.boundaries,
        args.microbatch_size,
        args.seq_len,
        args.microbatches,
        timeout=1800,
        pg_timeout=1200,
    )
    head = (
        f"{'stage':<6}{'W+G+opt predicted':>19}{'held':>14}{'equal':>7}"
        f"{'act. predicted':>16}{'in flight':>10}{'measured':>12}{'measured/pred.':>16}"
    )
    print(head)
    print("-" * len(head))
    for d, r in zip(plan.stage_detail, sorted(results, key=lambda r: r["rank"])):
        w = d.params.total
        print(
            f"{r['rank']:<6}{w:>19,}{r['held']:>14,}{'yes' if w == r['held'] else 'NO':>7}"
            f"{d.activations / MIB:>12.1f} MiB{d.in_flight:>10}"
            f"{r['activations'] / MIB:>8.1f} MiB{r['activations'] / d.activations:>16.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
