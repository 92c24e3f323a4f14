"""annot.plan.planner: split points from the source, segments run as the real stage
code, the partition over them, and the plan composing back to forward.

Single process: the planner runs on one device before any rank starts.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from annot import Col, Row, shard
from annot.core.errors import PartitionError
from annot.plan.partition import partition
from annot.plan.planner import measure_split, plan, split_points
from annot.plan.segment_plan import SourceSegments
from annot.rewriters.split.stage_split import split_stages

VOCAB, WIDTH = 256, 16
HIDDENS = (64, 64, 64, 16, 16, 16, 16, 16)  # three 4x wide blocks, then narrow ones
BYTES = 4  # float32
ADAMW = 4  # param + grad + exp_avg + exp_avg_sq, in units of the parameter bytes
STEP = 4  # and AdamW's float32 step, per parameter tensor


@shard(up=Col(), down=Row())
class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class Uneven(nn.Module):
    """A GPT-like stack: a heavy embedding and head, blocks of mixed widths."""

    def __init__(self, vocab=VOCAB, width=WIDTH, hiddens=HIDDENS, tie=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, h) for h in hiddens])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx, targets=None):
        x = self.emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class Awkward(nn.Module):
    """Split points that split_stages would refuse must not be offered."""

    def __init__(self, width=8):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.gated = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x):
        """A docstring is not a statement to cut before."""
        h = self.a(x)
        scale = h.shape[-1]  # no module call: no split point before it
        for i, block in enumerate(self.blocks, 1):
            h = block(h) / i
        for gate in self.gated:  # a `break`: cannot be cut inside
            h = gate(h)
            if h.abs().max() > 1e6:
                break
        if scale > 0:
            h = self.b(h)  # nested in an `if`: no split point
        h = self.a(h)  # a second call of `a` names the first one
        return self.c(h) + self.b(h)


_UNIT_OPTIONS = ("source_path", "cache_dir", "progress", "bandwidth", "repeats", "rounds")


def plan_source(m, cls, n, **kw):
    """annot.plan.planner.plan over the segments of ``cls.forward``, the options of
    :class:`SourceSegments` given among plan's."""
    opts = {k: kw.pop(k) for k in _UNIT_OPTIONS if k in kw}
    return plan(m, n, units=SourceSegments(cls, **opts), **kw)


def block_params(h, width=WIDTH):
    return 2 * width + (width * h + h) + (h * width + width)


def segment_params():
    """The per-segment parameter counts, by hand: emb, each block, norm, head."""
    return [VOCAB * WIDTH, *(block_params(h) for h in HIDDENS), 2 * WIDTH, VOCAB * WIDTH]


def source_of(cls):
    return inspect.getsource(inspect.getmodule(cls))


def sample(batch=4, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return idx, torch.randint(0, VOCAB, (batch, seq), generator=g)


def model(**kw):
    torch.manual_seed(0)
    return Uneven(**kw)


# ---- split points ------------------------------------------------------------------


def test_split_points_are_statement_boundaries_and_loop_iterations():
    points = split_points(source_of(Uneven), "Uneven", model())
    assert points == [*(f"blocks.{k}" for k in range(len(HIDDENS))), "norm", "head"]


def test_split_points_of_the_gpt_example():
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=3, n_head=2, n_embd=16)
    points = split_points(source_of(GPT), "GPT", GPT(cfg))
    # lm_head is only called inside `if targets is not None:`: not a split point
    assert points == ["wte", "wpe", "drop", "h.0", "h.1", "h.2", "ln_f"]


def test_split_points_leave_out_what_split_stages_refuses():
    points = split_points(source_of(Awkward), "Awkward", Awkward())
    # enumerate(..., 1) is cut per block; the loop with a `break` only before it;
    # `b` is first used nested in an if; the second `a` call names line 1; `c` is fine
    assert points == ["blocks.0", "blocks.1", "blocks.2", "gated.0", "c"]
    split_stages(source_of(Awkward), "Awkward", points)  # all at once is accepted


def test_boundary_markers_leave_nothing_to_plan():
    from tests.pipeline_models import Marked

    with pytest.raises(
        PartitionError, match=r"annot.boundary\(\) markers \(boundary\(\)@\d+\).*nothing to plan"
    ):
        plan_source(Marked(), Marked, 2)


# ---- the partition -----------------------------------------------------------------


def test_params_plan_equals_partition_of_hand_counted_parameters():
    m = model()
    plan = plan_source(m, Uneven, 4, cost="params")
    counts = segment_params()
    assert [c.n_params for c in plan.costs] == counts
    assert [c.cost for c in plan.costs] == [BYTES * n for n in counts]
    expected = partition(counts, None, 4)
    names = plan.segments
    assert names == ("emb", *(f"blocks.{k}" for k in range(len(HIDDENS))), "norm", "head")
    assert plan.boundaries == tuple(names[b] for b in expected.boundaries)
    assert plan.partition.bounds == expected.bounds
    assert not plan.measured
    assert "no sample input" in plan.table()


def test_balanced_where_a_uniform_layer_split_is_not():
    counts = segment_params()
    per = len(HIDDENS) // 4
    uniform = [counts[1 + s * per : 1 + (s + 1) * per] for s in range(4)]
    uniform[0] = [counts[0], *uniform[0]]
    uniform[-1] = [*uniform[-1], *counts[-2:]]
    stage = [sum(u) for u in uniform]
    assert max(stage) / (sum(stage) / 4) > 1.3  # the case is built to be uneven
    plan = plan_source(model(), Uneven, 4, cost="params")
    assert plan.imbalance <= 1.10
    assert f"imbalance (max/mean stage cost): {plan.imbalance:.2f}" in plan.table()


def test_memory_budget_is_respected_and_infeasible_budgets_raise_with_numbers():
    from annot.plan.memory_model import Training

    m = model()
    one = Training(microbatches=1)  # one microbatch in flight: activations counted once
    free = plan_source(m, Uneven, 3, cost="flops", sample=sample(), setup=one)
    # the smallest possible largest stage memory of any 3-stage split
    budget = int(partition([c.memory for c in free.costs], None, 3).bottleneck)
    assert budget < max(free.partition.stage_memory)  # the budget binds
    plan = plan_source(m, Uneven, 3, cost="flops", sample=sample(), memory=budget, setup=one)
    assert max(plan.partition.stage_memory) <= budget
    assert plan.boundaries != free.boundaries
    assert plan.partition.bottleneck > free.partition.bottleneck  # the price of fitting
    assert "memory budget per device" in plan.table()
    # each segment fits 70000 bytes, but all of them (281344) do not fit 4 such stages
    with pytest.raises(
        PartitionError,
        match=r"no split into 4 stages fits memory budget 70000 bytes: the best 4-stage split "
        r"has a stage of \d+ bytes; 5 stages would fit",
    ):
        plan_source(m, Uneven, 4, cost="params", memory=70000)
    with pytest.raises(PartitionError, match=rf"segment 0 alone needs {65536 + STEP} bytes"):
        plan_source(m, Uneven, 4, cost="params", memory=VOCAB * WIDTH * BYTES)


def test_fit_finds_the_fewest_stages_that_fit():
    m = model()
    total = sum(segment_params()) * BYTES * ADAMW
    budget = total // 3  # more than 3 stages needed
    segments = len(HIDDENS) + 3  # emb, the blocks, norm, head: at most one stage each
    plan = plan_source(m, Uneven, segments, memory=budget, cost="params", fit=True)
    assert max(plan.partition.stage_memory) <= budget
    assert plan.n_stages > 3
    with pytest.raises(PartitionError, match="memory budget"):
        plan_source(m, Uneven, plan.n_stages - 1, cost="params", memory=budget)


def test_tied_weights_are_charged_once_per_stage_that_holds_them():
    m = model(tie=True)
    assert m.head.weight is m.emb.weight
    tied = VOCAB * WIDTH * BYTES * ADAMW + STEP
    tensors = len(list(m.parameters()))  # the tied weight once
    unique = (sum(segment_params()) - VOCAB * WIDTH) * BYTES * ADAMW + tensors * STEP
    one = plan_source(m, Uneven, 1, cost="params")
    assert one.partition.stage_memory == [unique]
    two = plan_source(m, Uneven, 2, cost="params")
    assert sum(two.partition.stage_memory) == unique + tied  # in both end stages
    stages = two.stages()
    assert sum(s["params"] for s in stages) == sum(segment_params())
    assert stages[0]["first"] == "emb"
    assert stages[-1]["last"] == "head"


def test_a_dominating_segment_is_named():
    plan = plan_source(model(), Uneven, 8, cost="params")
    assert any("'head' alone costs" in w for w in plan.warnings)
    assert "warning: segment 'head' alone costs" in plan.table()
    with pytest.raises(PartitionError, match="fewer than the 12 stages"):
        plan_source(model(), Uneven, 12, cost="params")


def test_tp_divides_the_sharded_parameters():
    plan = plan_source(model(), Uneven, 2, cost="params", tp=2)
    for c, h in zip(plan.costs[1:-2], HIDDENS):
        # Col splits up's weight and bias; Row splits down's weight, not its bias
        assert c.n_params == 2 * WIDTH + (WIDTH * h + h) // 2 + (h * WIDTH) // 2 + WIDTH
    assert plan.costs[0].n_params == VOCAB * WIDTH  # not hinted: whole
    assert "tp=2" in plan.table()


def test_cost_needs_a_sample_to_measure():
    with pytest.raises(PartitionError, match="sample"):
        plan_source(model(), Uneven, 2, cost="time")
    with pytest.raises(PartitionError, match="cost='bytes'"):
        plan_source(model(), Uneven, 2, cost="bytes", sample=sample())


# ---- measured plans ------------------------------------------------------------------


def _compose(m, boundaries, args):
    """Run the stages of split_stages(boundaries) in turn on ``m``'s weights."""
    split = split_stages(source_of(Uneven), "Uneven", list(boundaries))
    (cls,) = [n for n in ast.parse(split.source).body if getattr(n, "name", "") == "Uneven"]
    ns = dict(globals())
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "<split>", "exec"), ns)
    staged = copy.copy(m)
    staged.__class__ = ns["Uneven"]
    out = getattr(staged, split.stages[0].method)(*args)
    for st in split.stages[1:]:
        out = getattr(staged, st.method)(**out)
    return split, out


def test_time_plan_measures_and_its_stages_compose_to_forward():
    m = model(tie=True)
    idx, targets = sample()
    plan = plan_source(m, Uneven, 3, sample=(idx, targets), cost="time")
    assert plan.measured
    assert plan.cost == "time"
    assert all(c.time > 0 for c in plan.costs)
    assert all(c.flops > 0 for c in [*plan.costs[1:-2], plan.costs[-1]])  # blocks, head
    assert [c.cost for c in plan.costs] == [c.time for c in plan.costs]
    # x and the targets cross from the embedding to the first block
    assert plan.costs[0].output_bytes == idx.numel() * WIDTH * BYTES + targets.numel() * 8
    assert len(plan.boundaries) == 2
    split, (logits, loss) = _compose(m, plan.boundaries, (idx, targets))
    assert len(split.stages) == 3
    ref_logits, ref_loss = m(idx, targets)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)


def test_keyword_sample_flops_plan_and_json():
    m = model()
    idx, targets = sample()
    plan = plan_source(m, Uneven, 2, sample={"idx": idx, "targets": targets}, cost="flops")
    wide, narrow = plan.costs[1].flops, plan.costs[-3].flops
    assert wide > 2 * narrow  # a 4x wider block does more work
    data = json.loads(json.dumps(plan.to_json()))
    assert data["boundaries"] == list(plan.boundaries)
    assert [s["segments"] for s in data["stages"]] == [list(b) for b in plan.partition.bounds]
    assert data["imbalance"] == pytest.approx(plan.imbalance)
    assert all(s["flops"] > 0 and s["time"] > 0 for s in data["stages"])
    _, (logits, _) = _compose(m, plan.boundaries, (idx, targets))
    torch.testing.assert_close(logits, m(idx)[0], rtol=0, atol=0)


def test_profiles_are_cached(tmp_path):
    m = model()
    first = plan_source(m, Uneven, 2, sample=sample(), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = plan_source(m, Uneven, 2, sample=sample(), cache_dir=tmp_path)
    assert [c.time for c in again.costs] == [c.time for c in first.costs]


def test_measure_split_profiles_the_stages_of_a_given_split():
    m = model()
    costs = measure_split(m, Uneven, ["blocks.3", "norm"], sample=sample(), rounds=2)
    assert [c.name for c in costs] == ["emb", "blocks.3", "norm"]
    assert all(c.time > 0 and c.cost == c.time for c in costs)
    counts = segment_params()  # emb, blocks.0..7, norm, head
    assert [c.n_params for c in costs] == [sum(counts[:4]), sum(counts[4:9]), sum(counts[9:])]
    with pytest.raises(PartitionError, match=r"cannot split Uneven.forward at \['nope'\]"):
        measure_split(m, Uneven, ["nope"], sample=sample())
    with pytest.raises(PartitionError, match="rounds=0"):
        plan_source(m, Uneven, 2, sample=sample(), rounds=0)


def test_plans_a_meta_model_by_params_and_flops():
    """parallelize builds its reference on the meta device: no weights, shapes only."""
    with torch.device("meta"):
        meta = Uneven()
    real = model()
    assert plan_source(meta, Uneven, 4).boundaries == plan_source(real, Uneven, 4).boundaries
    idx, targets = sample()
    by_flops = plan_source(
        meta, Uneven, 3, sample=(idx.to("meta"), targets.to("meta")), cost="flops"
    )
    real_flops = plan_source(real, Uneven, 3, sample=(idx, targets), cost="flops")
    assert [c.flops for c in by_flops.costs] == [c.flops for c in real_flops.costs]
    assert by_flops.boundaries == real_flops.boundaries


# ---- a user's own cost ---------------------------------------------------------------


class _Isolate:
    """A user's cost (annot.plan.costs.UnitCost): the segment at ``name`` a
    thousand times the bytes the others hold."""

    needs = "params"

    def __init__(self, name):
        self.name = f"{name} x1000"
        self.segment = name

    def unit_costs(self, units):
        return [u.params * (1000.0 if u.name == self.segment else 1.0) for u in units]


def test_a_users_cost_object_isolates_the_segment_it_makes_expensive():
    m = model()
    bytes_held = plan_source(m, Uneven, 3, cost="params")
    assert "blocks.4" not in bytes_held.boundaries
    plan = plan_source(m, Uneven, 3, cost=_Isolate("blocks.3"))
    assert plan.boundaries == ("blocks.3", "blocks.4")  # stage 1 is blocks.3 alone
    assert plan.unit_costs[4] == 1000 * bytes_held.unit_costs[4]
    assert plan.cost == "blocks.3 x1000"
    assert "balanced cost: blocks.3 x1000" in plan.table()
    assert "'blocks.3' alone costs" in plan.warnings[0]
    assert plan.stage_memory == [d.total for d in plan.stage_detail]


def test_a_users_cost_needs_what_it_says():
    class Timed(_Isolate):
        needs = "time"

    with pytest.raises(PartitionError, match=r"cost='emb x1000' is measured on a sample input"):
        plan_source(model(), Uneven, 2, cost=Timed("emb"))

    class Unknown(_Isolate):
        needs = "bytes"

    with pytest.raises(PartitionError, match=r"needs='bytes'; expected one of"):
        plan_source(model(), Uneven, 2, cost=Unknown("emb"), sample=sample())


# ---- the one entry point: plan() over either unit source -----------------------------


def test_plan_over_source_segments_fits_as_it_splits():
    m = model()
    got = plan(m, 4, units=SourceSegments(Uneven), cost="params")
    assert got.unit_kind == "segments"
    assert got.units == ()
    budget = 2 * VOCAB * WIDTH * BYTES * 4
    fit = plan(m, 5, units=SourceSegments(Uneven), cost="params", memory=budget, fit=True)
    assert max(fit.partition.stage_memory) <= budget
    expected = plan(m, fit.n_stages, units=SourceSegments(Uneven), cost="params", memory=budget)
    assert fit.partition.bottleneck == expected.partition.bottleneck


def test_plan_over_module_units_is_one_stage_plan_with_one_table():
    from annot.plan.module_units import ModuleUnits, measure_units, plan_units
    from annot.plan.planner import StagePlan

    m = model()
    got = plan(m, 3, units=ModuleUnits(), sample=sample(), cost="flops")
    assert isinstance(got, StagePlan)
    assert got.unit_kind == "units"
    assert got.segments == tuple(u.path for u in got.units)
    expected = plan_units(measure_units(m, sample=sample(), cost="flops"), 3)
    assert got.boundaries == expected.boundaries
    assert got.table() == expected.table()
    assert got.table().startswith(f"annot plan: Uneven in 3 stages over {len(got.units)} units")
    assert got.stage_memory == [d.total for d in got.stage_detail]
    # measured once and planned from the measures (what_if, annot plan): the same plan
    measures = measure_units(m, sample=sample(), cost="flops")
    again = plan(m, 3, units=ModuleUnits(measures=measures))
    assert again.table() == got.table()
    doc = json.loads(json.dumps(got.to_json()))
    assert doc["units"] == list(got.segments)
    assert doc["stage_memory"] == got.stage_memory


def test_plan_refuses_what_is_not_a_unit_source():
    with pytest.raises(PartitionError, match=r"expected annot\.plan\.segment_plan\.SourceSegments"):
        plan(model(), 2, units="modules")


def test_plan_asks_the_unit_source():
    """plan() dispatches on the UnitSource protocol (an object with plan(...)),
    not on the two classes annot ships."""

    class Halves:
        def plan(self, model, n_stages, **options):
            return ("halves", n_stages, sorted(options))

    got = plan(model(), 2, units=Halves())
    assert got == (
        "halves",
        2,
        ["cost", "dp", "fit", "memory", "optimizer", "sample", "setup", "tp"],
    )
