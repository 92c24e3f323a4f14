"""Train a small GPT with annot, tensor- and pipeline-parallel, next to the plain model.

    torchrun --nproc-per-node 2 examples/gpt/train.py --tp 2
    torchrun --nproc-per-node 2 examples/gpt/train.py --pp 2 --schedule gpipe
    torchrun --nproc-per-node 4 examples/gpt/train.py --tp 2 --pp 2
    torchrun --nproc-per-node 2 examples/gpt/train.py --tp 1 --pp 2 --schedule interleaved --trace out/

On CPU the ranks talk over gloo; on GPUs over NCCL (one GPU per rank). Every
rank trains its part of the model; rank 0 also trains the plain single-device
model on the same batches from the same seed and prints both losses. The
remaining ranks (world size / (tp * pp)) form the data-parallel axis.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model import GPT, GPTConfig

import annot


def batches(vocab: int, batch: int, seq: int, steps: int, seed: int):
    """Synthetic next-token data with structure to learn: each row counts up
    from a random start with a random stride (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        seqs = (start + stride * torch.arange(seq + 1)) % vocab  # (B, T+1)
        yield seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zbh1"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-reference", action="store_true", help="skip the single-device run")
    p.add_argument(
        "--trace", metavar="DIR", help="write a Chrome trace (open in Perfetto) of the last step"
    )
    p.add_argument("--explain", action="store_true", help="print the plan and this rank's source")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters, gradients and optimizer state over dp",
    )
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world // (args.tp * args.pp))
    mesh = annot.Mesh(dp=dp, pp=args.pp, tp=args.tp)
    cfg = GPTConfig(
        block_size=args.seq,
        vocab_size=args.vocab,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
    )
    t0 = time.perf_counter()
    chunks = 2 if args.schedule == "interleaved" else 1  # two model chunks per pipeline rank
    model = annot.parallelize(GPT, cfg, mesh=mesh, seed=args.seed, chunks=chunks, fsdp=args.fsdp)
    ctx = model.ctx
    master = ctx.rank == 0
    if master:
        print(
            f"annot: {mesh!r} on {ctx.world_size} rank(s), device {ctx.device}; "
            f"built in {time.perf_counter() - t0:.2f}s"
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    @annot.jit(
        model, microbatches=args.microbatches, schedule=args.schedule, trace=bool(args.trace)
    )
    def train_step(x, y):
        logits, loss = model(x, y)
        model.backward(loss)
        return loss

    ref = ref_opt = None
    if master and not args.no_reference:
        torch.manual_seed(args.seed)
        ref = GPT(cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.0)

    for step, (x, y) in enumerate(batches(args.vocab, args.batch, args.seq, args.steps, args.seed)):
        xs, ys = x.chunk(dp)[ctx.dp_rank], y.chunk(dp)[ctx.dp_rank]  # this replica's share
        if step == 0 and args.explain and master:
            print(train_step.explain(xs, ys))
        t = time.perf_counter()
        loss = train_step(xs.to(ctx.device), ys.to(ctx.device)).reduce_mean()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        if dp > 1:
            loss = loss.to(ctx.device)
            dist.all_reduce(loss, group=ctx.dp_group)
            loss = loss / dp
        line = f"step {step:3d} | annot loss {loss.item():.6f}"
        if ref is not None:
            _, ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            line += f" | single-device {ref_loss.item():.6f} | diff {abs(loss.item() - ref_loss.item()):.1e}"
        if master:
            print(line + f" | {dt * 1000:.0f} ms", flush=True)
    if args.trace:
        path = train_step.write_trace(args.trace)
        if path:
            print(f"trace of the last step: {path} (open in https://ui.perfetto.dev)")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
