"""The tp pre-flight (annot.build.preflight): hints that would crash are refused
before any collective, naming the module and its hints; good hints pass."""

from __future__ import annotations

import pytest
import torch

from annot.core.specs import Col, Local, Row
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
    assert second.startswith("RankFailure: rank ")
    assert f"HintError: {refusal}" in second
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
    from annot.build.preflight import preflight

    class ReadsValues(torch.nn.Module):
        def forward(self, x):
            return x[: int(torch.nonzero(x).shape[0])]

    preflight(ReadsValues(), (torch.ones(3),), {}, ref=ReadsValues(), ctx=None, specs={}, paths={})


# -- a head count left global where forward reshapes with -1 -------------------------------


class HeadConfig:
    def __init__(self, n_head: int, n_embd: int):
        self.n_head, self.n_embd = n_head, n_embd


class MinusOneAttention(torch.nn.Module):
    """Splits q, k, v into heads with ``-1`` for the head size: a head count left
    global still fits the shard (n_head heads of head_dim / tp)."""

    def __init__(self, config: HeadConfig, alias: bool):
        super().__init__()
        self.config = config
        self.alias = alias
        w = config.n_embd
        self.q = torch.nn.Linear(w, w)
        self.k = torch.nn.Linear(w, w)
        self.v = torch.nn.Linear(w, w)
        self.out = torch.nn.Linear(w, w)

    def forward(self, x):
        B, T, _ = x.shape
        if self.alias:  # read through a name the rewriter does not divide
            cfg = self.config
            nh = cfg.n_head
        else:
            nh = self.config.n_head
        q = self.q(x).view(B, T, nh, -1).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, nh, -1).transpose(1, 2)
        v = self.v(x).view(B, T, nh, -1).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MinusOneNet(torch.nn.Module):
    def __init__(self, alias: bool = False, width: int = 16, heads: int = 4, vocab: int = 16):
        super().__init__()
        config = HeadConfig(heads, width)
        self.emb = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList([MinusOneAttention(config, alias) for _ in range(2)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


MINUS_ONE_COLS = {"**.q": Col(), "**.k": Col(), "**.v": Col(), "**.out": Row()}
MINUS_ONE_LOCAL = {**MINUS_ONE_COLS, "layers.*": Local("config.n_head")}


def _minus_one_run(alias: bool, hints: dict, with_sample: bool):
    """The loss and every gradient at tp=2 and on one device, or the refusal
    (with whether the parallel model's forward had begun a step)."""
    import annot

    g = torch.Generator().manual_seed(0)
    ids, targets = (
        torch.randint(0, 16, (2, 6), generator=g),
        torch.randint(0, 16, (2, 6), generator=g),
    )
    torch.manual_seed(0)
    ref = MinusOneNet(alias)
    ref(ids, targets).backward()
    try:
        model = annot.parallelize(
            MinusOneNet,
            mesh=annot.Mesh(tp=2),
            seed=0,
            hints=hints,
            model_kwargs={"alias": alias},
            sample=(ids, targets) if with_sample else None,
        )
        loss = model(ids, targets)
    except annot.AnnotError as err:
        return f"{type(err).__name__}: {err}"
    model.backward(loss)
    grads = model.full_grads()
    return (
        loss.item(),
        ref(ids, targets).item(),
        {
            n: ((grads[n] - p.grad).abs().max().item(), p.grad.abs().max().item())
            for n, p in ref.named_parameters()
        },
    )


def _view_line() -> int:
    import inspect

    lines, first = inspect.getsourcelines(MinusOneAttention.forward)
    return first + next(i for i, s in enumerate(lines) if "q = self.q(x).view" in s)


def _refusal() -> str:
    return (
        f"HintError: tp pre-flight: at tp=2, layers.0 (test_preflight.py:{_view_line()}) splits "
        "a tp shard into heads with .view(...): [2, 6, 8] -> [2, 6, 4, 2] on this rank, where "
        "the single-device model's [2, 6, 16] -> [2, 6, 4, 4] splits dim 2 into 4 x 4. Each "
        "rank holds whole heads, so its reshape must divide the outermost of those (the heads: "
        "[2, 6, 2, 4]), not an inner one: as it is, each of its heads mixes pieces of several, "
        "and every shape still agrees. The head count in this reshape is the global one: name "
        "the head count in Local(...), e.g. Local('n_head') or Local('config.n_head'); if "
        "forward reads it through another name, read it as self.<attr> where it is used"
    )


@pytest.mark.parametrize("with_sample", [True, False], ids=["at-build", "first-call"])
def test_head_count_left_global_with_minus_one_refused(with_sample):
    """``view(B, T, nh, -1)`` with ``Local`` forgotten: every shape agrees, so
    only the paired reshapes show that the shard's heads are cut in pieces."""
    assert run_ranks(_minus_one_run, 2, False, MINUS_ONE_COLS, with_sample) == [_refusal()] * 2


def test_head_count_read_through_an_alias_refused():
    """``cfg = self.config; nh = cfg.n_head``: Local('config.n_head') cannot
    divide a read through another name; refused, naming the fix."""
    assert run_ranks(_minus_one_run, 2, True, MINUS_ONE_LOCAL, True) == [_refusal()] * 2


def test_minus_one_with_the_head_count_local_equals_one_device():
    """fp32: loss to 1e-5 relative, each gradient to 1e-5 of its largest entry
    (+ 1e-7: k's bias gets a gradient of rounding noise only)."""
    for loss, ref_loss, errors in run_ranks(_minus_one_run, 2, False, MINUS_ONE_LOCAL, False):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert set(errors) == {n for n, _ in MinusOneNet().named_parameters()}
        for name, (err, scale) in errors.items():
            assert err <= 1e-5 * scale + 1e-7, (name, err, scale)


def test_a_fuzz_model_splitting_heads_with_minus_one_is_refused_with_the_head_count_global():
    """The structure fuzzer's ``reshape_minus_one`` with ``wrong='global'``."""
    from tests.fuzz_models import Recipe

    recipe = Recipe(kinds="am", reshape_minus_one=True)
    msgs = run_ranks(_fuzz_refusal, 2, recipe)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("HintError: tp pre-flight: at tp=2, tower.blocks.0 (fuzz_models.py:")
    assert "name the head count in Local(...)" in msgs[0]


def _fuzz_refusal(recipe) -> str:
    import annot
    from tests.fuzz_models import FuzzNet, batch, hints

    ids, targets = batch(recipe, 4, 1)
    try:
        model = annot.parallelize(
            FuzzNet, recipe, mesh=annot.Mesh(tp=2), seed=0, hints=hints(recipe, "global")
        )
        model(ids, targets)
    except annot.AnnotError as err:
        return f"{type(err).__name__}: {err}"
    return "ran"


def _dropout_in_a_split_forward(runner: str) -> str:
    import annot
    from tests.pipeline_models import DropoutInBody

    try:
        model = annot.parallelize(
            DropoutInBody,
            mesh=annot.Mesh(tp=2, pp=2),
            hints={"body.up": Col(), "body.down": Row()},
            seed=0,
            sample=(torch.zeros(2, 8),),
            split=["body.blocks.1"],
            runner=runner,
        )
    except annot.AnnotError as err:
        return f"{type(err).__name__}: {err}"
    return f"built: {model.report.runner}, dropout sites {len(model.report.preflight or ())}"


@pytest.mark.slow
def test_dropout_on_a_shard_in_a_forward_the_source_split_cuts_is_refused():
    """``F.dropout`` in ShardedBody.forward's own code, on the tp shard between
    its Col and Row layers: the nested source split runs that forward as stage
    methods (other lines), so annot cannot key the site to draw this rank's
    part of the single-device mask: refused at build on every rank, naming
    the forward and the replay, which runs it (and its dropout) as written."""
    msgs = run_ranks(_dropout_in_a_split_forward, 4, "auto")
    assert msgs == [msgs[0]] * 4
    assert msgs[0].startswith("HintError: tp pre-flight: dropout at "), msgs[0]
    assert "pipeline_models" in msgs[0]  # (the file that ran: the rewritten source)
    assert (
        " in ShardedBody.forward gets a tp shard, and the pipeline runs that forward as" in msgs[0]
    )
    assert "runner='replay'" in msgs[0]
    for msg in run_ranks(_dropout_in_a_split_forward, 4, "replay"):
        assert msg.startswith("built: replay, dropout sites "), msg
        assert int(msg.rsplit(" ", 1)[1]) > 0, msg
