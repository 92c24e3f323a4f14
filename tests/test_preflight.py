"""The tp pre-flight (annot.preflight): hints that would crash are refused
before any collective, naming the module and its hints; good hints pass."""

from __future__ import annotations

import pytest
import torch

from annot.specs import Col, Local, Row
from annot.testing import run_ranks
from tests.nested_models import TimmStyleViT

GOOD = {
    "blocks.*.attn.qkv": Col(chunks=3),
    "blocks.*.attn.proj": Row(),
    "blocks.*.attn": Local("heads", "C"),
    "blocks.*.mlp.fc1": Col(),
    "blocks.*.mlp.fc2": Row(),
}
SWAPPED = {**GOOD, "blocks.*.mlp.fc1": Row(), "blocks.*.mlp.fc2": Col()}
HEADS_GLOBAL = {k: v for k, v in GOOD.items() if k != "blocks.*.attn"}


def _build_and_call(hints: dict, with_sample: bool, built: bool, pp: int = 1) -> str:
    """At ``pp`` > 1 the blocks are cut in two and the model runs in a jit step."""
    import annot

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # same on every rank
    model = TimmStyleViT if not built else TimmStyleViT()
    try:
        par = annot.parallelize(
            model,
            mesh=annot.Mesh(tp=2, pp=pp),
            hints=hints,
            seed=0 if not built else None,
            sample=(x,) if with_sample else None,
            split=["blocks.2"] if pp > 1 else None,
        )
        if pp > 1:

            @annot.jit(par, microbatches=2)
            def step(x):
                out = par(x)
                par.backward(out.square().mean())
                return out

            out = step(x).concat()
        else:
            out = par(x)
    except annot.AnnotError as err:  # HintError, or a pipeline peer's RankFailure naming it
        return f"{type(err).__name__}: {err}"
    return f"ran: {tuple(out.shape)}"


@pytest.mark.parametrize("with_sample", [True, False], ids=["at-build", "first-call"])
def test_swapped_col_row_refused_naming_the_module(with_sample):
    msgs = run_ranks(_build_and_call, 2, SWAPPED, with_sample, False)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith(
        "HintError: tp pre-flight: at tp=2, this rank's model fails in 'blocks.0.mlp.fc1' "
        "(RowParallelLinear) on meta tensors of the sample's shapes, where the "
        "single-device model runs:\n"
    )
    assert "    blocks.0.mlp.fc1: Row()\n    blocks.0.mlp.fc2: Col()\n" in msgs[0]
    assert "a Col()/Row() pair in the wrong order" in msgs[0]


@pytest.mark.slow
def test_swapped_col_row_refused_on_every_pipeline_stage():
    """tp=2 × pp=2: each rank checks its tp shard of every stage, so the stage
    that holds the swapped pair and the one that does not refuse alike, at
    build and on the first call of a jit step; good hints run."""
    refusal = "tp pre-flight: at tp=2, this rank's model fails in 'blocks.0.mlp.fc1' "
    msgs = run_ranks(_build_and_call, 4, SWAPPED, True, False, 2)
    assert msgs == [f"HintError: {refusal}" + msgs[0].split(refusal)[1]] * 4
    # on the first call, stage 0 refuses as its forward starts and stage 1,
    # waiting for its activations, stops with an error naming it
    first, _, second, _ = run_ranks(_build_and_call, 4, SWAPPED, False, False, 2)
    assert first.startswith(f"HintError: {refusal}")
    assert second.startswith("RankFailure: rank ") and f"HintError: {refusal}" in second
    assert run_ranks(_build_and_call, 4, GOOD, True, False, 2)[2:] == ["ran: (2, 5)"] * 2


def test_head_count_left_global_refused_on_a_built_model():
    msg = run_ranks(_build_and_call, 2, HEADS_GLOBAL, False, True)[0]
    assert msg.startswith(
        "HintError: tp pre-flight: at tp=2, this rank's model fails in 'blocks.0.attn'"
    )
    assert "    blocks.0.attn.qkv: Col(chunks=3)\n    blocks.0.attn.proj: Row()\n" in msg
    assert "name it in Local(...)" in msg


def test_good_hints_pass():
    assert run_ranks(_build_and_call, 2, GOOD, True, False) == ["ran: (2, 5)"] * 2
    assert run_ranks(_build_and_call, 2, GOOD, False, True) == ["ran: (2, 5)"] * 2


def test_a_model_that_fails_on_meta_alone_is_not_refused():
    """Value reads the meta run cannot answer fail the reference too: the
    pre-flight has nothing to compare, says nothing, and the real run decides."""
    from annot.preflight import preflight

    class ReadsValues(torch.nn.Module):
        def forward(self, x):
            return x[: int(torch.nonzero(x).shape[0])]

    preflight(ReadsValues(), (torch.ones(3),), {}, ref=ReadsValues(), ctx=None, specs={}, paths={})
