"""The replay's output log (annot.runtime.replay): a later pipeline stage answers
the calls of modules it does not hold from what the stage that ran them
logged, so a module whose output shape depends on its data, or whose kernel
has no meta version, replays like any other.

Single process: the two stages of one model run one after the other, each on
its own pruned copy, and what stage 0 sends crosses the pipeline's wire codec
(annot.runtime.p2p_codec) as it would between ranks. Multi-rank parity on a
Hugging Face mixture of experts is in tests/e2e/test_pp_nested.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from annot.errors import PipelineError
from annot.runtime.meta_ops import pack, recipe, unpack
from annot.runtime.p2p_codec import flatten, unflatten
from annot.runtime.replay import (
    ReplayStage,
    StageDone,
    install_boundaries,
    install_output_log,
    shape_run,
)
from annot.runtime.stage_prune import absent_paths, prune


class Drop(nn.Module):
    """Keeps the rows whose first feature is positive: the output's length is
    read from the data (a boolean mask, ``nonzero`` underneath), which meta
    cannot compute."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, h):
        return self.proj(h[h[:, 0] > 0]), h.shape[0]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.drop = Drop()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x):
        kept, n = self.drop(self.embed(x))
        return self.blocks(kept).sum(0) * n


BOUNDARIES = ("blocks.2",)
KEEP = ({"embed", "drop", "blocks.0", "blocks.1"}, {"blocks.2"})


def _stages():
    torch.manual_seed(0)
    full = Net()
    stages, logged = [], set()
    for keep in KEEP:
        through = frozenset(BOUNDARIES)
        logged.update(absent_paths(full, keep, through))
        stages.append((copy.deepcopy(full), keep, through))
    out = []
    for s, (model, keep, through) in enumerate(stages):
        prune(model, keep, shadows=True, through=through)
        install_boundaries(model, BOUNDARIES)
        install_output_log(model, sorted(logged))
        out.append((model, ReplayStage(model, s, BOUNDARIES)))
    return full, out


def _wire(sent: dict) -> dict:
    """What the next rank receives: the codec's structure, the tensors as leaves."""
    tree, tensors = flatten(sent)
    return unflatten(tree, [t.detach().requires_grad_(t.requires_grad) for t in tensors])


def _run_both(x, drop_log=False):
    full, ((m0, st0), (m1, st1)) = _stages()
    with pytest.raises(StageDone):
        st0(None, lambda: m0(x))
    received = _wire(st0.outputs)
    if drop_log:
        received["m"] = []
    return full(x), st1(received, lambda: m1(x)), received


def test_a_data_dependent_output_shape_replays_from_the_log():
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    ref, out, received = _run_both(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # the modules of stage 0 that stage 1 holds as placeholders, each logged once
    assert sorted(e[0] for e in received["m"]) == ["blocks.0", "blocks.1", "drop", "embed"]
    # another batch keeps another number of rows: the log follows it
    x2 = torch.randn(7, 4, generator=torch.Generator().manual_seed(2))
    ref2, out2, _ = _run_both(x2)
    torch.testing.assert_close(out2, ref2, rtol=0, atol=0)


def test_without_the_log_the_replay_cannot_compute_the_shape():
    # the mechanism under test: the same replay on meta alone fails
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(PipelineError, match=r"stage 1 replays .* an op in 'drop' failed"):
        _run_both(x, drop_log=True)


def test_recipes_cross_the_wire_as_one_string():
    x, y = torch.ones(2, 3), torch.ones(4, 1)[::2]
    out = ({"a": x, 3: [x, y, 2.5]}, torch.float16, torch.Size([2]), torch.device("cpu"), None)
    hit = recipe(out, {id(y): 0})
    text = pack(hit)
    tree, tensors = flatten(text)
    assert not tensors and unpack(unflatten(tree, [])) == hit
    # values JSON does not carry: the module runs on meta instead of being logged
    assert pack(recipe((x, torch.channels_last), {})) is None
    assert pack(recipe({(1, 2): x}, {})) is None


def test_the_shape_probe_runs_ops_meta_cannot_on_zeros():
    # the call order probe (shape_run): data-dependent shapes are a guess there, not a crash
    with torch.device("meta"):
        net = Net()
    out = shape_run(net, (torch.randn(5, 4),))
    assert out.is_meta and tuple(out.shape) == (4,)
