"""Megatron's communication pattern on a whole transformer block, as annot
rewrites it: exactly 2 all-reduces forward (after attention's and the MLP's
row-parallel projections) and 2 backward (into the column-parallel QKV and
MLP input projections), and the block equals the single-device block."""

import pytest

from annot.testing import run_ranks


def _block_counts(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import annot
    from examples.gpt.model import Block, GPTConfig
    from tests.parity import assert_close, compare_grads

    cfg = GPTConfig(n_head=4, n_embd=16, dropout=0.0)
    # verify=False: verification's own collectives would be counted; it runs below.
    # sample=: the pre-flight runs at build, not inside the first (counted) call.
    block = annot.parallelize(
        Block, cfg, mesh=annot.Mesh(tp=2), seed=0, verify=False, sample=(torch.zeros(2, 5, 16),)
    )
    torch.manual_seed(0)
    ref = Block(cfg)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    with CommDebugMode() as fwd:
        y = block(x)
    with CommDebugMode() as bwd:
        block.backward(y.square().sum())
    ref_y = ref(ref_x)
    ref_y.square().sum().backward()
    assert_close(y, ref_y, "block output")
    assert_close(x.grad, ref_x.grad, "block input grad")
    compare_grads(block, ref, "block")
    from annot.runtime.grads.reduce import check_replicated_grads

    check_replicated_grads(block.module, block.ctx)
    all_reduce = torch.ops.c10d.allreduce_
    return (
        dict(fwd.get_comm_counts()).get(all_reduce, 0),
        dict(bwd.get_comm_counts()).get(all_reduce, 0),
        sum(fwd.get_comm_counts().values()) + sum(bwd.get_comm_counts().values()),
    )


def test_two_all_reduces_forward_and_two_backward_per_block(tmp_path):
    for fwd, bwd, total in run_ranks(_block_counts, 2, str(tmp_path)):
        assert (fwd, bwd) == (2, 2)
        assert total == 4  # and no other collective


def _llama_backward_all_reduces(cache: str, n_layers: int) -> int:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from torch.distributed.tensor.debug import CommDebugMode
    from transformers import LlamaConfig, LlamaForCausalLM

    import annot

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64,
    )  # fmt: skip
    model = annot.parallelize(LlamaForCausalLM, cfg, mesh=annot.Mesh(tp=2), seed=0, verify=False)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids, use_cache=False).loss  # not counted: see below
    with CommDebugMode() as bwd:
        model.backward(loss)
    return dict(bwd.get_comm_counts()).get(torch.ops.c10d.allreduce_, 0)


@pytest.mark.slow  # CI's slow set; the fast set stays under 10 minutes
def test_hf_llama_block_reduces_its_input_gradients_twice_backward(tmp_path):
    """HF Llama keeps q/k/v and gate/up as separate layers; those reading one
    input share one backward all-reduce, so a block costs 2 (as Megatron's
    fused layers), not 5. The forward runs outside CommDebugMode, whose module
    tracker hands each layer a new input object. Parity with every gradient:
    tests/e2e/test_hf_tp_models.py."""
    one, two = (
        run_ranks(_llama_backward_all_reduces, 2, str(tmp_path / str(n)), n)[0] for n in (1, 2)
    )
    assert two - one == 2, (one, two)
