"""Vocab-sharded logits from a head submodule, the loss in the parent: at tp=2
the rewritten model's loss and gradients equal the single-device model's.

Before the fix the parent's ``F.cross_entropy`` was left as it was and got
each rank's ``vocab / 2`` columns (a wrong loss, or an out-of-bounds target).
"""

from __future__ import annotations

import pytest

from annot.testing import run_ranks

# float32, tiny model: the tolerance of the tp parity tests
RTOL, ATOL = 1e-5, 4e-5


def _parity_rank(cache_dir: str) -> dict:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache_dir

    import torch

    import annot
    from tests.sharded_logits_models import Top

    model = annot.parallelize(Top, 16, 32, mesh=annot.Mesh(tp=2), seed=0)
    torch.manual_seed(0)
    ref = Top(16, 32)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g)
    labels = torch.randint(0, 32, (2, 5), generator=g)
    labels[0, 0] = 31  # a class held only by the last rank

    logits, loss = model(x, labels)
    model.backward(loss)
    grads = model.full_grads()
    ref_logits, ref_loss = ref(x, labels)
    ref_loss.backward()

    assert logits.shape == (2, 5, 16), "each rank holds its vocab slice"
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=RTOL, atol=ATOL, msg=name)
    (record,) = [r for r in model.report.rewritten if r.original.__name__ == Top.__module__]
    return {"loss": loss.item(), "rewritten": "vocab_parallel_cross_entropy(" in record.source}


def test_head_submodule_loss_in_parent_matches_single_device_at_tp2(tmp_path):
    results = run_ranks(_parity_rank, 2, str(tmp_path / "cache"), timeout=300)
    assert all(r["rewritten"] for r in results)
    assert results[0]["loss"] == pytest.approx(results[1]["loss"])
