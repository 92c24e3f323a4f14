"""x-transformers, installed, as its users build it: each layer an
``nn.ModuleList`` of (norms, block, residual), the norms a ModuleList too. A
stage given at a layer (a container, never called) begins at the first call
inside it, for a hand boundary as for the automatic split; the automatic
split needs no ``sample=`` (its placement is checked on the first call);
every gradient against the single-device model at pp2."""

import pytest

from annot.testing import run_ranks

pytest.importorskip("x_transformers")


def _make():
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(
        num_tokens=32, max_seq_len=16, attn_layers=Decoder(dim=16, depth=2, heads=4)
    )


def _run(split, sample: bool, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import train_lm_against_reference

    probe = torch.randint(0, 32, (2, 8)) if sample else None
    torch.manual_seed(0)
    model = annot.parallelize(_make(), mesh=annot.Mesh(pp=2), split=split, sample=probe)
    torch.manual_seed(0)
    step, batch = train_lm_against_reference(model, _make(), "pp=2", vocab=32)
    return list(model.pipeline.boundaries), step.explain(*batch)


def test_a_stage_given_at_a_layer_begins_at_its_first_call(tmp_path):
    # the layer 'attn_layers.layers.2' is a ModuleList (never called); its norm is called first
    boundaries, text = run_ranks(_run, 2, ["attn_layers.layers.2"], False, str(tmp_path))[0]
    assert boundaries == ["attn_layers.layers.2.0.0"]
    assert "'attn_layers.layers.2' at 'attn_layers.layers.2.0.0'" in text, text


@pytest.mark.slow  # (fast-set budget: verify_call_order's unit test is in the fast set)
@pytest.mark.parametrize("sample", [False, True], ids=["first call", "sample"])
def test_automatic_split_without_and_with_a_sample(sample, tmp_path):
    # without sample=: placed in registration order, checked on the first call
    boundaries, _ = run_ranks(_run, 2, None, sample, str(tmp_path))[0]
    assert boundaries[0].startswith("attn_layers.layers."), boundaries
