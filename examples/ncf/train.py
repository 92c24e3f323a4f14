"""Train NeuMF (neural collaborative filtering) with annot, tensor- and
pipeline-parallel, next to the plain model.

    torchrun --nproc-per-node 2 examples/ncf/train.py --tp 2
    torchrun --nproc-per-node 2 examples/ncf/train.py --tp 1 --pp 2 --schedule gpipe
    torchrun --nproc-per-node 4 examples/ncf/train.py --tp 2 --pp 2

On CPU the ranks talk over gloo; on GPUs over NCCL (one GPU per rank). Every
rank trains its part of the model; rank 0 also trains the plain single-device
model on the same batches from the same seed and prints both losses. The
remaining ranks (world size / (tp * pp)) form the data-parallel axis.

The data is synthetic implicit feedback with a planted low-rank structure:
user and item factors ``U`` (users, r) and ``V`` (items, r) give an affinity
``U @ V.T``; a user has interacted with the items in the top 20% of its
affinities (label 1), not with the rest (label 0), about the paper's four
negatives per positive. Batches are (user, item) pairs drawn uniformly, so
the ids span every tp rank's block of each embedding table.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model import NCFConfig, NeuMF

import annot


def interactions(users: int, items: int, rank: int, seed: int, positive: float = 0.2):
    """The planted ``(users, items)`` 0/1 interaction matrix."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(users, rank, generator=g)
    v = torch.randn(items, rank, generator=g)
    affinity = u @ v.T  # (users, items)
    cut = affinity.quantile(1.0 - positive, dim=1, keepdim=True)  # (users, 1)
    return (affinity >= cut).float()


def batches(truth: torch.Tensor, batch: int, steps: int, seed: int):
    """Yield ``(users, items, labels)``, each (B,): uniform pairs and their labels."""
    g = torch.Generator().manual_seed(seed + 1)
    n_users, n_items = truth.shape
    for _ in range(steps):
        users = torch.randint(0, n_users, (batch,), generator=g)
        items = torch.randint(0, n_items, (batch,), generator=g)
        yield users, items, truth[users, items]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zbh1"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--users", type=int, default=128)
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--factors", type=int, default=4, help="rank of the planted preferences")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-reference", action="store_true", help="skip the single-device run")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world // (args.tp * args.pp))
    mesh = annot.Mesh(dp=dp, pp=args.pp, tp=args.tp)
    cfg = NCFConfig(num_users=args.users, num_items=args.items)
    t0 = time.perf_counter()
    model = annot.parallelize(NeuMF, cfg, mesh=mesh, seed=args.seed)
    ctx = model.ctx
    master = ctx.rank == 0
    if master:
        print(
            f"annot: {mesh!r} on {ctx.world_size} rank(s), device {ctx.device}; "
            f"built in {time.perf_counter() - t0:.2f}s"
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    @annot.jit(model, microbatches=args.microbatches, schedule=args.schedule)
    def train_step(users, items, labels):
        logits, loss = model(users, items, labels=labels)
        model.backward(loss)
        return loss

    ref = ref_opt = None
    if master and not args.no_reference:
        torch.manual_seed(args.seed)
        ref = NeuMF(cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.0)

    truth = interactions(args.users, args.items, args.factors, args.seed)
    for step, batch in enumerate(batches(truth, args.batch, args.steps, args.seed)):
        mine = [t.chunk(dp)[ctx.dp_rank].to(ctx.device) for t in batch]  # this replica's share
        t = time.perf_counter()
        loss = train_step(*mine).reduce_mean()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        if dp > 1:
            loss = loss.to(ctx.device)
            dist.all_reduce(loss, group=ctx.dp_group)
            loss = loss / dp
        line = f"step {step:3d} | annot loss {loss.item():.6f}"
        if ref is not None:
            users, items, labels = batch
            _, ref_loss = ref(users, items, labels=labels)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            line += f" | single-device {ref_loss.item():.6f} | diff {abs(loss.item() - ref_loss.item()):.1e}"
        if master:
            print(line + f" | {dt * 1000:.0f} ms", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
