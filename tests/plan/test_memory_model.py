"""Planning from shapes (issue 32): a plan made on the meta device equals the
plan made on real weights; the activation bytes measured on meta equal what a
real CPU run keeps for backward (counted by address there, as only real
tensors allow); the what-if table of a small model, checked by hand; the
refusal of a plan that does not fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from annot import Col, Row, shard
from annot.plan.memory_model import Training, in_flight
from annot.plan.module_units import ModuleUnits, StageMemoryError, measure_units, plan_units
from annot.plan.planner import plan as plan_any
from annot.plan.segment_plan import SourceSegments
from annot.plan.units import block_paths
from annot.plan.what_if import factorisations, format_what_if, what_if

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _llama(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**LLAMA))


def _gpt(device: str = "cpu") -> nn.Module:
    from examples.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTConfig(n_layer=4))


def _ids(batch: int, seq: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)


def _hf_sample(batch, seq, device="cpu"):
    ids = _ids(batch, seq, device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _gpt_sample(batch, seq, device="cpu"):
    return (_ids(batch, seq, device), _ids(batch, seq, device))


@pytest.mark.parametrize("cost", ["params", "flops"])
@pytest.mark.parametrize("which", ["llama", "gpt"])
def test_a_plan_on_meta_equals_the_plan_on_real_weights(which, cost):
    build, sample = (_llama, _hf_sample) if which == "llama" else (_gpt, _gpt_sample)
    plans = [
        plan_any(build(dev), 3, units=ModuleUnits(), sample=sample(2, 16, dev), cost=cost)
        for dev in ("cpu", "meta")
    ]
    real, meta = plans
    assert [u.path for u in meta.units] == [u.path for u in real.units]
    assert meta.unit_costs == real.unit_costs
    assert meta.boundaries == real.boundaries
    assert meta.stage_memory == real.stage_memory
    assert min(d.activations for d in real.stage_detail) > 0


@pytest.mark.parametrize("cost", ["params", "flops"])
def test_the_stage_planner_on_meta_equals_it_on_real_weights(cost):
    from examples.gpt.model import GPT

    real, meta = (
        plan_any(_gpt(dev), 3, units=SourceSegments(GPT), sample=_gpt_sample(2, 16, dev), cost=cost)
        for dev in ("cpu", "meta")
    )
    assert meta.boundaries == real.boundaries
    assert [c.cost for c in meta.costs] == [c.cost for c in real.costs]
    assert [c.activations for c in meta.costs] == [c.activations for c in real.costs]
    assert meta.partition.stage_memory == real.partition.stage_memory


def _kept_by_address(model: nn.Module, sample, checkpoint: bool) -> int:
    """A real CPU forward: the bytes autograd keeps for backward, each storage
    once by its address (only real tensors have one), parameters left out."""
    from annot.runtime.recompute import (
        apply_recompute,
        remove_recompute,
    )

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            kept[s.data_ptr()] = s.nbytes()
        return t

    if checkpoint:
        names = dict(model.named_modules())
        apply_recompute(model, {type(names[b]) for b in block_paths(model)})
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**sample) if isinstance(sample, dict) else model(*sample)
        del out
    finally:
        remove_recompute(model)
    return sum(kept.values())


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
@pytest.mark.parametrize("batch, seq", [(1, 16), (2, 32), (4, 8)])
def test_activations_from_meta_equal_what_a_real_run_keeps(batch, seq, recompute):
    setup = Training(recompute=recompute)
    meta = measure_units(
        _llama("meta"), sample=_hf_sample(batch, seq, "meta"), cost="flops", setup=setup
    )
    predicted = sum(f.activations(1, recompute) for f in meta.figures)
    assert predicted == _kept_by_address(_llama(), _hf_sample(batch, seq), recompute)
    if recompute:  # a block's inputs, far less than what it saves inside
        plain = sum(f.saved for f in meta.figures)
        assert predicted < plain / 2
        assert max(f.recompute for f in meta.figures) > 0


def test_stage_activations_scale_with_the_microbatches_in_flight():
    setup = Training(microbatches=8, schedule="1f1b")
    measures = measure_units(
        _llama("meta"), sample=_hf_sample(2, 16, "meta"), cost="flops", setup=setup
    )
    plan = plan_units(measures, 4)
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]  # from the schedule as data
    assert in_flight("gpipe", 4, 8) == [8, 8, 8, 8]
    assert [d.in_flight for d in plan.stage_detail] == [4, 3, 2, 1]
    # and once, what backward holds in the gradients on their way (the logits' at the end)
    assert all(d.transient > 0 for d in plan.stage_detail)
    per_microbatch = [(d.activations - d.transient) // d.in_flight for d in plan.stage_detail]
    assert [
        p * n + d.transient for p, n, d in zip(per_microbatch, [4, 3, 2, 1], plan.stage_detail)
    ] == [d.activations for d in plan.stage_detail]
    assert sum(per_microbatch) == sum(f.saved for f in measures.figures)


# ---- the what-if table, checked by hand -----------------------------------------------


@shard(fc=Col(), proj=Row())
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)  # 544 params; Col: weight and bias split
        self.proj = nn.Linear(32, 16)  # 528 params; Row: weight split, bias whole

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)))


def _mlps() -> nn.Module:
    return nn.Sequential(*[MLP() for _ in range(4)])


def test_what_if_table_of_four_mlp_blocks_by_hand():
    # per block, weights at tp 1 / 2 / 4: 1072 / 544 (272 + 256 + 16) / 280 (136 + 128 + 16)
    # elements; AdamW fp32: 16 bytes each + 4 tensors x a 4-byte step
    block = {1: 1072 * 16 + 16, 2: 544 * 16 + 16, 4: 280 * 16 + 16}
    cost = {1: 1072, 2: 544, 4: 280}  # weighted params of this rank's share
    measures = measure_units(_mlps(), setup=Training(microbatches=8))
    choices = what_if(measures, 4, memory=18000)
    got = [(c.pp, c.tp, c.dp, c.fits) for c in choices]
    # fitting first by slowest x (1 + bubble): 1120 x 1, 1088 x 10/9, 1072 x 14/11
    assert got == [
        (1, 4, 1, True),  # 4 blocks at tp 4: 17984 bytes
        (2, 2, 1, True),  # 2 blocks at tp 2: 17440
        (4, 1, 1, True),  # 1 block: 17168
        (1, 2, 2, False),  # 2176 x 1; 34880 bytes
        (2, 1, 2, False),  # 2144 x 10/9; 34336
        (1, 1, 4, False),  # 4288; 68672
    ]
    for c in choices:
        per_stage = 4 // c.pp
        assert c.plan.stage_memory == [per_stage * block[c.tp]] * c.pp
        assert c.slowest == per_stage * cost[c.tp]
        assert c.bubble == (c.pp - 1) / (8 + c.pp - 1)
    table = format_what_if(choices, 4, 18000, "params")
    assert "  1   4   1" in table.splitlines()[3]
    assert table.splitlines()[3].endswith("yes")
    assert "leaves out communication" in table
    assert sorted(factorisations(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1)] + [
        (4, 1, 1)
    ]


def test_a_plan_that_does_not_fit_is_refused_naming_the_stage_its_memory_and_the_budget():
    with pytest.raises(StageMemoryError) as info:
        plan_any(_mlps(), 2, units=ModuleUnits(), memory=30000)
    # each stage: 2 blocks of 1072 elements x (4 + 4 + 8) bytes + 4 steps x 4 bytes = 34336
    assert str(info.value) == (
        "no split into 2 pipeline stages at tp=1 fits the memory budget of 29.3 KiB per "
        "device: stage 0 (0 .. 1) needs 33.5 KiB (weights 8.4 KiB, gradients 8.4 KiB, "
        "optimizer state 16.8 KiB). To fix: more pipeline stages or tensor-parallel degree, "
        "activation checkpointing, fewer microbatches in flight (a smaller microbatch), fsdp, "
        "or a larger budget"
    )
    assert info.value.plan.stage_memory == [34336, 34336]


# ---- parallelize(memory=...) ------------------------------------------------------------


def _parallelize_under(budget_small: str, budget_large: str):
    import annot

    def build(memory):
        return annot.parallelize(
            LlamaForCausalLM, LlamaConfig(**LLAMA), mesh=annot.Mesh(pp=2), seed=0, memory=memory
        )

    try:
        build(budget_small)
        refused = None
    except StageMemoryError as exc:
        refused = str(exc)
    model = build(budget_large)
    held = sum(p.numel() for p in model.module.parameters() if not p.is_meta)
    return refused, list(model.report.boundaries), held


@pytest.mark.slow  # two gloo ranks, two builds: ~20 s here
def test_parallelize_refuses_a_budget_no_split_fits_before_any_rank_allocates():
    from annot.testing import run_ranks

    # the model: 30 080 parameters, 16 bytes each with AdamW (+ 4 per tensor); no sample,
    # so the activations of the microbatch annot plan assumes too (1 x 2048 tokens, on meta)
    results = run_ranks(_parallelize_under, 2, "16MiB", "32MiB", timeout=240)
    from annot.hf.models import sample_inputs
    from annot.plan.planner import assumed_sample
    from annot.plan.units import call_order
    from annot.runtime.runners.stage_modules import record_calls

    ref = _llama("meta")
    order = call_order(record_calls(ref, sample_inputs(ref)))  # as parallelize probes it
    made, _ = assumed_sample(ref)
    made = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in made.items()}
    units = ModuleUnits(order=order)
    expected = plan_any(ref, 2, units=units, sample=made, memory=32 * 2**20)
    for refused, boundaries, held in results:
        assert refused.startswith(
            "no split into 2 pipeline stages at tp=1 fits the memory budget of 16.0 MiB per "
            "device: stage "
        )
        assert boundaries == list(expected.boundaries)
        assert 16 * held <= 32 * 2**20  # what this rank holds: weights, grads, 2 AdamW states
    assert max(expected.stage_memory) <= 32 * 2**20
    assert min(d.activations for d in expected.stage_detail) > 0


# ---- docs/planning.md's 70B commands: their output as shown, in seconds, in little memory ------


def _readme_plans() -> list[tuple[str, str]]:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    section = readme  # docs/planning.md is the section
    pairs = re.findall(r"```bash\n(annot plan .*?)\n```\n\n```\n(.*?)\n```", section, flags=re.S)
    return pairs


def test_the_readme_shows_two_plans_of_the_70b_shape():
    assert len(_readme_plans()) == 2


@pytest.mark.slow  # two ~12 s plans of the 70B shape
@pytest.mark.parametrize("command, shown", _readme_plans(), ids=["world-size-64", "pp8-tp8"])
def test_a_70b_plan_runs_as_the_readme_shows_in_seconds_and_little_memory(command, shown):
    import shlex
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = (
        "import sys; from annot.cli.main import main; rc = main(sys.argv[1:]); "
        "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]; "
        "print(peak.split()[1], file=sys.stderr); sys.exit(rc)"
    )
    argv = [sys.executable, "-c", run, *shlex.split(command)[1:]]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == shown
    assert seconds < 30
    peak_kib = int(done.stderr.split()[-1])  # the process's peak RSS (VmHWM)
    assert peak_kib < 2 * 1024**2


def test_the_stage_planner_counts_the_microbatches_in_flight_per_stage():
    from examples.gpt.model import GPT

    setup = Training(microbatches=8, schedule="1f1b")
    units = SourceSegments(GPT)
    plan = plan_any(_gpt("meta"), 3, units=units, sample=_gpt_sample(2, 16, "meta"), setup=setup)
    detail = plan.stage_detail
    assert [d.in_flight for d in detail] == [3, 2, 1]
    for st, d in zip(plan.stages(), detail):
        a, b = st["segments"]
        assert d.activations == d.in_flight * sum(c.activations for c in plan.costs[a:b])
        assert st["memory"] == d.total


# ---- cost="time" from a meta model: one unit materialized at a time -----------------------


def test_time_on_a_meta_model_materializes_one_unit_at_a_time():
    from annot.plan.unit_timing import time_units_alone
    from annot.plan.units import units

    with torch.device("meta"):
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)) for _ in range(4)]
        )
    found = units(model, [str(i) for i in range(4)], depth=1)
    largest = max(u.params for u in found)
    real_at_calls = []

    def count(module, args):  # the parameters with real storage, at every call
        real_at_calls.append(sum(p.numel() for p in model.parameters() if not p.is_meta))

    for m in model.modules():
        m.register_forward_pre_hook(count)
    times = time_units_alone(model, found, torch.zeros(8, 64, device="meta"), repeats=3)
    assert len(times) == len(found)
    assert all(t > 0 for t in times)
    assert max(real_at_calls) == largest < sum(u.params for u in found)
    assert all(p.is_meta and p.grad is None for p in model.parameters())  # left as it was
    sample = torch.zeros(8, 64, device="meta")
    plan = plan_any(model, 2, units=ModuleUnits(), sample=sample, cost="time")
    assert plan.cost == "time"
    assert len(plan.stage_costs) == 2
