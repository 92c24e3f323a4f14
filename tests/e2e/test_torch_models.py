"""Models torch itself defines, as a user finds them: torch's DTensor test
Transformer (``torch.testing._internal``), hinted with its own tp plan as
annot hints; ``nn.TransformerEncoder`` split automatically at pp2 without
``sample=`` (its placement checked on the first call). At tp2 without hints, the hints annot reads off its sources are
that plan. A class of a ``torch.*`` module is rewritten like any other when
a hint or the stage split asks for it; its ``Local("n_heads")`` is applied,
never dropped. Every gradient against the single-device model at tp2, pp2
(hand and automatic) and tp2 x pp2."""

import pytest
import torch

from annot.testing import run_ranks

pytest.importorskip("expecttest")  # torch's test modules import it


def _run(pp: int, tp: int, split, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import annot
    from annot import Col, Local, Row
    from annot.plan.inferred_hints import infer_hints
    from tests.parity import train_lm_against_reference

    args = ModelArgs(n_layers=4, vocab_size=32, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)
    hints = {  # Transformer.parallelize's plan (no sequence parallel), as annot hints
        "layers.*.attention.wq": Col(),
        "layers.*.attention.wk": Col(),
        "layers.*.attention.wv": Col(),
        "layers.*.attention.wo": Row(),
        "layers.*.attention": Local("n_heads"),
        "layers.*.feed_forward.w1": Col(),
        "layers.*.feed_forward.w2": Row(),
    }
    mesh = annot.Mesh(pp=pp, tp=tp)
    if tp > 1 and pp == 1:  # no hints: these are what annot reads off the sources
        assert infer_hints(Transformer(args)).hints == hints
        hints = None
    model = annot.parallelize(
        Transformer, args, mesh=mesh, hints=hints if tp > 1 else None, split=split, seed=0
    )
    torch.manual_seed(0)
    train_lm_against_reference(model, Transformer(args), f"pp={pp} tp={tp}", vocab=32)
    return True


def test_torch_test_transformer_tp2(tmp_path):
    assert run_ranks(_run, 2, 1, 2, None, str(tmp_path)) == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("split", [["layers.2"], None], ids=["hand", "auto"])
def test_torch_test_transformer_pp2(split, tmp_path):
    assert run_ranks(_run, 2, 2, 1, split, str(tmp_path)) == [True, True]


@pytest.mark.slow
def test_torch_test_transformer_pp2_tp2(tmp_path):
    assert run_ranks(_run, 4, 2, 2, None, str(tmp_path), timeout=300) == [True] * 4


class Encoder(torch.nn.Module):
    """Token ids -> ``nn.TransformerEncoder`` (torch's own, its forward and its
    layers' as torch writes them) -> logits."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(
            width,
            4,
            2 * width,
            dropout=0.0,
            batch_first=True,
            bias=False,  # (a k bias: grad 0)
        )
        self.encoder = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def _encoder(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import train_lm_against_reference

    model = annot.parallelize(Encoder, mesh=annot.Mesh(pp=2), seed=0)
    torch.manual_seed(0)
    train_lm_against_reference(model, Encoder(), "pp=2 automatic", vocab=32)
    return list(model.pipeline.boundaries), model.report.runner


@pytest.mark.slow
def test_torch_transformer_encoder_pp2_automatic_without_a_sample(tmp_path):
    boundaries, runner = run_ranks(_encoder, 2, str(tmp_path))[0]
    assert boundaries == ["encoder.layers.2"]
    assert runner == "replay"  # cut at run time: nn.TransformerEncoder's loop is torch's
