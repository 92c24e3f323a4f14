"""Dropout inside tp regions equals the single-device run (annot.runtime.tp.dropout):
each rank draws the single-device mask and keeps its slice, so with dropout > 0
the loss, every gradient and every parameter after AdamW steps are the
single-device model's, and the generator is left where the single-device run
leaves it. Real gloo ranks; the model is seeded the same before each forward."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from annot.core.errors import HintError
from annot.core.specs import Col, Local, Row
from annot.runtime.tp.dropout import Call, sharded_sites
from annot.testing import run_ranks


class Attention(nn.Module):
    """Heads split over tp: ``nn.Dropout`` on the eager path's weights (heads
    dim sharded), ``dropout_p`` inside SDPA on the other."""

    def __init__(self, dim, heads, eager, drop=True):
        super().__init__()
        self.heads, self.eager, self.p = heads, eager, 0.2 if drop else 0.0
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a k bias has a zero gradient
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.3 if drop else 0.0)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.eager:
            w = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
            y = self.attn_drop(w.softmax(-1)) @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0
            )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, eager, drop=True):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, eager, drop)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.25 if drop else 0.0)  # on the replicated residual stream
        self.p = 0.4 if drop else 0.0

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln(x)))
        h = F.dropout(F.gelu(self.fc1(x)), self.p, self.training)  # MLP hidden: columns sharded
        return x + self.drop(self.fc2(h))


class Net(nn.Module):
    """``drops``: which blocks drop out; ``emb_p``: dropout on the embedding."""

    def __init__(self, vocab=32, dim=16, heads=4, drops=(True, True), emb_p=0.1):
        super().__init__()
        self.emb_p = emb_p
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [Block(dim, heads, eager=i == 0, drop=d) for i, d in enumerate(drops)]
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        x = F.dropout(self.emb(ids), self.emb_p, self.training)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


HINTS = {
    "blocks.*.attn.qkv": Col(chunks=3),
    "blocks.*.attn.proj": Row(),
    "blocks.*.attn": Local("heads"),
    "blocks.*.fc1": Col(),
    "blocks.*.fc2": Row(),
}


def _dropout_parity(cache: str, checkpoint: bool, when: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import train_against_reference

    if checkpoint:  # the recomputation in backward must draw the same masks
        annot.recompute(Block)
    torch.manual_seed(0)
    sample = _batch(0)[:2] if when == "build" else None  # else: on the first call
    model = annot.parallelize(Net(), mesh=annot.Mesh(tp=2), hints=HINTS, verify=True, sample=sample)
    torch.manual_seed(0)
    ref = Net()
    after = {}

    def run(m, batch):
        ids, targets, seed = batch
        torch.manual_seed(seed)
        loss = m(ids, targets)
        after[m is ref] = torch.rand(1)  # the generator ends where the reference's does
        return loss, {}

    train_against_reference(model, ref, [_batch(s) for s in (1, 2)], run, "dropout", lr=1e-2)
    assert torch.equal(after[True], after[False])
    assert model.dropout, "no dropout site was found sharded"


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (2, 6), generator=g)
    return ids, torch.roll(ids, -1, 1), 100 + seed


@pytest.mark.parametrize(
    "checkpoint, when", [(False, "build"), (True, "build"), (False, "first-call")]
)
def test_dropout_in_tp_regions_equals_the_single_device_run(tmp_path, checkpoint, when):
    """The pre-flight at build (a sample given) or on the first call, whose
    forward then draws the single-device masks too."""
    run_ranks(_dropout_parity, 2, str(tmp_path), checkpoint, when, timeout=240)


def _jit_dropout_parity(cache: str, pp: int, split: list, when: str, sp: bool = False) -> dict:
    """In a jit step over 2 microbatches, at tp=2 and ``pp`` stages (``sp``:
    with sequence parallelism): the single-device model run on the same
    microbatches (accumulated), seeded the same before each step. In a
    pipeline each stage's ranks have their own generator, so only the last
    stage drops out: then its draws are the single-device run's, in the same
    order."""
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import assert_close, compare_grads, compare_state

    kw = {"drops": (pp == 1, True), "emb_p": 0.1 if pp == 1 else 0.0}
    sample = _batch(0)[:2] if when == "build" else None  # else: on the first call
    model = annot.parallelize(
        Net,
        **kw,
        mesh=annot.Mesh(tp=2, pp=pp),
        hints=HINTS,
        seed=0,
        sample=sample,
        split=split or None,
        sequence_parallel=sp,
    )
    torch.manual_seed(0)
    ref = Net(**kw)

    @annot.jit(model, microbatches=2)
    def step(ids, targets):
        loss = model(ids, targets)
        model.backward(loss)
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in (1, 2):
        ids, targets, seed = _batch(i)
        torch.manual_seed(seed)
        loss = step(ids, targets).reduce_mean()
        torch.manual_seed(seed)
        ref_loss = sum(ref(ids[j : j + 1], targets[j : j + 1]) / 2 for j in (0, 1))
        ref_loss.backward()
        assert_close(loss, ref_loss, f"pp={pp} split={split} step {i}: loss")
        compare_grads(model, ref, f"pp={pp} split={split} step {i}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"pp={pp} split={split} after 2 AdamW steps")
    assert model.dropout, "no dropout site was found sharded"
    sites = sorted({(path, dim) for (path, _, _), dim in model.dropout.items()})
    return {"preflight": model.report.preflight, "sites": sites}


def test_dropout_in_a_jit_step_found_on_the_first_call(tmp_path):
    res = run_ranks(_jit_dropout_parity, 2, str(tmp_path), 1, [], "first-call", timeout=240)
    assert res[0]["preflight"] == "on the first call"


@pytest.mark.slow
def test_dropout_in_tp_regions_of_pipeline_stages(tmp_path):
    """tp=2 × pp=2: a boundary between blocks in the root's loop and one inside
    a block's forward; the sites found at build (sample) and on the first
    call; with sequence parallelism each stage's blocks run on sequence shards
    (the residual dropout's site split along the sequence, dim 1)."""
    cases = [(["blocks.1"], "build", False), (["blocks.0.fc1"], "first-call", False)]
    cases += [(["blocks.1"], "build", True)]
    for n, (split, when, sp) in enumerate(cases):
        res = run_ranks(
            _jit_dropout_parity, 4, str(tmp_path / str(n)), 2, split, when, sp, timeout=400
        )
        assert res[0]["preflight"] == ("passed" if when == "build" else "on the first call")
        # the residual stream's dropout sees a shard only with sequence parallelism
        assert (("blocks.1.drop", 1) in res[2]["sites"]) == sp, res


def _call(shape, func=F.dropout, line=1, p=0.1):
    return Call(func, ("blocks.0.attn", "model.py", line), shape, p)


def test_sites_are_found_by_comparing_shapes():
    local = [_call((2, 2, 6, 6)), _call((2, 6, 16), line=2), _call((2, 6, 32), line=3, p=0.0)]
    ref = [_call((2, 4, 6, 6)), _call((2, 6, 16), line=2), _call((2, 6, 64), line=3, p=0.0)]
    assert sharded_sites(local, ref, 2) == {("blocks.0.attn", "model.py", 1): 1}


@pytest.mark.parametrize(
    "local, ref, words",
    [
        ([_call((2, 2, 3))], [_call((2, 4, 6))], "not one dim split 2 ways"),
        ([_call((2, 2), F.alpha_dropout)], [_call((2, 4), F.alpha_dropout)], "alpha_dropout"),
        ([_call((2, 2)), _call((4, 4))], [_call((2, 4)), _call((4, 4))], "on some calls"),
        ([_call((2, 2))], [], "makes 1 dropout calls where the single-device model makes 0"),
    ],
)
def test_what_cannot_be_drawn_exactly_is_refused(local, ref, words):
    with pytest.raises(HintError, match=words):
        sharded_sites(local, ref, 2)
