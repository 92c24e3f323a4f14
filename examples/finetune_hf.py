"""Fine-tune a pretrained Hugging Face model with annot and hand the result back
to transformers.

    torchrun --nproc-per-node 4 examples/finetune_hf.py --tp 2 --pp 2 --save-dcp /tmp/annot_finetune_hf/step10
    torchrun --nproc-per-node 2 examples/finetune_hf.py --tp 2 --resume /tmp/annot_finetune_hf/step10

1. No hub is reachable, so the "pretrained" checkpoint is made once (rank 0,
   transformers' ``save_pretrained`` of a small random Llama, sharded with an
   index) under ``--workdir``; on a real run point ``--pretrained`` at a
   downloaded checkpoint directory instead.
2. ``annot.from_pretrained`` builds the model over tp x pp (x dp: the
   remaining ranks), each rank reading only its own slices of the weights.
3. It trains ``--steps`` steps (AdamW, ``annot.jit``) on synthetic sequences
   with structure to learn; rank 0 prints the loss.
4. ``annot.save_pretrained`` writes the Hugging Face directory; rank 0 reloads
   it with plain transformers and checks its loss on the last batch against
   annot's loss with the same weights.
5. ``--save-dcp DIR`` also saves an annot (DCP) checkpoint with the optimizer;
   ``--resume DIR`` continues from one on any other mesh (the model first
   built from the pretrained directory, then the checkpoint loaded over it).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import annot

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def make_pretrained(path: str) -> None:
    """Stand-in for a downloaded checkpoint: transformers' own save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isdir(path):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp, max_shard_size="200KB")
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 64}\n')  # copied beside the fine-tuned weights
    os.rename(tmp, path)  # the other ranks wait for it to appear whole


def wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.1)


def batches(vocab: int, batch: int, seq: int, steps: int, seed: int):
    """Each row counts up from a random start with a random stride (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        yield (start + stride * torch.arange(seq)) % vocab  # (B, T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workdir", default="/tmp/annot_finetune_hf")
    p.add_argument("--pretrained", default=None, help="a checkpoint directory to start from")
    p.add_argument("--save-dcp", metavar="DIR", help="also save an annot checkpoint at the end")
    p.add_argument("--resume", metavar="DIR", help="continue from an annot checkpoint")
    args = p.parse_args()
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world // (args.tp * args.pp))
    mesh = annot.Mesh(dp=dp, pp=args.pp, tp=args.tp)
    pretrained = args.pretrained or os.path.join(args.workdir, "pretrained")
    master = int(os.environ.get("RANK", "0")) == 0
    if master and args.pretrained is None:
        make_pretrained(pretrained)
    wait_for(pretrained)

    t0 = time.perf_counter()
    model = annot.from_pretrained(LlamaForCausalLM, pretrained, mesh=mesh)
    ctx = model.ctx
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    first = 0
    if args.resume:
        first = annot.load(model, opt, args.resume)["step"]
    if master:
        print(f"annot: {mesh!r}, loaded {pretrained} in {time.perf_counter() - t0:.2f}s")
        if args.resume:
            print(f"resumed from {args.resume} at step {first}")

    @annot.jit(model, microbatches=2)
    def train_step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    def mean_loss(ids) -> float:
        loss = train_step(ids).reduce_mean().to(ctx.device)
        if dp > 1:
            dist.all_reduce(loss, group=ctx.dp_group)
        return loss.item() / dp

    data = list(batches(CONFIG["vocab_size"], args.batch, args.seq, first + args.steps, 0))
    for step in range(first, first + args.steps):
        ids = data[step].chunk(dp)[ctx.dp_rank]  # this replica's share
        loss = mean_loss(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if master:
            print(f"step {step:3d} | loss {loss:.6f}", flush=True)

    # the trained weights' loss on the last batch (its gradients are dropped)
    last = data[first + args.steps - 1]
    after = mean_loss(last.chunk(dp)[ctx.dp_rank])
    opt.zero_grad(set_to_none=True)
    if args.save_dcp:
        annot.save(model, opt, args.save_dcp, step=first + args.steps)
    out = os.path.join(args.workdir, "finetuned")
    annot.save_pretrained(model, out, overwrite=True)
    if master:
        plain = LlamaForCausalLM.from_pretrained(out)  # plain transformers, one process
        plain.train()
        with torch.no_grad():
            reloaded = plain(last, labels=last).loss.item()
        files = sorted(os.listdir(out))
        print(f"saved {out}: {', '.join(files)}")
        print(
            f"last batch: annot loss {after:.6f} | transformers reloaded {reloaded:.6f} | "
            f"diff {abs(after - reloaded):.1e}"
        )
        if args.save_dcp:
            print(f"annot checkpoint {args.save_dcp} (resume it with --resume on any mesh)")
        assert abs(after - reloaded) <= 1e-4, "the reloaded model's loss differs"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
