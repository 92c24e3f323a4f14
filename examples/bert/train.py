"""Pretrain a small BERT (masked LM) with annot, tensor- and pipeline-parallel,
next to the plain model.

    torchrun --nproc-per-node 2 examples/bert/train.py --tp 2
    torchrun --nproc-per-node 2 examples/bert/train.py --tp 1 --pp 2 --schedule gpipe
    torchrun --nproc-per-node 4 examples/bert/train.py --tp 2 --pp 2

On CPU the ranks talk over gloo; on GPUs over NCCL (one GPU per rank). Every
rank trains its part of the model; rank 0 also trains the plain single-device
model on the same batches from the same seed and prints both losses. The
remaining ranks (world size / (tp * pp)) form the data-parallel axis.

The data is synthetic: each row is runs of four equal words drawn with
Zipf frequencies (within tens of steps the loss falls from ln(vocab) towards
the unigram entropy; copying a masked word from its neighbours, which gets
below that, takes many more steps), padded after
a random length (attention mask 0, labels -100), in two segments (token type
0 then 1), with exactly ``ceil(15% of --seq)`` of its real tokens replaced by
[MASK] and labelled. The same count in every row keeps the mean over
microbatches equal to the mean over the batch.
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model import BertConfig, BertForMaskedLM

import annot

PAD, MASK, FIRST_WORD = 0, 1, 2  # ids below FIRST_WORD are special tokens


def batches(
    vocab: int, batch: int, seq: int, steps: int, seed: int, mask_frac: float = 0.15, run: int = 4
):
    """Yield ``(input_ids, attention_mask, token_type_ids, labels)``, each (B, T)."""
    g = torch.Generator().manual_seed(seed)
    words = vocab - FIRST_WORD
    zipf = 1.0 / torch.arange(1, words + 1, dtype=torch.float)  # (W,): word frequencies
    n_mask = max(1, math.ceil(mask_frac * seq))  # labelled positions per row
    n_runs = -(-seq // run)
    pos = torch.arange(seq)  # (T,)
    for _ in range(steps):
        draws = torch.multinomial(zipf, batch * n_runs, replacement=True, generator=g)
        runs = FIRST_WORD + draws.view(batch, n_runs)  # (B, runs)
        ids = runs.repeat_interleave(run, dim=1)[:, :seq]  # (B, T): runs of equal tokens
        lengths = torch.randint(max(n_mask, seq // 2), seq + 1, (batch, 1), generator=g)
        attention_mask = (pos < lengths).long()  # (B, T): 1 for real tokens
        ids = ids.masked_fill(attention_mask == 0, PAD)
        token_type_ids = ((pos >= lengths // 2) & (attention_mask == 1)).long()  # (B, T)
        # n_mask random real positions per row (padding sorts last)
        score = torch.rand(batch, seq, generator=g).masked_fill(attention_mask == 0, 2.0)
        picked = score.argsort(dim=1)[:, :n_mask]  # (B, n_mask)
        masked = torch.zeros(batch, seq, dtype=torch.bool).scatter_(1, picked, True)
        labels = ids.masked_fill(~masked, -100)
        yield ids.masked_fill(masked, MASK), attention_mask, token_type_ids, labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zbh1"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-reference", action="store_true", help="skip the single-device run")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world // (args.tp * args.pp))
    mesh = annot.Mesh(dp=dp, pp=args.pp, tp=args.tp)
    cfg = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position=args.seq,
        dropout=0.0,
        pad_token_id=PAD,
    )
    t0 = time.perf_counter()
    model = annot.parallelize(BertForMaskedLM, cfg, mesh=mesh, seed=args.seed)
    ctx = model.ctx
    master = ctx.rank == 0
    if master:
        print(
            f"annot: {mesh!r} on {ctx.world_size} rank(s), device {ctx.device}; "
            f"built in {time.perf_counter() - t0:.2f}s"
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    @annot.jit(model, microbatches=args.microbatches, schedule=args.schedule)
    def train_step(input_ids, attention_mask, token_type_ids, labels):
        logits, loss = model(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels
        )
        model.backward(loss)
        return loss

    ref = ref_opt = None
    if master and not args.no_reference:
        torch.manual_seed(args.seed)
        ref = BertForMaskedLM(cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.0)

    data = batches(args.vocab, args.batch, args.seq, args.steps, args.seed)
    for step, batch in enumerate(data):
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
            input_ids, attention_mask, token_type_ids, labels = batch
            _, ref_loss = ref(
                input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                labels=labels,
            )
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
