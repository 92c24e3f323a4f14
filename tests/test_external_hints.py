"""A model the user cannot edit: hints from outside by module-path pattern,
given the class and its arguments or an already built instance; parity with
the single-device model on tp=2 and on pp=2 x tp=2. x-transformers' attention,
whose output projection each branch of an ``if`` builds by another call: the
hint follows the branch taken."""

import pytest

from annot.testing import run_ranks

HINTS = "layers.*.attn.qkv", "layers.*.attn.out", "layers.*.attn", "layers.*.up", "layers.*.down"


def _run(mode: str, pp: int, tp: int, cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from annot import Col, Local, Row, Vocab
    from tests.parity import train_pair_lm_against_reference
    from tests.thirdparty_models import TinyLM

    hints = {
        "embed": Vocab(),
        "head": Col(),
        "layers.*.attn.qkv": Col(chunks=3),
        "layers.*.attn.out": Row(),
        "layers.*.attn": Local("num_heads", "dim"),
        "layers.*.ff.up": Col(),
        "layers.*.ff.down": Row(),
    }
    split = ["layers.2"] if pp > 1 else None
    mesh = annot.Mesh(pp=pp, tp=tp)
    if mode == "instance":
        torch.manual_seed(0)
        model = annot.parallelize(TinyLM(), mesh=mesh, hints=hints, split=split)
    else:
        model = annot.parallelize(TinyLM, mesh=mesh, hints=hints, split=split, seed=0)
    torch.manual_seed(0)
    train_pair_lm_against_reference(model, TinyLM(), mode)
    return True


@pytest.mark.parametrize("mode", ["class", "instance"])
def test_external_hints_tp2(mode, tmp_path):
    assert run_ranks(_run, 2, mode, 1, 2, str(tmp_path)) == [True, True]


@pytest.mark.slow
def test_external_hints_instance_pp2_tp2(tmp_path):
    assert run_ranks(_run, 4, "instance", 2, 2, str(tmp_path), timeout=300) == [True] * 4


# ---- x-transformers: an attribute built by a different call in each branch ----------


def _x_hints() -> dict:
    from annot import Col, Local, Row

    return {
        "blocks.*.attn.to_q": Col(),
        "blocks.*.attn.to_kv": Col(chunks=2),
        "blocks.*.attn.to_out": Row(),  # nn.Linear in block 0, LinearNoBias in block 1
        "blocks.*.attn": Local("heads"),
    }


def _x_parity(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import train_against_reference
    from tests.thirdparty_models import XLM

    kinds = {}
    for built in (False, True):
        mesh = annot.Mesh(tp=2)
        if built:
            torch.manual_seed(0)
            model = annot.parallelize(XLM(), mesh=mesh, hints=_x_hints(), verify=True)
        else:
            model = annot.parallelize(XLM, mesh=mesh, hints=_x_hints(), seed=0, verify=True)
        torch.manual_seed(0)
        ref = XLM()
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 32, (2, 6), generator=g) for _ in range(2)]
        what = f"x-transformers tp=2 {'instance' if built else 'class'}"
        train_against_reference(model, ref, batches, lambda m, ids: (m(ids, ids), {}), what, 1e-2)
        out = [model.module.blocks[i].attn.to_out for i in range(2)]
        kinds[built] = [(type(m).__name__, m.bias is not None) for m in out]
    return kinds


def test_hint_follows_the_branch_taken_x_transformers(tmp_path):
    """``to_out=Row()`` on an attribute assigned ``nn.Linear(...)`` in one branch
    and ``LinearNoBias(...)`` in the other: each block's layer, whichever branch
    built it, is row-parallel, on the class path (the source rewrite) and on a
    built instance; loss and every gradient equal the single-device model."""
    kinds = run_ranks(_x_parity, 2, str(tmp_path), timeout=300)
    for k in kinds:
        for built in (False, True):
            assert k[built] == [("RowParallelLinear", True), ("RowParallelLinear", False)]


def _x_gated(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.thirdparty_models import XLM

    messages = []
    for built in (False, True):
        try:
            if built:
                torch.manual_seed(0)
                annot.parallelize(XLM(gate_out=True), mesh=annot.Mesh(tp=2), hints=_x_hints())
            else:
                annot.parallelize(
                    XLM, mesh=annot.Mesh(tp=2), hints=_x_hints(), seed=0, gate_out=True
                )
        except annot.AnnotError as e:
            messages.append((type(e).__name__, str(e)))
    return messages


def test_branch_building_what_annot_cannot_shard_is_refused(tmp_path):
    """``gate_out=True`` takes the branch that builds an ``nn.Sequential``:
    refused before any step, naming the module and the way out."""
    for messages in run_ranks(_x_gated, 2, str(tmp_path), timeout=300):
        assert len(messages) == 2, messages
        for kind, msg in messages:
            assert kind == "HintError"
            assert msg == (
                "@shard on XAttention (at blocks.0.attn): argument to_out=Row(): annot shards "
                "nn.Linear, HF Conv1D and nn.Embedding (and their subclasses) but "
                "XAttention.to_out is a Sequential; hint a layer inside it, or Replicate() it"
            )
