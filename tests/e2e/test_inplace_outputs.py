"""In-place ops on a parallel layer's output, as third-party models write
them: Falcon's parallel block adds its attention output into its MLP output
in place (``mlp_output += attention_output``). With ``bias=False`` the MLP's
output is the row-parallel layer's reduced tensor itself; it crashed with
"Output 0 of ReduceFromTP is a view and is being modified inplace". Now the
layer's output is safe for in-place ops, and the run equals the
single-device model (loss, logits, every gradient, every parameter after
AdamW steps)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from annot.testing import run_ranks


def _falcon_parallel_block(cache: str, built: bool):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import transformers

    import annot
    from annot import Col, Local, Row
    from tests.parity import train_against_reference

    cfg = transformers.FalconConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=True,  # mlp_output += attention_output
        alibi=False,
        bias=False,  # the row layers add no bias: their output is the reduced tensor
    )
    hints = {
        "**.self_attention.query_key_value": Col(),
        "**.self_attention.dense": Row(),
        "**.mlp.dense_h_to_4h": Col(),
        "**.mlp.dense_4h_to_h": Row(),
        "**.self_attention": Local("num_heads", "num_kv_heads"),
    }
    cls = transformers.FalconForCausalLM
    mesh = annot.Mesh(tp=2)
    if built:
        torch.manual_seed(0)
        model = annot.parallelize(cls(cfg), mesh=mesh, hints=hints, verify=True)
    else:
        model = annot.parallelize(cls, cfg, mesh=mesh, seed=0, hints=hints, verify=True)
    torch.manual_seed(0)
    ref = cls(cfg)

    def run(m, ids):
        out = m(ids, labels=ids, use_cache=False)
        return out.loss, {"logits": out.logits}

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    train_against_reference(model, ref, batches, run, "falcon bias=False tp=2", lr=1e-3)


@pytest.mark.parametrize(
    "built", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["class", "instance"]
)
def test_falcon_in_place_add_on_a_row_parallel_output(tmp_path, built):
    run_ranks(_falcon_parallel_block, 2, str(tmp_path), built, timeout=300)
