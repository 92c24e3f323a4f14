"""Tensor parallelism, side by side in one run; prints ratios (this machine is noisy).

    python benchmarks/tp.py            # about a minute on 2 CPU cores

(a) annot at tp=1 vs the plain model: the overhead of annot's layers (goal <= 1.02)
(b) annot at tp=2 vs torch.distributed.tensor.parallel (DTensor) parallelize_module
    with ColwiseParallel / RowwiseParallel on the same model: step time (goal <= 0.8)
(c) rewriting a large model file vs a bare libcst parse + codegen of it (goal <= 1.5)
(d) JIT: parallelize() with a warm rewrite cache vs the first rewrite
(e) HF GPT-2 with dropout 0.1 at tp=2: each rank's slice of the single-device masks
    (annot's default, exact) vs per-rank masks of the local shape (the cost of exactness)
(f) HF Llama at tp=2, zero hints (its tp plan) vs DTensor parallelize_module with the
    same plan: step time; and annot's share of the ideal, half the step of the plain
    model in one process
(g) the same with sequence parallelism: annot's sequence_parallel=True vs DTensor's
    SequenceParallel / PrepareModuleInput plan (torchtitan's), step time
(h) HF Llama at tp=2: annot with Megatron's backward overlap (the weight gradient of
    the last column layer reading an input computed while that input's gradient is
    all-reduced; annot's default) vs annot without it (overlap_backward=False on every
    column layer: autograd's order), step time

Each timing is the median of interleaved repeats (annot, peer, annot, peer, ...).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.timing import time_pair  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "20"))
BATCH, SEQ = 8, 64


def _step_fn(model, opt, x, y, backward):
    def step():
        loss = model(x, y)
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_tp1() -> tuple[float, float]:
    import torch

    import annot
    from benchmarks.bench_models import BenchConfig, BenchGPT

    torch.set_num_threads(1)
    cfg = BenchConfig()
    model = annot.parallelize(BenchGPT, cfg, mesh=annot.Mesh(tp=1), seed=0)
    torch.manual_seed(0)
    plain = BenchGPT(cfg)
    x = torch.randint(0, cfg.vocab, (BATCH, SEQ))
    y = torch.randint(0, cfg.vocab, (BATCH, SEQ))
    a = _step_fn(model, torch.optim.AdamW(model.parameters()), x, y, model.backward)
    b = _step_fn(plain, torch.optim.AdamW(plain.parameters()), x, y, lambda loss: loss.backward())
    return time_pair(a, b)


def _tp2_rank(cache: str) -> tuple[float, float]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import annot
    from benchmarks.bench_models import BenchConfig, BenchGPT

    tp = dist.get_world_size()
    cfg = BenchConfig()
    model = annot.parallelize(BenchGPT, cfg, mesh=annot.Mesh(tp=tp), seed=0)
    torch.manual_seed(0)
    peer = BenchGPT(cfg)
    dmesh = init_device_mesh("cpu", (tp,))
    plan = {}
    for i in range(cfg.n_layer):
        plan.update(
            {
                f"layers.{i}.attn.wq": ColwiseParallel(),
                f"layers.{i}.attn.wk": ColwiseParallel(),
                f"layers.{i}.attn.wv": ColwiseParallel(),
                f"layers.{i}.attn.wo": RowwiseParallel(),
                f"layers.{i}.ffn.up": ColwiseParallel(),
                f"layers.{i}.ffn.down": RowwiseParallel(),
            }
        )
    parallelize_module(peer, dmesh, plan)
    for layer in peer.layers:  # what DTensor users edit by hand (torchtitan does the same)
        layer.attn.n_head //= tp
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=g)
    y = torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=g)
    a = _step_fn(model, torch.optim.AdamW(model.parameters()), x, y, model.backward)
    b = _step_fn(
        peer,
        torch.optim.AdamW(peer.parameters(), foreach=False),
        x,
        y,
        lambda loss: loss.backward(),
    )
    ta, tb = time_pair(a, b)
    with torch.no_grad():  # same math: the two losses agree
        la, lb = model(x, y).item(), peer(x, y).item()
    assert abs(la - lb) < 1e-4 * max(1.0, abs(lb)), (la, lb)
    return ta, tb


def bench_tp2() -> tuple[float, float]:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_tp2_rank, 2, cache, timeout=600)
    return max(r[0] for r in res), max(r[1] for r in res)


def _hf_step(model, x):
    """A training step of an annot-built transformers LM on ``x`` (its own labels)."""
    import torch

    opt = torch.optim.AdamW(model.parameters())

    def step():
        model.backward(model(x, labels=x, use_cache=False).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _dropout_rank(cache: str) -> tuple[float, float]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot

    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=8, vocab_size=512, n_positions=SEQ,
        attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1,
    )  # fmt: skip
    hints = {
        "transformer.h.*.attn.c_attn": annot.Col(chunks=3),
        "transformer.h.*.attn.c_proj": annot.Row(),
        "transformer.h.*.attn": annot.Local("split_size"),
        "transformer.h.*.mlp.c_fc": annot.Col(),
        "transformer.h.*.mlp.c_proj": annot.Row(),
    }
    mesh = annot.Mesh(tp=2)
    cls = transformers.GPT2LMHeadModel
    exact = annot.parallelize(cls, cfg, mesh=mesh, seed=0, hints=hints)
    local = annot.parallelize(cls, cfg, mesh=mesh, seed=0, hints=hints)
    assert exact.dropout
    local.dropout = {}  # every dropout draws a mask of this rank's shape
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)

    return time_pair(_hf_step(exact, x), _hf_step(local, x))


def bench_dropout() -> tuple[float, float]:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_dropout_rank, 2, cache, timeout=600)
    return max(r[0] for r in res), max(r[1] for r in res)


def _llama_config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=SEQ,
    )  # fmt: skip


def _dtensor_llama_plan(n_layers: int, sp: bool) -> dict:
    """HF Llama's tp plan for parallelize_module; with ``sp`` torchtitan's
    sequence-parallel form of it (norms on sequence shards, the attention and
    MLP inputs gathered on entry, the row layers' outputs reduce-scattered)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    shard = {"output_layouts": Shard(1), "use_local_output": False} if sp else {}
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **shard),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()
        ),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    for i in range(n_layers):
        p = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(**shard)
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel(**shard)
        if sp:
            plan[f"{p}.input_layernorm"] = SequenceParallel()
            plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{p}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan[f"{p}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


def _llama_rank(cache: str, sp: bool) -> tuple[float, float]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaForCausalLM

    import annot

    tp = dist.get_world_size()
    cfg = _llama_config()
    model = annot.parallelize(
        LlamaForCausalLM, cfg, mesh=annot.Mesh(tp=tp), seed=0, sequence_parallel=sp
    )
    torch.manual_seed(0)
    peer = LlamaForCausalLM(cfg)
    parallelize_module(peer, init_device_mesh("cpu", (tp,)), _dtensor_llama_plan(4, sp))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)

    def step_of(m, opt, backward):
        def step():
            backward(m(x, labels=x, use_cache=False).loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    a = step_of(model, torch.optim.AdamW(model.parameters()), model.backward)
    b = step_of(peer, torch.optim.AdamW(peer.parameters(), foreach=False), lambda t: t.backward())
    ta, tb = time_pair(a, b)
    with torch.no_grad():  # same math: the two losses agree
        la = model(x, labels=x, use_cache=False).loss.item()
        lb = peer(x, labels=x, use_cache=False).loss.item()
    assert abs(la - lb) < 1e-4 * max(1.0, abs(lb)), (la, lb)
    return ta, tb


def _overlap_rank(cache: str) -> tuple[float, float]:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import annot
    from annot.runtime.tp.layers import ColumnParallelLinear

    tp = dist.get_world_size()
    cfg = _llama_config()
    models = [
        annot.parallelize(LlamaForCausalLM, cfg, mesh=annot.Mesh(tp=tp), seed=0) for _ in range(2)
    ]
    for m in models[1].modules():
        if isinstance(m, ColumnParallelLinear):
            m.overlap_backward = False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)

    return time_pair(_hf_step(models[0], x), _hf_step(models[1], x))


def bench_overlap() -> tuple[float, float]:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_overlap_rank, 2, cache, timeout=600)
    return max(r[0] for r in res), max(r[1] for r in res)


def _llama_alone() -> float:
    """The plain model's step in one process of its own: twice that rate is
    the ideal at tp=2."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = _llama_config()
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def step():
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_pair(step, step)[0]


def bench_llama_alone() -> float:
    from annot.testing import run_ranks

    return run_ranks(_llama_alone, 1, timeout=600)[0]


def bench_llama(sp: bool) -> tuple[float, float]:
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        res = run_ranks(_llama_rank, 2, cache, sp, timeout=600)
    return max(r[0] for r in res), max(r[1] for r in res)


def _large_source(copies: int = 60) -> str:
    base = (ROOT / "examples" / "gpt" / "model.py").read_text()
    head, _, body = base.partition("from annot import Col, Row, Vocab, shard, stage\n")
    parts = [head + "from annot import Col, Row, Vocab, shard, stage\n"]
    for i in range(copies):
        b = body
        for name in ("LayerNorm", "CausalSelfAttention", "MLP", "Block", "GPTConfig", "GPT"):
            b = b.replace(f"class {name}(", f"class {name}{i}(").replace(
                f"{name}(config", f"{name}{i}(config"
            )
        parts.append(b)
    return "\n".join(parts)


def bench_rewrite() -> tuple[float, float, int]:
    import libcst as cst

    from annot.rewriters.tp.rewrite import rewrite_tensor_parallel

    src = _large_source()
    ta, tb = [], []
    for _ in range(3):
        t = time.perf_counter()
        rewrite_tensor_parallel(src, 2, path="large_model.py")
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        _ = cst.parse_module(src).code
        tb.append(time.perf_counter() - t)
    return min(ta), min(tb), src.count("\n")


def bench_cache() -> tuple[float, float]:
    import annot
    from annot.rewrite_cache import last_rewritten
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ANNOT_CACHE_DIR"] = cache
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(tp=1), seed=0)
        first = sum(r.seconds for r in last_rewritten())
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(tp=1), seed=0)
        hit = sum(r.seconds for r in last_rewritten())
        assert all(r.hit for r in last_rewritten())
    return first, hit


def main() -> None:
    rows = []
    a, b = bench_tp1()
    rows.append(("(a) annot tp=1 / plain model, step", a, b, a / b, "<= 1.02"))
    a, b = bench_tp2()
    rows.append(("(b) annot tp=2 / DTensor tp=2, step", a, b, a / b, "<= 0.80"))
    a, b, lines = bench_rewrite()
    rows.append((f"(c) rewrite / libcst parse+codegen ({lines} lines)", a, b, a / b, "<= 1.5"))
    a, b = bench_cache()
    rows.append(("(d) JIT rewrite cache hit / first rewrite", b, a, b / a, "(lower is better)"))
    a, b = bench_dropout()
    rows.append(("(e) GPT-2 dropout tp=2: exact / per-rank masks", a, b, a / b, "(cost of exact)"))
    a, b = bench_llama(sp=False)
    rows.append(("(f) HF Llama tp=2: annot / DTensor, step", a, b, a / b, "<= 0.60 (issue 10)"))
    one = bench_llama_alone()
    rows.append(
        ("(f) ideal (one process / 2) / annot tp=2, step", one / 2, a, one / 2 / a, ">= 0.6")
    )
    a, b = bench_llama(sp=True)
    rows.append(("(g) HF Llama tp=2 + SP: annot / DTensor, step", a, b, a / b, "(lower is better)"))
    a, b = bench_overlap()
    rows.append(("(h) HF Llama tp=2: backward overlap on / off", a, b, a / b, "(lower is better)"))
    print(f"{'measurement':52} {'annot':>10} {'peer':>10} {'ratio':>7}  goal")
    for name, x, y, r, goal in rows:
        print(f"{name:52} {x * 1000:9.2f}ms {y * 1000:9.2f}ms {r:7.3f}  {goal}")


if __name__ == "__main__":
    main()
