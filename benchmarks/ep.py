"""Expert parallelism against tensor parallelism on one MoE model, and against
a hand-written all-to-all MoE layer (issue 47).

A Qwen3-MoE-style model (8 experts, top-2) on 2 gloo ranks, the same global
batch per step, timed side by side (interleaved, medians):

- ep=2 (``Mesh(dp=2, ep=2)``): each rank its half of the batch and half the
  experts, tokens to their experts by all-to-all;
- tp=2 (``Mesh(tp=2)``): each rank the whole batch, every expert split in two;
- dp=2 (``Mesh(dp=2)``): each rank its half of the batch and every expert.

Then the MoE layer alone (router, dispatch, experts, combine; forward and
backward) under annot's ep against the same layer written by hand in plain
torch.distributed (sort by expert, ``all_to_all_single``, a loop over the local
experts, ``all_to_all_single`` back), on the same weights and tokens.

    python benchmarks/ep.py       # about a minute on 2 CPU cores
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=128,
)
BATCH, SEQ = 8, 64


def _hand_moe(block, x):
    """The MoE block written by hand: its router, then the experts over ep by
    all_to_all_single (torch.distributed.nn: differentiable)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single

    experts = block.experts
    ep, local = dist.get_world_size(), experts.gate_up_proj.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    _, weights, index = block.gate(flat)
    order = torch.argsort(index.reshape(-1), stable=True)
    expert = index.reshape(-1)[order]
    send = torch.bincount(expert // local, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    s, r = send.tolist(), recv.tolist()
    token = order // index.shape[-1]
    rows = all_to_all_single(flat.new_empty(sum(r), flat.shape[-1]), flat[token], r, s)
    ids = torch.empty(sum(r), dtype=expert.dtype)
    dist.all_to_all_single(ids, (expert % local).contiguous(), r, s)
    out = torch.zeros_like(rows)
    for e in range(local):
        pick = (ids == e).nonzero().squeeze(1)
        gate, up = torch.nn.functional.linear(rows[pick], experts.gate_up_proj[e]).chunk(2, -1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e])
        out = out.index_add(0, pick, y)
    back = all_to_all_single(flat.new_empty(sum(s), flat.shape[-1]), out, s, r)
    w = weights.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(flat).index_add(0, token, back * w).view_as(x)


def _bench(cache: str) -> dict:
    os.environ["ANNOT_CACHE_DIR"] = cache
    import warnings

    # torch.distributed.nn's all_to_all_single warns in 2.13; it is still the differentiable one
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import transformers

    import annot
    from benchmarks.timing import time_pair

    cfg = transformers.Qwen3MoeConfig(**CONFIG)
    cls = transformers.Qwen3MoeForCausalLM
    ep = annot.parallelize(cls, cfg, mesh=annot.Mesh(dp=2, ep=2), seed=0)
    tp = annot.parallelize(cls, cfg, mesh=annot.Mesh(tp=2), seed=0)
    dp = annot.parallelize(cls, cfg, mesh=annot.Mesh(dp=2), seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    half = ids.chunk(2)[ep.ctx.dp_rank]

    def step(model, batch):
        def run():
            model(batch, labels=batch, use_cache=False).loss.backward()
            model.finish_gradients()
            model.zero_grad()

        return run

    t_ep, t_tp = time_pair(step(ep, half), step(tp, ids), steps=8, warmup=2)
    t_ep2, t_dp = time_pair(step(ep, half), step(dp, half), steps=8, warmup=2)

    def expert_bytes(model):
        return sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
        )

    block = ep.module.model.layers[0].mlp
    x = torch.randn(BATCH // 2, SEQ, CONFIG["hidden_size"], generator=g, requires_grad=True)

    def layer(fn):
        def run():
            with annot.runtime.process_groups.use(ep.ctx):
                fn(x).sum().backward()

        return run

    t_annot, t_hand = time_pair(
        layer(block), layer(lambda h: _hand_moe(block, h)), steps=10, warmup=2
    )
    return {
        "ep_s": t_ep,
        "tp_s": t_tp,
        "ep_bytes": expert_bytes(ep),
        "tp_bytes": expert_bytes(tp),
        "dp_bytes": expert_bytes(dp),
        "ep_over_dp": t_ep2 / t_dp,
        "layer_annot_s": t_annot,
        "layer_hand_s": t_hand,
    }


def main() -> None:
    import tempfile

    import annot.runtime.process_groups  # noqa: F401  (the ranks use it by name)
    from annot.testing import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        r = run_ranks(_bench, 2, cache, timeout=600)[0]
    print(
        "Qwen3-MoE-style, 8 experts top-2, 2 layers, hidden 128; batch 8 x 64 per step; 2 gloo ranks"
    )
    print(f"{'':32}{'ep=2':>8}{'tp=2':>8}{'dp=2':>8}{'ep/tp':>7}{'ep/dp':>7}")
    print(
        f"{'step time (ms)':32}{r['ep_s'] * 1e3:8.1f}{r['tp_s'] * 1e3:8.1f}{'':8}"
        f"{r['ep_s'] / r['tp_s']:7.2f}{r['ep_over_dp']:7.2f}"
    )
    kib = [r[k] / 1024 for k in ("ep_bytes", "tp_bytes", "dp_bytes")]
    print(
        f"{'expert weights per rank (KiB)':32}{kib[0]:8.0f}{kib[1]:8.0f}{kib[2]:8.0f}"
        f"{kib[0] / kib[1]:7.2f}{kib[0] / kib[2]:7.2f}"
    )
    print(
        f"MoE layer fwd+bwd at ep=2: annot {r['layer_annot_s'] * 1e3:.1f} ms, "
        f"hand-written all-to-all {r['layer_hand_s'] * 1e3:.1f} ms, "
        f"annot/hand {r['layer_annot_s'] / r['layer_hand_s']:.2f}"
    )


if __name__ == "__main__":
    main()
