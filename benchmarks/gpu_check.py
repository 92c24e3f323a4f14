"""World-size-1 check on the current device: annot vs the plain model, in fp32 and bf16.

    torchrun --nproc-per-node 1 benchmarks/gpu_check.py          # on a GPU: NCCL, one rank
    python benchmarks/gpu_check.py                               # no torchrun: no process group

annot builds the example GPT at Mesh(tp=1, pp=1) on the backend that follows
the device (NCCL on CUDA) and the plain model from the same seed. For each
dtype it prints the largest loss / gradient / parameter difference after
optimizer steps (every gradient, every parameter) and the step-time ratio
annot / plain (median of interleaved steps). Modes: fp32; bf16-cast (both
models cast to bf16); bf16-autocast (annot's ``precision="bf16"`` against the
plain model's forward and loss under ``torch.autocast(bf16)``, fp32 weights);
compile (``parallelize(compile=True)``: annot's blocks compiled after
sharding) and compile-wrap (the user's ``torch.compile(model)`` around the annot
model), each against ``torch.compile`` of the plain model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from model import GPT, GPTConfig  # noqa: E402

import annot  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    worst, name = 0.0, ""
    for k, v in a.items():
        d = (v.float() - b[k].float()).abs().max().item()
        if d >= worst:
            worst, name = d, k
    return worst, name


def run(mode: str, cfg: GPTConfig, batch: int, steps: int, seed: int) -> None:
    precision = "bf16" if mode == "bf16-autocast" else None
    mesh = annot.Mesh(dp=1, pp=1, tp=1)
    model = annot.parallelize(
        GPT, cfg, mesh=mesh, seed=seed, precision=precision, compile=mode == "compile"
    )
    device = model.ctx.device
    torch.manual_seed(seed)
    ref = GPT(cfg).to(device)
    ref_fwd = torch.compile(ref) if mode.startswith("compile") else ref
    called = torch.compile(model) if mode == "compile-wrap" else model
    dtype = torch.bfloat16 if mode == "bf16-cast" else torch.float32
    model.to(device=device, dtype=dtype)
    ref.to(dtype=dtype)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision is not None)

    def ref_loss(x, y):
        with autocast:
            return ref_fwd(x, y)[1]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    @annot.jit(model)
    def step(x, y):
        _, loss = called(x, y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)

    loss_a = step(x, y).reduce_mean()
    loss_b = ref_loss(x, y)
    loss_b.backward()
    grads_a = {n: p.grad for n, p in model.named_parameters()}
    grads_a = {n.removeprefix("module."): g for n, g in grads_a.items()}
    grads_b = {n: p.grad for n, p in ref.named_parameters()}
    gd, gname = _max_diff(grads_a, grads_b)
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad(set_to_none=True)
    for _ in range(2):
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_loss(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    params_a = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    pd, pname = _max_diff(params_a, dict(ref.named_parameters()))

    def timed(fn):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t

    def annot_step():
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain_step():
        ref_loss(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    for _ in range(3):
        timed(annot_step), timed(plain_step)
    ta, tb = [], []
    for _ in range(steps):
        ta.append(timed(annot_step))
        tb.append(timed(plain_step))
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(
        f"{mode:13s} device {device} | loss diff {abs(loss_a.item() - loss_b.item()):.1e}"
        f" | max grad diff {gd:.1e} ({gname}) | max param diff after 3 steps {pd:.1e} ({pname})"
        f" | step annot {ma * 1e3:.2f} ms plain {mb * 1e3:.2f} ms ratio {ma / mb:.3f}",
        flush=True,
    )


def control(cfg: GPTConfig, batch: int, seed: int, device: torch.device) -> None:
    """The plain model against itself (two copies from one seed): the floor set
    by the device's own run-to-run differences (e.g. atomics in backward kernels)."""
    torch.manual_seed(seed)
    a = GPT(cfg).to(device)
    torch.manual_seed(seed)
    b = GPT(cfg).to(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (a, b)]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
    gd = None
    for _ in range(3):
        for m in (a, b):
            m(x, y)[1].backward()
        if gd is None:
            gd = _max_diff(
                {n: p.grad for n, p in a.named_parameters()},
                {n: p.grad for n, p in b.named_parameters()},
            )
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    pd = _max_diff(dict(a.named_parameters()), dict(b.named_parameters()))
    print(
        f"{'control':13s} device {device} | plain vs plain: max grad diff {gd[0]:.1e} ({gd[1]})"
        f" | max param diff after 3 steps {pd[0]:.1e} ({pd[1]})",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="fp32,bf16-cast,bf16-autocast,compile,compile-wrap")
    args = p.parse_args()
    cfg = GPTConfig(
        block_size=args.seq,
        vocab_size=args.vocab,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=True,
    )
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}", flush=True)
    for mode in args.modes.split(","):
        run(mode, cfg, args.batch, args.steps, seed=0)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    control(cfg, args.batch, 0, device or torch.device("cpu"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    main()
