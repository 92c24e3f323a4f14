"""Fine-tune a Hugging Face causal LM with the Hugging Face Trainer, tensor and
pipeline parallel, and hand the result back to transformers.

    torchrun --nproc-per-node 4 examples/hf_trainer.py --tp 2 --pp 2

The Trainer script a user already has, with two lines changed: the model is
``annot.from_pretrained(...)`` over a mesh, and the Trainer is
``annot.hf.Trainer`` (transformers' Trainer, told annot's mesh: each batch
split over dp only, no DDP around the model, the pipeline's microbatches on
annot's schedule, ``save_model`` in the Hugging Face layout).

1. No hub is reachable: the "pretrained" checkpoint is made once by
   transformers' ``save_pretrained`` (``examples/finetune_hf.py``); point
   ``--pretrained`` at a downloaded directory on a real run.
2. ``trainer.train()`` (AdamW, a cosine schedule with warm-up, clipping,
   gradient accumulation), ``trainer.evaluate()``, ``trainer.save_model()``.
3. Rank 0 reloads the saved directory with plain transformers and checks its
   evaluation loss against the Trainer's.
"""

import argparse
import os

import torch
import torch.distributed as dist
from finetune_hf import CONFIG, batches, make_pretrained, wait_for

import annot
import annot.hf


def examples(n: int, seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows that count up from a random start with a random stride."""
    rows = torch.cat(list(batches(CONFIG["vocab_size"], n, seq, 1, seed)))
    return [{"input_ids": r, "labels": r} for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="per dp replica")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--workdir", default="/tmp/annot_hf_trainer")
    p.add_argument("--pretrained", default=None, help="a checkpoint directory to start from")
    args = p.parse_args()
    from transformers import LlamaForCausalLM, TrainingArguments
    from transformers.utils import logging

    logging.set_verbosity_error()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = annot.Mesh(dp=max(1, world // (args.tp * args.pp)), pp=args.pp, tp=args.tp)
    pretrained = args.pretrained or os.path.join(args.workdir, "pretrained")
    if int(os.environ.get("RANK", "0")) == 0 and args.pretrained is None:
        make_pretrained(pretrained)
    wait_for(pretrained)

    model = annot.from_pretrained(LlamaForCausalLM, pretrained, mesh=mesh)  # changed line 1
    training = TrainingArguments(
        output_dir=os.path.join(args.workdir, "run"),
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = annot.hf.Trainer(  # changed line 2 (was transformers.Trainer)
        model=model,
        args=training,
        train_dataset=examples(256, args.seq, seed=0),
        eval_dataset=examples(32, args.seq, seed=1),
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    out = os.path.join(args.workdir, "finetuned")
    trainer.save_model(out)

    if trainer.args.process_index == 0:
        plain = LlamaForCausalLM.from_pretrained(out)  # plain transformers, one process
        data = examples(32, args.seq, seed=1)
        with torch.no_grad():
            losses = [
                plain(
                    torch.stack([r["input_ids"] for r in data[i : i + args.batch]]),
                    labels=torch.stack([r["labels"] for r in data[i : i + args.batch]]),
                ).loss
                for i in range(0, len(data), args.batch)
            ]
        reloaded = torch.stack(losses).mean().item()
        print(f"saved {out}: {', '.join(sorted(os.listdir(out)))}")
        print(
            f"eval loss: annot.hf.Trainer {eval_loss:.6f} | transformers reloaded "
            f"{reloaded:.6f} | diff {abs(eval_loss - reloaded):.1e}"
        )
        assert abs(eval_loss - reloaded) <= 1e-4, "the reloaded model's loss differs"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
