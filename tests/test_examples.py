"""The BERT and NCF examples equal their single-device models (real gloo ranks).

For each example: the tensor-parallel model (tp=2) and the pipelined model
(pp=2) trained for 3 AdamW steps through ``@annot.jit`` with 2 microbatches
give the single-device loss at every step, the single-device gradients, and
the single-device parameters afterwards (tied ones included), within the
float32 tolerance of :mod:`tests.parity`. And each ``train.py`` runs under
``torchrun --nproc-per-node 2`` for 2 steps, printing annot's loss equal to
the single-device loss it prints next to it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from annot.testing import run_ranks
from tests.requires import fsdp_unused_params

ROOT = Path(__file__).resolve().parents[1]
SEED = 7
STEPS = 3
MICROBATCHES = 2


# --------------------------------------------------------------------------- #
# The two workloads: a small config, batches, and how the step calls the model
# --------------------------------------------------------------------------- #


def _bert_case():
    import torch

    from examples.bert.model import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position=16,
        dropout=0.0,
    )
    g = torch.Generator().manual_seed(SEED)
    batch, seq, labelled = 4, 12, 2
    pos = torch.arange(seq)
    data = []
    for _ in range(STEPS):
        ids = torch.randint(2, cfg.vocab_size, (batch, seq), generator=g)  # (B, T)
        lengths = torch.tensor([[seq], [seq - 5], [seq - 2], [7]])  # (B, 1): some padding
        attention_mask = (pos < lengths).long()
        ids = ids.masked_fill(attention_mask == 0, cfg.pad_token_id)
        token_type_ids = ((pos >= lengths // 2) & (attention_mask == 1)).long()
        # the same number of labelled real positions in every row, so the mean over
        # microbatches is the mean over the batch
        score = torch.rand(batch, seq, generator=g).masked_fill(attention_mask == 0, 2.0)
        masked = torch.zeros(batch, seq, dtype=torch.bool)
        masked.scatter_(1, score.argsort(dim=1)[:, :labelled], True)
        labels = ids.masked_fill(~masked, -100)
        data.append((ids.masked_fill(masked, 1), attention_mask, token_type_ids, labels))

    def call(model, input_ids, attention_mask, token_type_ids, labels):
        return model(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels
        )

    sharded = {
        "embeddings.word_embeddings.weight": 0,
        "decoder.weight": 0,
        "decoder.bias": 0,
        "layers.0.attention.query.weight": 0,
        "layers.0.attention.out.weight": 1,
        "layers.0.mlp.fc_in.weight": 0,
        "layers.0.mlp.fc_out.weight": 1,
    }
    return BertForMaskedLM, cfg, data, call, sharded


def _ncf_case():
    import torch

    from examples.ncf.model import NCFConfig, NeuMF

    cfg = NCFConfig(num_users=16, num_items=24, gmf_dim=4, mlp_dim=8, mlp_layers=(8, 4))
    g = torch.Generator().manual_seed(SEED)
    data = []
    for _ in range(STEPS):
        users = torch.randint(0, cfg.num_users, (16,), generator=g)
        items = torch.randint(0, cfg.num_items, (16,), generator=g)
        labels = torch.randint(0, 2, (16,), generator=g).float()
        data.append((users, items, labels))
    users = torch.cat([d[0] for d in data])
    items = torch.cat([d[1] for d in data])
    # every tp rank's block of every table is looked up (and trained)
    assert (users < 8).any(), "the users do not span both shards"
    assert (users >= 8).any(), "the users do not span both shards"
    assert (items < 12).any(), "the items do not span both shards"
    assert (items >= 12).any(), "the items do not span both shards"

    def call(model, users, items, labels):
        return model(users, items, labels=labels)

    sharded = {
        "gmf_user.weight": 0,
        "gmf_item.weight": 0,
        "mlp_user.weight": 0,
        "mlp_item.weight": 0,
        "tower.0.fc1.weight": 0,
        "tower.0.fc2.weight": 1,
    }
    return NeuMF, cfg, data, call, sharded


CASES = {"bert": _bert_case, "ncf": _ncf_case}


# --------------------------------------------------------------------------- #
# Parity on gloo ranks
# --------------------------------------------------------------------------- #


def _parity(example: str, tp: int, pp: int, cache: str) -> tuple[list[float], tuple]:
    """On each rank: train annot's model and the plain one side by side; return
    annot's losses and the pipeline boundaries."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.parity import assert_close

    cls, cfg, data, call, sharded = CASES[example]()
    model = annot.parallelize(cls, cfg, mesh=annot.Mesh(tp=tp, pp=pp), seed=SEED)
    torch.manual_seed(SEED)
    ref = cls(cfg)
    full_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    if tp > 1:  # the hints took effect: this rank holds 1/tp of each sharded tensor
        local = dict(model.module.state_dict())
        for key, dim in sharded.items():
            want = list(full_shapes[key])
            want[dim] //= tp
            assert list(local[key].shape) == want, f"{key}: local shape {tuple(local[key].shape)}"
    boundaries: tuple = ()
    if pp > 1:  # this rank holds its stage only
        plan = model.pipeline
        assert plan is not None
        assert plan.num_stages == pp
        assert set(plan.local_keys) < set(full_shapes), "a stage holds the whole model"
        boundaries = plan.boundaries
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    @annot.jit(model, microbatches=MICROBATCHES)
    def train_step(*batch):
        _, loss = call(model, *batch)
        model.backward(loss)
        return loss

    losses = []
    for step, batch in enumerate(data):
        what = f"{example} tp={tp} pp={pp} step {step}"
        loss = train_step(*batch).reduce_mean()
        _, ref_loss = call(ref, *batch)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{what}: loss")
        grads = model.full_grads()
        for k, p in ref.named_parameters():
            assert_close(grads[k], p.grad, f"{what}: grad {k}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    full = model.full_state_dict()
    for k, v in ref.state_dict().items():  # tied keys included: both names are checked
        assert k in full, f"{example}: {k} missing from full_state_dict()"
        assert_close(full[k], v, f"{example} tp={tp} pp={pp} after {STEPS} steps: {k}")
    return losses, boundaries


@pytest.mark.parametrize("example", ["bert", "ncf"])
def test_tensor_parallel_parity(example, tmp_path):
    (losses0, _), (losses1, _) = run_ranks(_parity, 2, example, 2, 1, str(tmp_path), timeout=240)
    assert losses0 == losses1  # every tp rank computes the same loss
    assert len(losses0) == STEPS


@pytest.mark.parametrize("example", ["bert", "ncf"])
def test_pipeline_parallel_parity(example, tmp_path):
    (losses0, cuts), (losses1, _) = run_ranks(_parity, 2, example, 1, 2, str(tmp_path), timeout=240)
    assert losses0 == losses1  # the last stage's losses reach every rank
    assert len(losses0) == STEPS
    # auto placement cuts the encoder layers / the tower blocks
    # the planner balances parameters: NCF's four embedding tables fill stage 0 alone
    assert cuts == {"bert": ("layers.1",), "ncf": ("tower.0",)}[example]


# --------------------------------------------------------------------------- #
# The scripts, as a user runs them
# --------------------------------------------------------------------------- #

SCRIPTS = {
    "bert": [
        "--layers",
        "2",
        "--hidden",
        "32",
        "--vocab",
        "64",
        "--seq",
        "16",
        "--batch",
        "4",
        "--microbatches",
        "2",
    ],
    "ncf": ["--users", "32", "--items", "64", "--batch", "32", "--microbatches", "2"],
}
LINE = re.compile(r"step\s+(\d+) \| annot loss (\S+) \| single-device (\S+)")


def _train(example: str, nproc: int, args: list, tmp_path) -> str:
    """Run ``examples/<example>/train.py`` under torchrun on gloo ranks; check
    that it exits 0 and that its two steps' losses equal the single-device
    run's. Returns its stdout."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "examples" / example / "train.py"),
        "--steps",
        "2",
        *args,
    ]
    env = {
        **os.environ,
        "ANNOT_CACHE_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "ANNOT_BACKEND": "gloo",  # tests never need a GPU, and one GPU cannot host two NCCL ranks
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    steps = LINE.findall(proc.stdout)
    assert [s for s, _, _ in steps] == ["0", "1"], out
    for step, annot_loss, ref_loss in steps:
        assert abs(float(annot_loss) - float(ref_loss)) <= 1e-5, f"step {step}: {out}"
    return proc.stdout


@pytest.mark.parametrize("example", ["bert", "ncf"])
def test_train_script_tp2(example, tmp_path):
    _train(example, 2, ["--tp", "2", *SCRIPTS[example]], tmp_path)


@pytest.mark.slow  # 4 ranks
@fsdp_unused_params
def test_gpt_train_script_fsdp_dp2_pp2(tmp_path):
    # the main example with --fsdp: dp=2 replicas (FSDP2) of a 2-stage pipeline
    out = _train("gpt", 4, ["--pp", "2", "--fsdp", "--n-layer", "2", "--seq", "16"], tmp_path)
    assert "dp=2" in out, out
