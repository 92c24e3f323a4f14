"""Sequence parallelism (Megatron-SP, ``parallelize(..., sequence_parallel=True)``)
on real gloo ranks: the norms and dropouts between the blocks' tp regions run
on sequence shards, and the loss, every gradient (the norms' summed over tp)
and every parameter after AdamW steps equal the single-device run; a block
costs exactly 2 all-gathers and 2 reduce-scatters forward and the same
backward, and no all-reduce."""

import os

import pytest
import torch

import annot
from annot.core.errors import HintError
from annot.testing import RanksFailed, run_ranks
from tests.hf.test_models_gpt2 import LLAMA_KW
from tests.runtime.tp.test_dropout import HINTS, Net, _batch


def _dropout_parity(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    from tests.parity import train_against_reference

    torch.manual_seed(0)
    model = annot.parallelize(
        Net(),
        mesh=annot.Mesh(tp=2),
        hints=HINTS,
        verify=True,
        sample=_batch(0)[:2],
        sequence_parallel=True,  # Net.blocks
    )
    torch.manual_seed(0)
    ref = Net()

    def run(m, batch):
        ids, targets, seed = batch
        torch.manual_seed(seed)
        return m(ids, targets), {}

    train_against_reference(model, ref, [_batch(s) for s in (1, 2)], run, "sp dropout", lr=1e-2)
    block = model.module.blocks[0]
    return (
        sorted(set(model.dropout.values())),  # the dims the dropout sites are split along
        # the attention gathers its input on entry; fc1, outside any region, itself
        [block.attn.qkv.sequence_gathered, block.fc1.sequence_gathered, block.fc1.sequence_dim],
        sorted(n for n, p in block.named_parameters() if getattr(p, "annot_grad_sum", None)),
    )


def test_dropout_and_norms_on_sequence_shards_equal_the_single_device_run(tmp_path):
    for dims, seq, summed in run_ranks(_dropout_parity, 2, str(tmp_path), timeout=240):
        # residual dropout on sequence shards (dim 1), the MLP's on its columns (dim 2)
        assert dims == [1, 2]
        assert seq == [True, False, 1]
        # the norm's weights and the row layers' biases see this rank's tokens only
        assert summed == ["attn.proj.bias", "fc2.bias", "ln.bias", "ln.weight"]


def _llama(n_layers: int, sp: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA_KW, "num_hidden_layers": n_layers})
    model = annot.parallelize(
        LlamaForCausalLM, cfg, mesh=annot.Mesh(tp=2), seed=0, verify=False, sequence_parallel=sp
    )
    torch.manual_seed(0)
    return model, LlamaForCausalLM(cfg)


def _llama_parity_and_counts(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    from torch.distributed.tensor.debug import CommDebugMode

    from annot.runtime.grads.reduce import check_replicated_grads
    from tests.parity import train_against_reference

    def run(m, ids):
        out = m(ids, labels=ids, use_cache=False)
        return out.loss, {"logits": out.logits}

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, LLAMA_KW["vocab_size"], (2, 8), generator=g) for _ in range(2)]
    model, ref = _llama(2, True)
    train_against_reference(model, ref, batches, run, "llama sp", lr=1e-3)
    check_replicated_grads(model.module, model.ctx)  # the summed norms agree on every rank

    counts = {}
    for n_layers in (1, 2):
        model, _ = _llama(n_layers, True)
        with CommDebugMode() as fwd:
            loss = model(batches[0], labels=batches[0], use_cache=False).loss
        with CommDebugMode() as bwd:
            model.backward(loss)
        counts[n_layers] = [
            {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
            for mode in (fwd, bwd)
        ]
    return counts


@pytest.mark.slow
def test_hf_llama_parity_and_two_gathers_two_scatters_per_block(tmp_path):
    for counts in run_ranks(_llama_parity_and_counts, 2, str(tmp_path), timeout=300):
        for one, two in zip(counts[1], counts[2]):  # forward, then backward
            block = {op: two.get(op, 0) - one.get(op, 0) for op in {*one, *two}}
            assert {op: n for op, n in block.items() if n} == {
                "_allgather_base_": 2,
                "_reduce_scatter_base_": 2,
            }, counts


class GatedMLP(torch.nn.Module):
    """A tp region whose replicated gate reads the region's input itself."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.gate = torch.nn.Linear(dim, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * torch.sigmoid(self.gate(x))


class Gated(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), GatedMLP(dim)) for _ in range(2)
        )

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _gated(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    hints = {"blocks.*.1.fc1": annot.Col(), "blocks.*.1.fc2": annot.Row()}
    x = torch.zeros(2, 4, 16)
    annot.parallelize(
        Gated(), mesh=annot.Mesh(tp=2), hints=hints, sample=(x,), sequence_parallel=True
    )


def test_a_replicated_module_reading_the_gathered_sequence_is_refused(tmp_path):
    """Its gradient is whole on every rank: the region's reduce-scatter would
    add it twice. Refused at build, by the pre-flight, naming it."""
    with pytest.raises(RanksFailed) as err:
        run_ranks(_gated, 2, str(tmp_path), timeout=240)
    for text in err.value.failures.values():
        assert "HintError: sequence_parallel: blocks.0.1.gate (Linear) reads the whole" in text


def _odd_length(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    model, _ = _llama(1, True)
    ids = torch.zeros(2, 7, dtype=torch.long)
    model(ids, labels=ids, use_cache=False)


@pytest.mark.slow
def test_a_sequence_that_does_not_divide_is_refused(tmp_path):
    with pytest.raises(RanksFailed) as err:
        run_ranks(_odd_length, 2, str(tmp_path), timeout=240)
    for text in err.value.failures.values():
        assert "HintError" in text
        assert "7 does not divide by 2" in text
        assert "model.layers.0" in text


def _mid_block(cache: str) -> str:
    os.environ["ANNOT_CACHE_DIR"] = cache
    with pytest.raises(HintError) as err:
        annot.parallelize(
            Net,
            mesh=annot.Mesh(pp=2, tp=2),
            hints=HINTS,
            seed=0,
            split=["blocks.0.fc1"],
            sequence_parallel=True,
        )
    return str(err.value)


@pytest.mark.slow
def test_a_pipeline_boundary_inside_a_sequence_parallel_block_is_refused(tmp_path):
    # (sequence parallelism across pipeline stages: tests/runtime/tp/test_dropout.py)
    assert (
        run_ranks(_mid_block, 4, str(tmp_path), timeout=240)
        == [
            "parallelize: the pipeline boundary 'blocks.0.fc1' lies inside the block 'blocks.0', "
            "which sequence_parallel= runs on sequence shards; a stage must hand whole blocks on. "
            "Put the boundary at a block ('blocks.0' or the next one), or leave the block out of "
            "sequence_parallel=[...]"
        ]
        * 4
    )
