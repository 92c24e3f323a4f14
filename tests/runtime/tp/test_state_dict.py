"""Full state dicts into and out of a tensor-parallel model.

``Tiny`` is written twice in one class, the way the tp rewriter would emit it:
the reference uses ``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy``,
the tp version the runtime layers, with the same attribute names (so the same
keys). It has everything the state-dict code must handle: a fused QKV
(``chunks=3``), a row layer with a replicated bias, a vocab-parallel
embedding tied to a column-parallel head, a raw parameter sharded with
``shard_parameter``, a LayerNorm and a persistent buffer.
"""

import copy
import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from annot.core.errors import CheckpointError, MeshError
from annot.core.mesh import Mesh
from annot.runtime.process_groups import ParallelContext, use
from annot.runtime.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedParameter,
    VocabParallelEmbedding,
    shard_parameter,
)
from annot.runtime.tp.state_dict import full_grads, full_state_dict, load_full_state_dict
from annot.runtime.tp.vocab_loss import vocab_parallel_cross_entropy
from annot.testing import run_ranks

RTOL, ATOL = 1e-5, 4e-5  # float32, written down once


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


class Tiny(nn.Module):
    """A one-block GPT. ``tp=None`` is the single-device reference."""

    def __init__(self, vocab=16, d=8, n_head=2, tp=None):
        super().__init__()
        par = tp is not None
        t = tp or 1
        self.n_head, self.d = n_head // t, d // t  # local head count and width
        self.wte = VocabParallelEmbedding(vocab, d, tp=t) if par else nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.qkv = ColumnParallelLinear(d, 3 * d, chunks=3, tp=t) if par else nn.Linear(d, 3 * d)
        self.proj = RowParallelLinear(d, d, tp=t) if par else nn.Linear(d, d)
        self.fc = ColumnParallelLinear(d, 4 * d, tp=t) if par else nn.Linear(d, 4 * d)
        gain = nn.Parameter(1 + 0.1 * torch.randn(4 * d))
        self.gain = shard_parameter(gain, dim=0, tp=t) if par else gain
        self.out = RowParallelLinear(4 * d, d, tp=t) if par else nn.Linear(4 * d, d)
        self.head = (
            ColumnParallelLinear(d, vocab, bias=False, tp=t)
            if par
            else nn.Linear(d, vocab, bias=False)
        )
        self.head.weight = self.wte.weight  # tied
        self.register_buffer("scale", torch.tensor(0.75))
        self.loss_fn = vocab_parallel_cross_entropy if par else F.cross_entropy

    def forward(self, ids, targets):
        B, T = ids.shape
        x = self.wte(ids)  # (B, T, d)
        q, k, v = self.qkv(self.ln(x)).split(self.d, dim=-1)  # each (B, T, d_local)
        q, k, v = (u.view(B, T, self.n_head, -1).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, self.d))
        x = x + self.out(F.gelu(self.fc(self.ln(x))) * self.gain) * self.scale
        logits = self.head(x)  # (B, T, vocab_local)
        return self.loss_fn(logits.view(B * T, -1), targets.view(-1), ignore_index=-1)


# --------------------------------------------------------------------------- #
# Multi-rank: load, gather back, train one step
# --------------------------------------------------------------------------- #


def _round_trip_and_step(mesh):
    from annot.runtime.process_groups import init

    ctx = init(mesh)
    tp = mesh.tp
    rng = random.Random(0)
    with use(ctx):
        for case in range(2):
            n_head = tp * rng.randint(1, 2)
            d = n_head * 2 * rng.randint(1, 2)
            vocab = tp * rng.randint(2, 5)
            torch.manual_seed(case)
            ref = Tiny(vocab, d, n_head)
            torch.manual_seed(100 + case + ctx.rank)  # different init: loading must matter
            model = Tiny(vocab, d, n_head, tp=tp)
            model.scale.fill_(-1.0)

            ref_sd = ref.state_dict()
            load_full_state_dict(model, ref_sd)
            got = full_state_dict(model)
            assert list(got) == list(ref_sd), (list(got), list(ref_sd))
            for key in ref_sd:
                assert torch.equal(got[key], ref_sd[key]), key
            assert got["wte.weight"] is got["head.weight"], "tied: gathered once"

            torch.manual_seed(1000 + case)  # the same batch on every rank
            ids = torch.randint(0, vocab, (2, 5))
            targets = torch.randint(0, vocab, (2, 5))
            targets[0, :2] = -1
            # SGD, not Adam: the k bias has an exactly-zero true gradient (softmax is
            # shift invariant) and Adam would blow its rounding noise up to +-lr.
            opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(2):
                loss_ref, loss = ref(ids, targets), model(ids, targets)
                _close(loss, loss_ref, f"loss, case {case} step {step}")
                loss_ref.backward()
                loss.backward()
                grads = full_grads(model)
                assert list(grads) == [n for n, _ in ref.named_parameters()]
                for name, p in ref.named_parameters():
                    _close(grads[name], p.grad, f"grad {name}, case {case} step {step}")
                opt_ref.step()
                opt.step()
                opt_ref.zero_grad()
                opt.zero_grad()
            after = full_state_dict(model)
            for key, value in ref.state_dict().items():
                _close(after[key], value, f"{key} after two SGD steps, case {case}")
    return True


@pytest.mark.slow
def test_round_trip_grads_and_sgd_steps_dp2_tp2():
    """dp=2 x tp=2 on 4 ranks: the tp collectives must use the tp group only."""
    assert run_ranks(_round_trip_and_step, 4, Mesh(dp=2, tp=2), timeout=240) == [True] * 4


# --------------------------------------------------------------------------- #
# Single process
# --------------------------------------------------------------------------- #


def test_tp1_round_trip_and_parity():
    torch.manual_seed(0)
    ref = Tiny()
    model = Tiny(tp=1)
    assert load_full_state_dict(model, ref.state_dict()) == ([], [])
    sd = full_state_dict(model)
    assert list(sd) == list(ref.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    ids = torch.randint(0, 16, (2, 4))
    assert torch.equal(model(ids, ids), ref(ids, ids))


def test_strict_keys_and_shapes_are_checked_before_writing():
    torch.manual_seed(0)
    model = Tiny(tp=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = Tiny().state_dict()
    del sd["ln.bias"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_full_state_dict(model, sd)
    assert str(info.value) == (
        "load_full_state_dict: keys do not match the model: missing ['ln.bias'], "
        "unexpected ['extra']; pass strict=False to load the keys that do match"
    )
    result = load_full_state_dict(model, sd, strict=False)
    assert result.missing_keys == ["ln.bias"]
    assert result.unexpected_keys == ["extra"]
    assert torch.equal(model.ln.bias, before["ln.bias"])

    model = Tiny(tp=1)
    sd = Tiny().state_dict()
    sd["qkv.weight"] = torch.zeros(24, 4)
    with pytest.raises(CheckpointError) as info:
        load_full_state_dict(model, sd)
    assert "qkv.weight: the full state dict has shape (24, 4), the model expects (24, 8)" in str(
        info.value
    )
    assert not torch.equal(model.proj.weight, sd["proj.weight"]), "nothing written on error"


def test_meta_device_and_mesh_mismatch():
    with torch.device("meta"):
        model = Tiny(tp=1)
    with pytest.raises(
        CheckpointError, match=r"wte.weight is on the meta device; call model.to_empty"
    ):
        load_full_state_dict(model, Tiny().state_dict())
    layer = ColumnParallelLinear(4, 4)
    with (
        use(ParallelContext(mesh=Mesh(tp=2))),
        pytest.raises(MeshError, match="weight is sharded for tp=1 but the current tp degree is 2"),
    ):
        full_state_dict(layer)


def test_tied_tensor_with_two_layouts_is_refused():
    a, b = ColumnParallelLinear(4, 6, chunks=3), ColumnParallelLinear(4, 6)
    b.weight = a.weight
    with pytest.raises(CheckpointError, match="one tensor is sharded two ways"):
        full_state_dict(nn.ModuleDict({"a": a, "b": b}))


def test_sharded_parameter_keeps_its_layout_through_deepcopy_and_save():
    p = shard_parameter(nn.Parameter(torch.randn(4, 6)), dim=-1)
    assert isinstance(p, ShardedParameter)
    assert (p.annot_shard_dim, p.annot_tp) == (1, 1)
    q = copy.deepcopy(p)
    assert (q.annot_shard_dim, q.annot_tp) == (1, 1)
    assert torch.equal(q, p)
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).annot_shard_dim == 1
    assert "tp shard dim=1 of tp=1" in repr(p)
    model = copy.deepcopy(Tiny(tp=1))
    assert set(full_state_dict(model)) == set(Tiny().state_dict())
