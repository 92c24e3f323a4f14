"""Memory and time of ``annot.from_pretrained``, per rank, beside
transformers' ``from_pretrained`` of the same checkpoint in one process.

    python benchmarks/pretrained_memory.py --pp 4                 # the issue's 852.6M Llama
    python benchmarks/pretrained_memory.py --pp 2 --hidden 512 --intermediate 1376 \\
        --layers 8 --vocab 16000 --heads 8 --kv-heads 2           # a size a small machine fits

The checkpoint (a ``LlamaForCausalLM`` saved by transformers'
``save_pretrained`` in float32, sharded at 2 GB) is made once under
``--dir`` (default ``/tmp/annot_pretrained_bench/<size>``). Then, each in
fresh processes:

1. a bare process imports torch and transformers: its peak RSS is ``bare``;
2. ``annot.from_pretrained`` on ``--pp`` x ``--tp`` gloo ranks: each rank's
   peak RSS over its whole life (``VmHWM``: imports, build and load), the
   bytes of the parameters it holds, and the load's time; the budget the
   issue sets is ``1.2 x (own parameter bytes + bare)``;
3. transformers' ``from_pretrained`` in one process: its peak RSS and time
   when it returns (its tensors map the safetensors files, so what was not
   read yet is not resident) and once every weight has been read.

"load s" is the whole call: for annot the build (rewrite, stages) and the
read. Results: the README, "Pretrained checkpoints in and out".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

__all__ = ["peak_rss_bytes", "rank_load", "bare_rss_bytes", "make_checkpoint"]

GIB = 1024**3


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def bare_rss_bytes() -> int:
    """The peak RSS of a fresh process that imported torch and transformers."""
    code = (
        "import torch, transformers, transformers.models.llama.modeling_llama;"
        "from benchmarks.pretrained_memory import peak_rss_bytes; print(peak_rss_bytes())"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def llama_config(args) -> dict:
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=False,
    )


def make_checkpoint(path: str, config: dict) -> None:
    """transformers' save_pretrained of a random float32 Llama (once)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    code = (
        "import sys, json, torch; from transformers import LlamaConfig, LlamaForCausalLM;"
        "torch.manual_seed(0); m = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[1])));"
        "m.save_pretrained(sys.argv[2], max_shard_size='2GB')"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(config), path], check=True)


def rank_load(path: str, pp: int, tp: int, cache: str) -> dict:
    """On one rank: from_pretrained at pp x tp; this rank's figures."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    import annot
    from annot.runtime.fsdp import local

    logging.set_verbosity_error()
    start = time.perf_counter()
    model = annot.from_pretrained(LlamaForCausalLM, path, mesh=annot.Mesh(pp=pp, tp=tp))
    seconds = time.perf_counter() - start
    own = sum(local(p).numel() * p.element_size() for p in model.parameters())
    return {"peak": peak_rss_bytes(), "own": own, "seconds": seconds}


def transformers_load(path: str) -> dict:
    """transformers' from_pretrained in a fresh process: peak RSS and time
    when it returns (its tensors map the safetensors files: pages not read
    yet are not resident), and again once every weight has been read."""
    code = (
        "import sys, time, json, torch; from transformers import LlamaForCausalLM;"
        "from benchmarks.pretrained_memory import peak_rss_bytes;"
        "t = time.perf_counter(); m = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32);"
        "s = time.perf_counter() - t; peak = peak_rss_bytes();"
        "total = sum(float(p.detach().sum()) for p in m.parameters());"
        "print(json.dumps({'peak': peak, 'seconds': s, 'read_peak': peak_rss_bytes(),"
        " 'read_seconds': time.perf_counter() - t,"
        " 'own': sum(p.numel() * p.element_size() for p in m.parameters())}))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code, path], cwd=root, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    config = llama_config(args)
    tag = f"h{args.hidden}_i{args.intermediate}_l{args.layers}_v{args.vocab}"
    path = args.dir or os.path.join("/tmp/annot_pretrained_bench", tag)
    make_checkpoint(path, config)
    size = sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if n.endswith(".safetensors")
    )
    from annot.testing import run_ranks

    bare = bare_rss_bytes()
    cache = os.path.join(os.path.dirname(path), "annot_cache")
    ranks = run_ranks(rank_load, args.pp * args.tp, path, args.pp, args.tp, cache, timeout=1800)
    plain = transformers_load(path)
    print(
        f"checkpoint {path}: {size / GIB:.2f} GiB float32; bare torch+transformers {bare / GIB:.2f} GiB"
    )
    print(
        f"{'':<24}{'peak RSS':>10}{'own params':>12}{'budget':>9}{'peak/budget':>13}{'load s':>8}"
    )
    for r, res in enumerate(ranks):
        budget = 1.2 * (res["own"] + bare)
        print(
            f"annot pp{args.pp} tp{args.tp} rank {r:<4}{res['peak'] / GIB:>9.2f}G"
            f"{res['own'] / GIB:>11.2f}G{budget / GIB:>8.2f}G{res['peak'] / budget:>13.2f}"
            f"{res['seconds']:>8.1f}"
        )
    budget = 1.2 * (plain["own"] + bare)
    for what, peak, seconds in (
        ("transformers, returned", plain["peak"], plain["seconds"]),
        ("transformers, all read", plain["read_peak"], plain["read_seconds"]),
    ):
        print(
            f"{what:<24}{peak / GIB:>9.2f}G{plain['own'] / GIB:>11.2f}G"
            f"{budget / GIB:>8.2f}G{peak / budget:>13.2f}{seconds:>8.1f}"
        )


if __name__ == "__main__":
    main()
