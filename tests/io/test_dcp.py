"""Sharded checkpoints (``annot.save`` / ``annot.load``) on real gloo ranks.

One run saves a tiny GPT at tp=2 after 2 AdamW steps and trains 2 more (the
uninterrupted reference); the other tests load that checkpoint into tp=2
(resume: equal step for step), tp=1, tp=4, pp=2 x tp=2 and a plain single
process, or break it (crash mid-save, no marker, truncated, altered, corrupt
metadata, a crafted pickle) and expect :class:`CheckpointError`.

Tensors cross process boundaries as numpy arrays (a tensor put on a queue by
a process that then exits may not arrive).
"""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from annot.core.errors import CheckpointError
from annot.io import dcp as ck
from annot.io.dcp_adapter import Shard
from annot.io.dcp_publish import seal
from annot.io.dcp_read import INFO, MARKER, METADATA
from annot.testing import RanksFailed, run_ranks

CFG = dict(block_size=8, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
LR = 1e-3
RTOL, ATOL = 1e-5, 4e-5  # float32: a parallel run against the single-device one


def _batches():
    g = torch.Generator().manual_seed(7)
    v, t = CFG["vocab_size"], CFG["block_size"]
    return [(torch.randint(0, v, (2, t), generator=g), torch.randint(0, v, (2, t), generator=g))
            for _ in range(4)]  # fmt: skip


def _np(sd):
    return {k: v.detach().cpu().numpy().copy() for k, v in sd.items()}


def _build(cache, seed, **mesh):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from examples.gpt.model import GPT, GPTConfig

    model = annot.parallelize(GPT, GPTConfig(**CFG), mesh=annot.Mesh(**mesh), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, opt


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_optim(model, opt):
    """Optimizer state by parameter name, gathered over tp (independently of
    annot.io.dcp: annot.runtime.tp.comm with the layers' layouts)."""
    from annot.runtime.tp.comm import gather_full
    from annot.runtime.tp.state_dict import shard_layouts

    layouts = shard_layouts(model.module)
    names = {id(p): n for n, p in model.module.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            lay = layouts.get(id(p))
            st = {}
            for k, v in opt.state[p].items():
                if lay is not None and v.shape == p.shape:
                    v = gather_full(v, lay[0], lay[1], lay[2], model.ctx.tp_group)
                st[k] = v.numpy().copy()
            out[names[id(p)]] = st
    return out


def _snapshot(model, opt):
    return {"model": _np(model.full_state_dict()), "optim": _full_optim(model, opt)}


# --------------------------------------------------------------------------- #
# Rank functions (module level: they are pickled).
# --------------------------------------------------------------------------- #


def _save_run(cache, path):
    model, opt = _build(cache, 0, tp=2)
    batches = _batches()
    _train(model, opt, batches[:2])
    saved = _snapshot(model, opt)
    ck.save(model, opt, path, step=2, extra={"epoch": 1, "note": "tp2"})
    losses = _train(model, opt, batches[2:])
    return {"saved": saved, "losses": losses, "final": _snapshot(model, opt)}


def _load_run(cache, path, train, **mesh):
    model, opt = _build(cache, 1, **mesh)  # other weights: the load must overwrite them
    info = ck.load(model, opt, path)
    out = {"info": info, "loaded": _snapshot(model, opt)}
    if train:
        out["losses"] = _train(model, opt, _batches()[2:])
        out["final"] = _snapshot(model, opt)
    return out


def _pipeline_run(cache, path, out_path):
    """pp=2 x tp=2: load the tp=2 checkpoint, train a step, save again."""
    import annot

    model, opt = _build(cache, 1, pp=2, tp=2)
    ck.load(model, opt, path)
    loaded = _np(model.full_state_dict())

    @annot.jit(model, microbatches=2)
    def step(x, y):
        _, loss = model(x, y)
        model.backward(loss)
        return loss

    x, y = _batches()[2]
    step(x, y)
    opt.step()
    opt.zero_grad()
    ck.save(model, opt, out_path, step=3)
    return {
        "loaded": loaded,
        "after": _np(model.full_state_dict()),
        "optim": _full_optim(model, opt),
    }


def _crash_run(cache, path):
    """Rank 1 dies right after writing its data files."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model, opt = _build(cache, 0, tp=2)
    _train(model, opt, _batches()[:1])
    write = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = write(self, plan, planner)
        if dist.get_rank() == 1:
            os._exit(3)
        return fut

    dcp.FileSystemWriter.write_data = write_then_die
    ck.save(model, opt, path, step=1)


# --------------------------------------------------------------------------- #
# Fixtures and helpers
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("annot-cache"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cache):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    result = run_ranks(_save_run, 2, cache, path, timeout=240)
    assert result[0]["losses"] == result[1]["losses"]
    return path, result[0]


def _same(actual, expected, what, exact=True):
    a, e = torch.as_tensor(np.asarray(actual)), torch.as_tensor(np.asarray(expected))
    if exact:
        assert torch.equal(a, e), f"{what}: differs (max {float((a - e).abs().max())})"
    else:
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _same_state(actual, expected, what, exact=True):
    assert set(actual) == set(expected), f"{what}: keys differ: {set(actual) ^ set(expected)}"
    for k in expected:
        if isinstance(expected[k], dict):
            _same_state(actual[k], expected[k], f"{what}: {k}", exact)
        else:
            _same(actual[k], expected[k], f"{what}: {k}", exact)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_shard_chunks_are_split_local():
    from annot.runtime.tp.comm import split_local

    full = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    cases = [(1, 3, 2, 1), (1, 1, 4, 1), (0, 1, 2, 1), (-1, 1, 3, 1), (1, 2, 3, 1)]
    cases += [(1, 3, 2, 2), (-1, 1, 3, 2), (1, 1, 1, 2)]  # experts (dim 0) split over ep too
    for dim, chunks, tp, ep in cases:
        for rank, er in ((r, e) for r in range(tp) for e in range(ep)):
            experts = full.narrow(0, er * (2 // ep), 2 // ep)  # this ep rank's experts
            local = split_local(experts, dim, chunks, tp, rank).clone()
            shard = Shard(local, (dim, chunks, tp, ep), rank, er)
            assert shard.size() == full.shape
            got = shard.__create_chunk_list__()
            assert len(got) == chunks
            for c in got:  # each chunk is the full tensor's region at its offsets
                region = full
                for d, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                    region = region.narrow(d, o, n)
                assert torch.equal(shard.pieces[c.offsets], region), (dim, chunks, tp, ep, rank)


def test_resume_tp2_equals_uninterrupted_run(saved, cache):
    path, ref = saved
    res = run_ranks(_load_run, 2, cache, path, True, tp=2, timeout=240)[0]
    assert res["info"] == {"step": 2, "extra": {"epoch": 1, "note": "tp2"}}
    _same_state(res["loaded"], ref["saved"], "loaded at tp=2")
    assert res["losses"] == ref["losses"]
    _same_state(res["final"], ref["final"], "resumed at tp=2, after steps 3-4")


def test_load_tp1_one_rank(saved, cache):
    path, ref = saved
    res = run_ranks(_load_run, 1, cache, path, True, tp=1, timeout=240)[0]
    _same_state(res["loaded"], ref["saved"], "loaded at tp=1")
    _same(res["losses"], ref["losses"], "tp=1 losses, steps 3-4", exact=False)
    _same_state(res["final"]["model"], ref["final"]["model"], "tp=1 after steps 3-4", exact=False)


@pytest.mark.slow
def test_load_tp4(saved, cache):
    path, ref = saved
    res = run_ranks(_load_run, 4, cache, path, False, tp=4, timeout=300)
    for r in res:
        _same_state(r["loaded"], ref["saved"], "loaded at tp=4")


def test_load_full_into_the_plain_model(saved):
    from examples.gpt.model import GPT, GPTConfig

    path, ref = saved
    model_sd, optim_sd = ck.load_full(path)
    torch.manual_seed(3)
    plain = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(plain.parameters(), lr=0.5)
    plain.load_state_dict(model_sd)  # strict: every key, tied lm_head included
    opt.load_state_dict(optim_sd)
    assert opt.param_groups[0]["lr"] == LR
    _same_state(_np(plain.state_dict()), ref["saved"]["model"], "plain model")
    by_name = {n: {k: v.numpy() for k, v in opt.state[p].items()}
               for n, p in plain.named_parameters()}  # fmt: skip
    _same_state(by_name, ref["saved"]["optim"], "plain optimizer")
    losses = []
    for x, y in _batches()[2:]:
        _, loss = plain(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _same(losses, ref["losses"], "plain losses, steps 3-4", exact=False)
    _same_state(_np(plain.state_dict()), ref["final"]["model"], "plain after 3-4", exact=False)


@pytest.mark.slow
def test_pipeline_load_and_save(saved, cache, tmp_path):
    path, ref = saved
    out = str(tmp_path / "pp")
    res = run_ranks(_pipeline_run, 4, cache, path, out, timeout=300)
    _same_state(res[0]["loaded"], ref["saved"]["model"], "loaded at pp=2 x tp=2")
    optim = {}  # by name, from both stages; the tied head's state is the embedding's
    for r in res:
        for name, st in r["optim"].items():
            name = "wte.weight" if name == "lm_head.weight" else name
            if name in optim:
                _same_state(st, optim[name], f"tied {name} on both stages")
            optim[name] = st
    assert ck.load(*_plain_with_optimizer(), out)["step"] == 3
    model_sd, optim_sd = ck.load_full(out)
    _same_state(_np(model_sd), res[0]["after"], "saved at pp=2 x tp=2")
    plain, opt = _plain_with_optimizer()
    plain.load_state_dict(model_sd)
    opt.load_state_dict(optim_sd)
    by_name = {n: _np(opt.state[p]) for n, p in plain.named_parameters()}
    _same_state(by_name, optim, "optimizer saved at pp=2 x tp=2")


def test_crash_mid_save_publishes_nothing(saved, cache, tmp_path):
    path, ref = saved
    target = _copy(path, tmp_path / "ck")  # a good checkpoint already there
    with pytest.raises(RanksFailed, match="rank 1"):
        run_ranks(_crash_run, 2, cache, target, timeout=120, pg_timeout=30)
    partial = [n for n in os.listdir(tmp_path) if n.startswith("ck.tmp-")]
    assert len(partial) == 1
    partial = str(tmp_path / partial[0])
    assert any(n.startswith("__1_") for n in os.listdir(partial)), "rank 1 wrote its files"
    assert MARKER not in os.listdir(partial)
    with pytest.raises(CheckpointError, match="incomplete checkpoint: no completion marker"):
        ck.load_full(partial)
    model_sd, _ = ck.load_full(target)  # the old checkpoint is untouched
    _same_state(_np(model_sd), {**ref["saved"]["model"]}, "old checkpoint")


def _plain_with_optimizer():
    from examples.gpt.model import GPT, GPTConfig

    plain = GPT(GPTConfig(**CFG))
    return plain, torch.optim.AdamW(plain.parameters(), lr=LR)


def _plain_trained():
    from examples.gpt.model import GPT, GPTConfig

    torch.manual_seed(4)
    plain = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    _, loss = plain(*_batches()[0])
    loss.backward()
    opt.step()
    return plain, opt


def _assert_unchanged_after(load, plain, opt):
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    before_opt = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    load()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before_opt[id(p)][k]), f"optimizer {k} changed"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("marker", "no completion marker"),
        ("truncate", "truncated or altered"),
        ("flip", "corrupt: CRC-32"),
        ("metadata", "corrupt DCP metadata"),
        ("metadata-unsealed", r"\.metadata: corrupt: CRC-32"),
        ("info", "annot-info.pt: unreadable"),
    ],
)
def test_damaged_checkpoint_is_refused_and_changes_nothing(saved, tmp_path, damage, message):
    path = _copy(saved[0], tmp_path / "ck")
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
    file = os.path.join(path, data)
    if damage == "marker":
        os.remove(os.path.join(path, MARKER))
    elif damage == "truncate":
        os.truncate(file, os.path.getsize(file) // 2)
    elif damage in ("flip", "metadata-unsealed"):  # same size, some bytes changed
        file = os.path.join(path, METADATA) if damage == "metadata-unsealed" else file
        with open(file, "r+b") as f:
            f.seek(os.path.getsize(file) // 2)
            f.write(b"\x7f" * 16)
    else:
        name = INFO if damage == "info" else METADATA
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"PK\x03\x04 this is not what was saved")
        seal(path, {}, {"step": 2, "mesh": None})  # a valid marker over the damage
    with pytest.raises(CheckpointError, match=message):
        ck.load_full(path)
    plain, opt = _plain_trained()
    _assert_unchanged_after(
        lambda: _expect(CheckpointError, message, ck.load, plain, opt, path), plain, opt
    )


def _expect(exc, message, fn, *args):
    with pytest.raises(exc, match=message):
        fn(*args)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_pickle_is_refused_and_nothing_runs(saved, tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    path = _copy(saved[0], tmp_path / "ck")
    marker = tmp_path / "pwned"
    with open(os.path.join(path, METADATA), "rb") as f:
        real = pickle.load(f)  # our own file, written by the save above
    payloads = {
        "top": _Evil(marker),  # the whole file is the payload
        "nested": Metadata(  # a real Metadata with the payload inside
            state_dict_metadata=real.state_dict_metadata,
            planner_data={"x": _Evil(marker)},
            storage_data=real.storage_data,
        ),
    }
    plain, opt = _plain_trained()
    for what, payload in payloads.items():
        with open(os.path.join(path, METADATA), "wb") as f:
            pickle.dump(payload, f)
        seal(path, {}, {"step": 2, "mesh": None})  # an attacker writes a valid marker
        with pytest.raises(CheckpointError, match=r"refusing to unpickle posix\.system"):
            ck.load_full(path)
        _assert_unchanged_after(
            lambda: _expect(CheckpointError, "refusing to unpickle", ck.load, plain, opt, path),
            plain,
            opt,
        )
        assert not marker.exists(), f"{what}: the crafted pickle ran"
    pickle.loads(pickle.dumps(_Evil(marker)))  # the payload is live: the test can fail
    assert marker.exists()


def test_save_load_plain_model_in_one_process(tmp_path):
    plain, opt = _plain_trained()
    path = ck.save(
        plain, opt, tmp_path / "plain", step=1, extra={"lr": [1, 2.5], "t": torch.ones(2)}
    )
    assert sorted(os.listdir(tmp_path)) == ["plain"]  # no temporary directory left
    other, other_opt = _plain_trained()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other_opt.state.clear()
    info = ck.load(other, other_opt, path)
    assert info["step"] == 1
    assert info["extra"]["lr"] == [1, 2.5]
    assert torch.equal(info["extra"]["t"], torch.ones(2))
    _same_state(_np(other.state_dict()), _np(plain.state_dict()), "reloaded")
    for p, q in zip(plain.parameters(), other.parameters()):
        _same_state(_np(other_opt.state[q]), _np(opt.state[p]), "reloaded optimizer")
    # Saving again replaces the checkpoint whole.
    ck.save(plain, None, path, step=5)
    assert ck.load(other, None, path)["step"] == 5
    with pytest.raises(CheckpointError, match="no optimizer state"):
        ck.load(other, other_opt, path)


def test_save_refuses_what_it_cannot_load_safely(tmp_path):
    plain, opt = _plain_trained()
    with pytest.raises(CheckpointError, match="extra= .* is not plain data"):
        ck.save(plain, opt, tmp_path / "a", extra={"obj": _Evil(tmp_path / "x")})
    assert not os.path.exists(tmp_path / "a")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not an annot checkpoint; refusing to replace"):
        ck.save(plain, opt, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_mismatched_model_is_refused(saved, tmp_path):
    from examples.gpt.model import GPT, GPTConfig

    other = GPT(GPTConfig(**{**CFG, "n_embd": 16}))
    with pytest.raises(
        CheckpointError,
        match=r"wte.weight: the checkpoint has shape \(64, 32\), the model expects \(64, 16\)",
    ):
        ck.load(other, None, saved[0])
    deeper = GPT(GPTConfig(**{**CFG, "n_layer": 1}))
    with pytest.raises(CheckpointError, match="holds tensors the model does not have"):
        ck.load(deeper, None, saved[0])
