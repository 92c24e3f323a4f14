"""What torch.compile buys, annot beside the plain model, in one run.

    python benchmarks/compile.py        # a few minutes on 2 CPU cores (inductor compiles)

HF Llama (4 layers, hidden 256, seq 64, batch 8; ``use_cache=False``, as in
training), a training step (forward, backward, AdamW), on 2 gloo ranks. Each
rank times, interleaved:

(a) the plain model in its process, eager vs ``torch.compile(model)``
    (inductor): the plain model's gain from compiling;
(b) annot at tp=2, eager vs ``parallelize(..., compile=True)`` (each block
    compiled after sharding, inductor): annot's gain.

Printed: the step times, each gain (eager / compiled), and annot's gain over
the plain model's (goal >= 1: compiling an annot model buys at least what it
buys the plain model). Before timing, each compiled model's loss is checked
against its eager twin. ``BENCH_BACKEND=aot_eager`` measures the trace alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.timing import time_pair  # noqa: E402

BACKEND = os.environ.get("BENCH_BACKEND", "inductor")
BATCH, SEQ = 8, 64


def _config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=SEQ,
    )  # fmt: skip


def _step(model, x, backward):
    import torch

    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step():
        backward(model(x, labels=x, use_cache=False).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _loss(model, x) -> float:
    import torch

    with torch.no_grad():
        return model(x, labels=x, use_cache=False).loss.item()


def _rank(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from transformers import LlamaForCausalLM

    import annot

    torch.set_num_threads(1)
    cfg = _config()
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    plain_c = torch.compile(LlamaForCausalLM(cfg), backend=BACKEND)
    assert abs(_loss(plain, x) - _loss(plain_c, x)) < 1e-4
    pe, pc = time_pair(
        _step(plain, x, lambda t: t.backward()), _step(plain_c, x, lambda t: t.backward())
    )

    mesh = annot.Mesh(tp=2)
    eager = annot.parallelize(LlamaForCausalLM, cfg, mesh=mesh, seed=0)
    comp = annot.parallelize(LlamaForCausalLM, cfg, mesh=mesh, seed=0, compile={"backend": BACKEND})
    assert abs(_loss(eager, x) - _loss(comp, x)) < 1e-4
    ae, ac = time_pair(_step(eager, x, eager.backward), _step(comp, x, comp.backward))
    return {"plain": (pe, pc), "annot": (ae, ac), "blocks": comp.compiled_blocks}


def main() -> None:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        got = run_ranks(_rank, 2, cache, timeout=1800)[0]
    pe, pc = got["plain"]
    ae, ac = got["annot"]
    print(
        f"torch.compile backend={BACKEND}; annot compiled {got['blocks'] or 'nothing'} per rank ('': the whole model)"
    )
    print(f"{'':28}{'eager ms':>10}{'compiled ms':>13}{'gain':>8}")
    print(f"{'(a) plain model, 1 process':28}{pe * 1e3:10.1f}{pc * 1e3:13.1f}{pe / pc:8.3f}")
    print(f"{'(b) annot tp=2, per rank':28}{ae * 1e3:10.1f}{ac * 1e3:13.1f}{ae / ac:8.3f}")
    print(f"annot's gain / the plain model's gain: {(ae / ac) / (pe / pc):.3f} (goal >= 1)")


if __name__ == "__main__":
    main()
