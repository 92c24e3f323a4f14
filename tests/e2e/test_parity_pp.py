"""Pipeline-parallel runs equal the single-device run (real gloo ranks).

Loss, every gradient and every parameter after 3 AdamW steps, for pp 2..4,
each schedule, microbatch counts below, equal to and not a multiple of pp,
and hybrid meshes. Hypothesis draws model configurations and splits inside
each rank (derandomized, no shrinking, so every rank draws the same).
"""

import pytest

from annot.testing import run_ranks

LR = 1e-3


def _reference_loss(ref, args, kwargs, microbatches):
    """The single-device run. With ``microbatches`` it runs the same microbatches
    one after another (gradient accumulation): the reference for models whose
    control flow depends on batch statistics, which a microbatch sees differently."""
    import torch

    if not microbatches:
        _, loss = ref(*args, **kwargs)
        loss.backward()
        return loss
    losses = []
    parts = [torch.chunk(a, microbatches) for a in args]
    for i in range(microbatches):
        kw = {
            k: (v.chunk(microbatches)[i] if isinstance(v, torch.Tensor) else v)
            for k, v in kwargs.items()
        }
        _, loss = ref(*(p[i] for p in parts), **kw)
        (loss / microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _train_compare(model, ref, step, batches, what, make_args, accumulate=0):
    import torch

    from tests.parity import assert_close, compare_grads, compare_state

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for i, batch in enumerate(batches):
        args, kwargs = make_args(batch)
        loss = step(*args, **kwargs).reduce_mean()
        ref_loss = _reference_loss(ref, args, kwargs, accumulate)
        assert_close(loss, ref_loss, f"{what} step {i}: loss")
        compare_grads(model, ref, f"{what} step {i}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    compare_state(model, ref, f"{what} after {len(batches)} steps")


def _gpt_cases(pp, cases, cache, mesh_kw=None, hypothesis_examples=0):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    mesh = annot.Mesh(pp=pp, **(mesh_kw or {}))
    done = []

    def run(cfg, schedule, microbatches, batch, seq, split=None, chunks=1):
        placement = "v" if schedule == "zbv" else "loop"
        model = annot.parallelize(
            GPT, cfg, mesh=mesh, seed=3, chunks=chunks, split=split, placement=placement
        )
        torch.manual_seed(3)
        ref = GPT(cfg)

        @annot.jit(model, microbatches=microbatches, schedule=schedule)
        def step(x, y):
            logits, loss = model(x, y)
            model.backward(loss)
            return loss

        g = torch.Generator().manual_seed(seq)
        batches = [
            (
                torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
                torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
            )
            for _ in range(3)
        ]
        what = f"{mesh} {schedule} M={microbatches} chunks={chunks} split={split} {cfg}"
        _train_compare(model, ref, step, batches, what, lambda b: (b, {}))
        assert step.executor_builds == 1
        done.append(what)

    for schedule, m, chunks in cases:
        cfg = GPTConfig(
            block_size=8, vocab_size=32, n_layer=max(4, pp * chunks), n_head=2, n_embd=16
        )
        run(cfg, schedule, m, batch=m * 2, seq=5, chunks=chunks)

    if hypothesis_examples:
        from hypothesis import Phase, given, settings
        from hypothesis import strategies as st

        @settings(
            derandomize=True,
            max_examples=hypothesis_examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
        )
        @given(data=st.data())
        def drawn(data):
            n_layer = data.draw(st.integers(pp, pp + 3), "n_layer")
            cuts = sorted(
                data.draw(
                    st.lists(
                        st.integers(1, n_layer - 1), min_size=pp - 1, max_size=pp - 1, unique=True
                    ),
                    "cuts",
                )
            )
            cfg = GPTConfig(
                block_size=8,
                vocab_size=data.draw(st.sampled_from([16, 24]), "vocab"),
                n_layer=n_layer,
                n_head=2,
                n_embd=data.draw(st.sampled_from([8, 16]), "width"),
                bias=data.draw(st.booleans(), "bias"),
            )
            m = data.draw(st.integers(1, 4), "microbatches")
            run(
                cfg,
                data.draw(st.sampled_from(["gpipe", "1f1b"]), "schedule"),
                m,
                batch=m * data.draw(st.integers(1, 2), "per_mb"),
                seq=data.draw(st.integers(1, 8), "seq"),
                split=[f"h.{c}" for c in cuts],
            )

        drawn()
    return len(done)


@pytest.mark.slow  # 10-17 s: keeps the README's test command under 10 minutes
def test_pp2_schedules(tmp_path):
    cases = [
        ("gpipe", 1, 1),
        ("gpipe", 3, 1),
        ("1f1b", 4, 1),
        ("1f1b", 1, 1),
        ("interleaved", 4, 2),
        ("1f1b", 8, 1),
        ("zbh1", 4, 1),
    ]
    counts = run_ranks(_gpt_cases, 2, 2, cases, str(tmp_path), None, 4, timeout=500)
    assert counts == [len(cases) + 4] * 2


def test_pp2_zbv(tmp_path):
    # ZB-V: stages 0 and 3 on rank 0, 1 and 2 on rank 1 (handed over locally)
    cases = [("zbv", 4, 2), ("zbv", 1, 2)]
    counts = run_ranks(_gpt_cases, 2, 2, cases, str(tmp_path), timeout=500)
    assert counts == [len(cases)] * 2


def _zbv_refusals(cache):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=4, n_head=2, n_embd=16)
    found = []
    x = torch.randint(0, 32, (2, 5))
    for placement, schedule in (("loop", "zbv"), ("v", "1f1b")):
        model = annot.parallelize(
            GPT, cfg, mesh=annot.Mesh(pp=2), seed=3, chunks=2, placement=placement
        )

        @annot.jit(model, microbatches=2, schedule=schedule)
        def step(x, y, model=model):
            _, loss = model(x, y)
            model.backward(loss)
            return loss

        try:
            step(x, x)
        except annot.PipelineError as err:
            found.append(str(err))
    return found


def test_zbv_and_placement_must_agree(tmp_path):
    for found in run_ranks(_zbv_refusals, 2, str(tmp_path), timeout=300):
        assert "build the model with annot.parallelize(..., chunks=2, placement='v')" in found[0]
        assert "the V placement runs schedule='zbv'" in found[1]
    import torch

    import annot

    with pytest.raises(annot.HintError, match="placement='v' places two stages per rank"):
        annot.parallelize(torch.nn.Linear, 4, 4, mesh=annot.Mesh(pp=2), placement="v")


@pytest.mark.slow
def test_pp3_schedules(tmp_path):
    cases = [("gpipe", 2, 1), ("1f1b", 5, 1), ("interleaved", 3, 2)]
    counts = run_ranks(_gpt_cases, 3, 3, cases, str(tmp_path), timeout=500)
    assert counts == [3] * 3


@pytest.mark.slow
def test_pp4_schedules(tmp_path):
    cases = [("1f1b", 3, 1), ("gpipe", 8, 1), ("zbh1", 6, 1), ("zbv", 8, 2)]
    counts = run_ranks(_gpt_cases, 4, 4, cases, str(tmp_path), timeout=500)
    assert counts == [len(cases)] * 4


@pytest.mark.slow
def test_dp2_pp2(tmp_path):
    counts = run_ranks(_gpt_cases, 4, 2, [("1f1b", 2, 1)], str(tmp_path), {"dp": 2}, timeout=500)
    assert counts == [1] * 4


@pytest.mark.slow
def test_pp2_tp2(tmp_path):
    counts = run_ranks(
        _gpt_cases,
        4,
        2,
        [("1f1b", 2, 1), ("gpipe", 3, 1), ("zbh1", 3, 1)],
        str(tmp_path),
        {"tp": 2},
        timeout=500,
    )
    assert counts == [3] * 4


def _dynamic(cache):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch

    import annot
    from tests.pipeline_models import Branchy, Marked

    mesh = annot.Mesh(pp=2)
    # Branches on data, re-use, ties across stages, kwargs/None/int/float crossing.
    model = annot.parallelize(Branchy, mesh=mesh, seed=5, split=["blocks.2"])
    torch.manual_seed(5)
    ref = Branchy()
    assert len(model.pipeline.ties) == 1
    assert model.pipeline.ties[0].stages == (0, 1)
    # the prefix loop is cut in source (not at run time), and each stage holds its blocks only
    assert not model.report.replay, "self.blocks[: self.depth] is cut by the rewriter"
    held = {n.split(".")[1] for n, p in model.module.named_parameters() if n.startswith("blocks.")}
    held = {n for n in held if not any(p.is_meta for p in model.module.blocks[int(n)].parameters())}
    assert held == ({"0", "1"} if model.ctx.pp_rank == 0 else {"2", "3"}), held

    @annot.jit(model, microbatches=4, schedule="1f1b")
    def step(idx, targets, mask=None, scale=1.0):
        _, loss = model(idx, targets, mask=mask, scale=scale)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    batches = []
    for seq in (3, 7, 2):  # a different sequence length every step
        idx = torch.randint(0, 16, (8, seq), generator=g)
        tgt = torch.randint(0, 16, (8, seq), generator=g)
        mask = (torch.rand(8, seq, generator=g) > 0.3).float() if seq != 7 else None
        batches.append((idx, tgt, mask))
    _train_compare(
        model,
        ref,
        step,
        batches,
        "Branchy pp=2",
        lambda b: ((b[0], b[1]), {"mask": b[2], "scale": 1.5}),
        accumulate=4,
    )
    assert step.executor_builds == 1, "changing shapes must not recompile"

    marked = annot.parallelize(Marked, mesh=mesh, seed=6)
    torch.manual_seed(6)
    mref = Marked()

    @annot.jit(marked, microbatches=2, schedule="gpipe")
    def mstep(x, y):
        out, loss = marked(x, y)
        marked.backward(loss)
        return out

    x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    outs = mstep(x, y)
    mref_out, mref_loss = mref(x, y)
    mref_loss.backward()
    from tests.parity import assert_close, compare_grads

    assert_close(outs.concat(), mref_out, "Marked outputs")
    compare_grads(marked, mref, "Marked")
    return True


def test_dynamic_graphs_reuse_ties(tmp_path):
    assert run_ranks(_dynamic, 2, str(tmp_path), timeout=300) == [True, True]
