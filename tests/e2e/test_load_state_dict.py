"""A single-device state dict loaded into a pipelined model, as PyTorch users
write it (``model.load_state_dict(torch.load(path))``): each rank takes what
its stages hold (a tied weight stored once, as checkpoints store it, reaches
every stage's copy), and a dict whose names do not match is refused on every
rank, naming the keys: before, a pipeline loaded only the keys that matched,
so a dict with other names loaded nothing and said nothing."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks


def _load(cache: str, case: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import compare_state
    from tests.tiny_hf import tiny_gpt2

    cls, cfg, split = tiny_gpt2()
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(pp=2), seed=0, split=split)
    torch.manual_seed(1)  # other weights than the model's own (seed 0)
    ref = cls(cfg)
    sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # stored once
    if case.startswith("renamed"):  # saved from the inner model: no "transformer." prefix
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    try:
        result = model.load_state_dict(sd, strict=case != "renamed lenient")
    except annot.CheckpointError as err:
        return str(err)
    if case == "whole":
        compare_state(model, ref, "loaded")
        assert result.missing_keys == []
        return "equal"
    return sorted(result.missing_keys)


def test_a_single_device_state_dict_loads_into_the_stages(tmp_path):
    assert run_ranks(_load, 2, str(tmp_path), "whole") == ["equal", "equal"]


@pytest.mark.slow  # 11 s: keeps the README's test command under 10 minutes
def test_a_state_dict_with_other_names_is_refused_on_every_rank(tmp_path):
    for err in run_ranks(_load, 2, str(tmp_path), "renamed"):
        assert err.startswith("load_full_state_dict: the state dict lacks keys that pipeline")
        assert "rank 0: transformer.wte.weight, transformer.wpe.weight" in err
        assert "rank 1: transformer.h.2.ln_1.weight" in err
        assert "strict=False" in err
    missing = run_ranks(_load, 2, str(tmp_path), "renamed lenient")
    assert "transformer.wte.weight" in missing[0]
    assert "lm_head.weight" in missing[1]  # its other name was renamed too
