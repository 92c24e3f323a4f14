"""Context parallelism: activation memory per rank and step time against one
device (issue 47).

A Llama (4 layers, hidden 256, SDPA) trained one step on one batch:

- one device at sequence length L;
- cp=2 (``Mesh(dp=2, cp=2)``, 2 gloo ranks) at L: each rank half the tokens;
- cp=2 at 2L: twice the sequence, each rank as many tokens as one device at L.

Activation memory is what autograd saves for backward (every tensor a
``saved_tensors_hooks`` pack sees, by storage), the measure that scales with
the sequence; step time is the median of interleaved steps.

    python benchmarks/cp.py       # about a minute on 2 CPU cores
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=4096,
)
L, BATCH, STEPS = 512, 2, 5


def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``run()``."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.backward()
    return sum(seen.values())


def timed(run, steps: int = STEPS) -> float:
    import statistics

    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        run().backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _cp(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot

    cfg = transformers.LlamaConfig(**CONFIG)
    model = annot.parallelize(
        transformers.LlamaForCausalLM, cfg, mesh=annot.Mesh(dp=2, cp=2), seed=0
    )
    g = torch.Generator().manual_seed(0)
    out = {}
    for length in (L, 2 * L):
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, length), generator=g)

        def loss(ids=ids):
            return model(ids, labels=ids).loss

        out[length] = (saved_bytes(loss), timed(loss))
        model.zero_grad()
    return out


def main() -> None:
    import tempfile

    import torch
    import transformers

    from annot.testing import run_ranks

    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, L))
    base_bytes = saved_bytes(lambda: one(ids, labels=ids).loss)
    base_s = timed(lambda: one(ids, labels=ids).loss)
    with tempfile.TemporaryDirectory() as cache:
        cp = run_ranks(_cp, 2, cache, timeout=900)[0]
    print(
        f"Llama, 4 layers, hidden 256, batch {BATCH}; activation bytes saved for backward per rank"
    )
    print(f"{'':28}{'tokens/rank':>12}{'MiB/rank':>10}{'vs one':>8}{'step ms':>9}{'vs one':>8}")
    rows = [(f"one device, L={L}", L, base_bytes, base_s)]
    rows += [(f"cp=2, L={n}", n // 2, *cp[n]) for n in (L, 2 * L)]
    for name, tokens, nbytes, secs in rows:
        print(
            f"{name:28}{tokens:12d}{nbytes / 2**20:10.1f}{nbytes / base_bytes:8.2f}"
            f"{secs * 1e3:9.1f}{secs / base_s:8.2f}"
        )


if __name__ == "__main__":
    main()
