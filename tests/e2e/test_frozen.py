"""Frozen parameters in a pipeline, as fine-tuning freezes them: an embedding,
the lower or the upper layers (a last stage with nothing to train, whose
input gradients still reach the first), a weight tied across the stages.
Against the single device: the loss, every gradient (none where frozen) and
every parameter after AdamW over the trainable ones. A tied weight frozen
by one of its names only is refused on every rank that holds it: each stage
keeps a copy under its own name, and the copies must stay one parameter."""

from __future__ import annotations

import os

import pytest

from annot.testing import run_ranks


def _model(arch: str):
    from tests.tiny_hf import tiny_gpt2, tiny_llama

    return tiny_gpt2() if arch == "gpt2" else tiny_llama()


# which parameters each case freezes, by the names the user's loop sees
FROZEN = {
    "embedding and first layer": lambda n: "embed_tokens" in n or ".layers.0." in n,
    "the whole last stage": lambda n: not ("embed_tokens" in n or ".layers.0." in n or ".layers.1." in n),
    "tied weight by every name": lambda n: n.endswith(("transformer.wte.weight", "lm_head.weight")),
    "tied weight by one name": lambda n: n.endswith("transformer.wte.weight"),
}  # fmt: skip


def _train(cache: str, arch: str, case: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import assert_close, compare_state

    cls, cfg, split = _model(arch)
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(pp=2), seed=0, split=split)
    torch.manual_seed(0)
    ref = cls(cfg)
    for m in (model, ref):
        for name, p in m.named_parameters():
            if FROZEN[case](name):
                p.requires_grad_(False)
    frozen = {n for n, p in ref.named_parameters() if not p.requires_grad}
    assert frozen, case

    @annot.jit(model, microbatches=2)
    def step(ids):
        loss = model(ids, labels=ids).loss
        model.backward(loss)
        return loss

    mine = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(mine, lr=1e-2) if mine else None  # a stage with nothing to train
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for i in range(2):
        ids = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
        try:
            loss = step(ids).reduce_mean()
        except annot.AnnotError as err:
            return f"{type(err).__name__}: {err}"
        ref_loss = 0.0
        for part in ids.chunk(2):
            r = ref(part, labels=part).loss
            (r / 2).backward()
            ref_loss += r.detach() / 2
        assert_close(loss, ref_loss, f"{case} step {i}: loss")
        grads = model.full_grads()
        for name, p in ref.named_parameters():
            if name in frozen:
                assert grads.get(name) is None, f"{case}: frozen {name} got a gradient"
            else:
                assert_close(grads[name], p.grad, f"{case} step {i}: grad {name}")
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad()
    compare_state(model, ref, f"{case} after 2 AdamW steps")
    return sorted(frozen)


@pytest.mark.parametrize(
    "arch, case",
    [
        pytest.param("llama", "embedding and first layer", marks=pytest.mark.slow),
        pytest.param("llama", "the whole last stage", marks=pytest.mark.slow),
        pytest.param("gpt2", "tied weight by every name", marks=pytest.mark.slow),
    ],
)
def test_frozen_parameters_train_as_on_one_device(tmp_path, arch, case):
    for frozen in run_ranks(_train, 2, str(tmp_path), arch, case, timeout=300):
        assert isinstance(frozen, list), frozen


@pytest.mark.slow  # tests/runtime/grads/test_reduce.py refuses the disagreement in the fast suite
def test_a_tied_weight_frozen_by_one_of_its_names_is_refused(tmp_path):
    """GPT-2's head is its token embedding: on one device, freezing
    ``transformer.wte.weight`` freezes the head too; here stage 1 holds the
    copy as ``lm_head.weight``, which that name misses."""
    for err in run_ranks(_train, 2, str(tmp_path), "gpt2", "tied weight by one name"):
        assert err.startswith("PipelineError: the weight tied across pipeline stages "), err
        assert "transformer.wte.weight / lm_head.weight is trainable on pipeline rank(s) [1]" in err
        assert "p.requires_grad_(False)" in err
