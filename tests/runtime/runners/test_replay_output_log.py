"""The replay's output log (annot.runtime.runners.replay): a later pipeline stage answers
the calls of modules it does not hold from what the stage that ran them
logged, so a module whose output shape depends on its data, or whose kernel
has no meta version, replays like any other.

Single process: the two stages of one model run one after the other, each on
its own pruned copy, and what stage 0 sends crosses the pipeline's wire codec
(annot.runtime.pipeline.p2p_codec) as it would between ranks. Multi-rank parity on a
Hugging Face mixture of experts is in tests/e2e/test_pp_nested.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from annot.core.errors import PipelineError
from annot.runtime.pipeline.p2p_codec import flatten, unflatten
from annot.runtime.runners.meta_ops import pack, recipe, unpack
from annot.runtime.runners.placeholder import install_output_log
from annot.runtime.runners.replay import ReplayStage, install_boundaries
from annot.runtime.runners.replay_state import StageDone
from annot.runtime.runners.shape_run import shape_run
from annot.runtime.runners.stage_prune import (
    absent_paths,
    forget_real_weights,
    logged_modules,
    prune,
)


class Drop(nn.Module):
    """Keeps the rows whose first feature is positive: the output's length is
    read from the data (a boolean mask, ``nonzero`` underneath), which meta
    cannot compute; and a value read inside (``.item()``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h):
        scale = 2.0 if h.sum().item() > 0 else 0.5  # a value read inside a logged module
        return self.proj(h[h[:, 0] > 0]) * scale, h.shape[0]


class Body(nn.Module):
    """Blocks in a list; returns a dict with a non-plain value, so a stage that
    holds none of it runs it on meta and its blocks answer from the log."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.drop = Drop()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)])

    def forward(self, x):
        kept, n = self.drop(self.embed(x))
        h = self.embed(kept)  # a module called twice
        for block in self.blocks:
            h = block(h)
        return {"h": h * n, "note": object()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(4, 2)
        self.out = nn.Linear(2, 2)

    def forward(self, x):
        return self.out(self.head(self.body(x)["h"])).sum(0)


def _stages(boundaries, keeps, make=None):
    torch.manual_seed(0)
    full = (make or Net)()
    absent, copies = set(), []
    for s, keep in enumerate(keeps):
        through = frozenset(b for b in (boundaries[s - 1 : s] + boundaries[s : s + 1]) if b)
        absent.update(absent_paths(full, keep, through))
        copies.append((copy.deepcopy(full), keep, through))
    keys = logged_modules(full, absent)
    out = []
    for s, (model, keep, through) in enumerate(copies):
        prune(model, keep, shadows=True, through=through)
        forget_real_weights(model)  # as the build leaves them: shadows hold meta weights
        install_boundaries(model, boundaries)
        install_output_log(model, keys)
        out.append((model, ReplayStage(model, s, boundaries)))
    return full, out


def _wire(sent: dict) -> dict:
    """What the next rank receives: the codec's structure, the tensors as leaves."""
    tree, tensors = flatten(sent)
    return unflatten(tree, [t.detach().requires_grad_(t.requires_grad) for t in tensors])


# Three stages: the body's blocks split 2 | 1 and the heads on the last (which
# holds no part of the body: it is one placeholder there, run as a meta shadow).
BOUNDARIES = ("body.blocks.2", "head")
KEEPS = (
    {"body.embed", "body.drop", "body.blocks.0", "body.blocks.1"},
    {"body.blocks.2"},
    {"head", "out"},
)


def _run_all(x, drop_log=False, boundaries=BOUNDARIES, keeps=KEEPS):
    full, stages = _stages(boundaries, keeps)
    received, logs = None, []
    for model, stage in stages[:-1]:
        with pytest.raises(StageDone):
            stage(received, lambda m=model: m(x))
        received = _wire(stage.outputs)
        if drop_log:
            received["m"] = []
        logs.append(received["m"])
    model, last = stages[-1]
    return full(x), last(received, lambda: model(x)), logs


def test_a_data_dependent_output_shape_replays_from_the_log():
    for seed, rows in ((1, 9), (2, 7)):  # another batch keeps another number of rows
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed))
        ref, out, (first, second) = _run_all(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        keys = [(e[0], e[1]) for e in first]
        # stage 0's modules, the embedding's two calls counted apart, the value
        # read inside drop spanned by its entry
        assert ("body.embed", 0) in keys
        assert ("body.embed", 1) in keys
        drop = next(e for e in first if e[0] == "body.drop")
        assert drop[3] - drop[2] == 1
        # the middle stage forwards stage 0's entries and adds its block's
        assert second[: len(first)] == first
        assert ("body.blocks.2", 0) in [(e[0], e[1]) for e in second]


def test_without_the_log_the_replay_cannot_compute_the_shape():
    # the mechanism under test: the same replay on meta alone fails
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(PipelineError, match=r"stage 1 replays .* an op in 'body.drop' failed"):
        _run_all(x, drop_log=True)


def test_a_module_returning_its_own_parameter_is_not_logged():
    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(4))

        def forward(self):
            return self.p

    class PosNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = Pos()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x) + self.pos()).sum()

    full, ((m0, st0), (m1, st1)) = _stages(("b",), ({"pos", "a"}, {"b"}), PosNet)
    x = torch.randn(3, 4)
    with pytest.raises(StageDone):
        st0(None, lambda: m0(x))
    received = _wire(st0.outputs)
    assert [e[0] for e in received["m"]] == ["a"]  # not pos: its output is module state
    torch.testing.assert_close(st1(received, lambda: m1(x)), full(x), rtol=0, atol=0)


def test_recipes_cross_the_wire_as_one_string():
    x, y = torch.ones(2, 3), torch.ones(4, 1)[::2]
    out = ({"a": x, 3: [x, y, 2.5]}, torch.float16, torch.Size([2]), torch.device("cpu"), None)
    hit = recipe(out, {id(y): 0})
    text = pack(hit)
    tree, tensors = flatten(text)
    assert not tensors
    assert unpack(unflatten(tree, [])) == hit
    # values JSON does not carry: the module runs on meta instead of being logged
    assert pack(recipe((x, torch.channels_last), {})) is None
    assert pack(recipe({(1, 2): x}, {})) is None


def test_the_shape_probe_runs_ops_meta_cannot_on_zeros():
    # the call order probe (shape_run): data-dependent shapes are a guess there, not a crash
    with torch.device("meta"):
        net = Net()
    out = shape_run(net, (torch.randn(5, 4),))
    assert out.is_meta
    assert tuple(out.shape) == (2,)


def test_a_tensor_of_another_shape_at_the_boundary_is_refused_naming_its_variable():
    # the previous stage's tensors pair up with this rank's frames one to one;
    # a shape that differs means the two took different paths
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    _, stages = _stages(BOUNDARIES, KEEPS)
    (m0, s0), (m1, s1) = stages[:2]
    with pytest.raises(StageDone):
        s0(None, lambda: m0(x))
    received = _wire(s0.outputs)
    received["t"] = [t[:1] if t is not None else t for t in received["t"]]
    named = r"boundary 'body.blocks.2': \S+: args\[0\] is torch.float32\[\d+, 4\] here but "
    with pytest.raises(PipelineError, match=named + r"torch.float32\[1, 4\] on the previous"):
        s1(received, lambda: m1(x))
