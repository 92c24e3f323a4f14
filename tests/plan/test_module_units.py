"""Unit costs of the automatic pipeline split (annot.plan.module_units): forward and
backward are measured where they happen, not guessed as forward x 3."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from annot.core.errors import PartitionError
from annot.plan.module_units import ModuleUnits
from annot.plan.planner import plan

NAP = 0.03  # seconds; far above this machine's timer noise


def plan_modules(model, n, **kw):
    """annot.plan.planner.plan over the model's module units, the options of
    :class:`ModuleUnits` given among plan's."""
    opts = {k: kw.pop(k) for k in ("order", "stranded", "repeats") if k in kw}
    return plan(model, n, units=ModuleUnits(**opts), **kw)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(NAP)
        return g


class Glue(nn.Module):
    """Forward-only work (a mask, a table) before its weights' op: no backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(NAP)
        return self.lin(x)


class BackwardHeavy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _SlowBackward.apply(self.lin(x))


def test_forward_only_glue_and_backward_heavy_units_are_measured_where_they_run():
    model = nn.Sequential(Glue(), BackwardHeavy(), nn.Linear(4, 4))
    plan = plan_modules(model, 2, sample=torch.randn(2, 4), cost="time", repeats=3)
    costs = dict(zip((u.path for u in plan.units), plan.unit_costs))
    # forward x 3 would make the glue 3 naps and the backward-heavy unit ~0
    assert costs["1"] >= NAP * 0.9
    assert costs["0"] < NAP * 2
    assert plan.boundaries == ("1",)


# ---- FLOPs, memory, fit and tp over nested modules ---------------------------------------


def _stack(widths=(16, 16, 16, 48)) -> nn.Module:
    """Blocks of one linear in an nn.Sequential, the last of two (wider) linears."""
    return nn.Sequential(
        nn.Linear(16, 16),
        *[nn.Linear(16, 16) for _ in widths[1:-1]],
        nn.Sequential(nn.Linear(16, widths[-1]), nn.Linear(widths[-1], 16)),
    )


def test_flops_are_the_units_forward_and_backward_counts():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _stack(), torch.randn(8, 16)
    plan = plan_modules(model, 2, sample=(x,), cost="flops")
    with FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    counts = counter.get_flop_counts()
    per_block = [sum(counts[f"Sequential.{i}"].values()) for i in range(4)]
    # the blocks' parts (the last block's two linears) sum to the block
    assert [u.path for u in plan.units] == ["0", "1", "2", "3", "3.1"]
    assert plan.unit_costs[:3] == per_block[:3]
    assert sum(plan.unit_costs[3:]) == per_block[3]
    # min-bottleneck: [0, 1, 2, 3 (its first linear)] | [3.1] beats [0, 1, 2] | [3]
    assert plan.boundaries == ("3.1",)
    assert plan.stage_costs == [sum(plan.unit_costs[:4]), plan.unit_costs[4]]


def test_memory_counts_weights_gradients_and_optimizer_states():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    block = sum(p.numel() * 4 for p in model[0].parameters())  # float32 bytes
    plan = plan_modules(model, 2, optimizer="none")  # weights + gradients
    assert plan.stage_memory == [2 * 2 * block, 2 * 2 * block]
    plan = plan_modules(model, 2, optimizer="adamw")  # + 2 states each
    step = 4 * 2 * 2  # and AdamW's float32 step per parameter tensor: 2 layers x 2 tensors
    assert plan.stage_memory == [4 * 2 * block + step, 4 * 2 * block + step]


def test_fit_takes_the_fewest_stages_within_the_budget():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    block = sum(p.numel() * 4 for p in model[0].parameters()) * 4 + 8  # with AdamW (+ steps)
    plan = plan_modules(model, 4, memory=2 * block, fit=True)
    assert plan.boundaries == ("2",)
    assert plan.stage_memory == [2 * block, 2 * block]
    with pytest.raises(PartitionError, match="needs more than max_stages=2"):
        plan_modules(model, 2, memory=block, fit=True)  # 4 would fit


def test_tp_halves_what_the_transformers_tp_plan_splits():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = LlamaForCausalLM(cfg)
    # the plan splits every linear and the embedding (norms stay whole; the embedding
    # only where the installed transformers' plan names it); AdamW: 16 B/element and a
    # float32 step per tensor
    steps = 4 * len(list(model.parameters()))
    kinds = (nn.Linear, nn.Embedding) if "model.embed_tokens" in model.tp_plan else nn.Linear
    split = sum(m.weight.numel() for m in model.modules() if isinstance(m, kinds))
    whole = sum(p.numel() for p in model.parameters()) - split
    plan = plan_modules(model, 2, tp=2)
    assert sum(plan.stage_memory) == 16 * (split // 2 + whole) + steps
    assert sum(plan_modules(model, 2).stage_memory) == 16 * (split + whole) + steps


def test_a_block_whose_part_is_a_sequential_counts_its_weights():
    """HF ResNet: each encoder stage holds one nn.Sequential of layers. Its weights
    are a unit; before, they were skipped and stage 0 got the stem alone."""
    transformers = pytest.importorskip("transformers")
    from annot.plan.units import units

    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 2, 1, 1]
    )
    model = transformers.ResNetForImageClassification(cfg)
    found = {u.path: u.params for u in units(model)}
    for i in range(4):
        stage = model.resnet.encoder.stages[i]
        assert found[f"resnet.encoder.stages.{i}"] == sum(p.numel() for p in stage.parameters())
    assert sum(found.values()) == sum(p.numel() for p in model.parameters())
    plan = plan_modules(model, 2)
    assert plan.boundaries[0].startswith("resnet.encoder.stages."), plan.table()


@pytest.mark.parametrize("tie", [True, False])
def test_without_a_sample_an_embedding_weighs_nothing_and_a_tied_head_in_full(tie):
    # "params" stands for FLOPs per token: an embedding's table is looked up, the
    # head multiplies by it (tied or not). Old behaviour: a tied head weighed 0
    # and the embedding the whole table, so pp=2 put the embedding alone on stage 0
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    plan = plan_modules(model, 4)
    work = {u.path: u.work for u in plan.units}
    assert work["model.embed_tokens"] == 0
    assert work["lm_head"] == 4096 * 64
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert sum(work.values()) == 8 * layer + 4096 * 64 + 64  # the final norm's weight
    # the head (7 layers of work) is a stage of its own, the bottleneck no
    # split avoids; the layers share the other three stages
    assert plan.boundaries[0] != "model.layers.0"
    assert plan.boundaries[-1] == "lm_head"
    assert max(plan.stage_costs) == work["lm_head"], plan.stage_costs


def test_work_counts_each_module_once_across_nested_units():
    # a container with its own weight (ViT's embeddings: cls token + a projection)
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.cls = nn.Parameter(torch.zeros(8))
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) + self.cls

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = Emb()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, x):
            x = self.emb(x)
            for b in self.blocks:
                x = b(x)
            return x

    net = Net()
    plan = plan_modules(net, 2, sample=torch.zeros(2, 8))
    assert sum(u.work for u in plan.units) == sum(p.numel() for p in net.parameters())


def test_without_a_call_order_blocks_are_whole_units():
    # the block registers attn before the norm its forward calls first: a stage
    # that began at a part by registration order would not begin where forward
    # goes, so without a sample the block is one unit
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.attn(self.norm(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    with torch.device("meta"):
        net = Net()
    blind = plan_modules(net, 2)
    assert [u.path for u in blind.units] == ["blocks.0", "blocks.1", "blocks.2"]
    probed = plan_modules(Net(), 2, sample=torch.zeros(2, 8), cost="params")
    assert "blocks.0.attn" in [u.path for u in probed.units]  # with a call order: the parts


# ---- splits inside a block part -----------------------------------------------------------


class _Chain(nn.Module):
    """A block part whose own parts are called one after another."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


class _Experts(nn.Module):
    """Experts in a module list: called per routed token in real models, so
    no boundary goes among them."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        pick = self.router(x).softmax(-1)
        return sum(e(x) * pick[..., i : i + 1] for i, e in enumerate(self.experts))


class _Block(nn.Module):
    def __init__(self, experts: bool):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = _Chain()
        self.moe = _Experts() if experts else None

    def forward(self, x):
        x = x + self.mlp(self.norm(x))
        return x + self.moe(x) if self.moe is not None else x


class _Net(nn.Module):
    def __init__(self, n: int = 3, experts: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(experts) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_units_inside_a_part_are_its_parts_in_call_order_never_through_a_list():
    from annot.plan.units import call_order, coarser, units
    from annot.runtime.runners.stage_modules import record_calls

    net, x = _Net(2, experts=True), torch.randn(4, 16)
    order = call_order(record_calls(net, x))
    fine = units(net, order, depth=2)
    level = {u.path: u.level for u in fine}
    # fc1 begins its part, the part begins... after the norm, which begins the block
    assert level["blocks.0"] == 0
    assert level["blocks.0.mlp"] == 1
    assert level["blocks.0.mlp.fc2"] == level["blocks.0.mlp.fc3"] == 2
    assert "blocks.0.mlp.fc1" not in level
    # the experts are reached through a list: their part stays whole
    assert level["blocks.0.moe"] == 1
    assert not any(".moe." in p for p in level)
    assert [(u.path, u.params, u.work) for u in coarser(fine, 1)] == [
        (u.path, u.params, u.work) for u in units(net, order, depth=1)
    ]
    assert sum(u.params for u in fine) == sum(p.numel() for p in net.parameters())


def test_a_measured_split_begins_inside_a_part_only_where_it_pays():
    x = torch.randn(4, 16)
    # three blocks of three equal linears on two stages: at the parts, 6 | 3;
    # inside a part, 4 | 5
    plan = plan_modules(_Net(3), 2, sample=(x,), cost="flops")
    assert plan.boundaries == ("blocks.1.mlp.fc2",), plan.table()
    assert plan.imbalance == pytest.approx(10 / 9)
    # two blocks balance at a block: no boundary inside a part
    assert plan_modules(_Net(2), 2, sample=(x,), cost="flops").boundaries == ("blocks.1",)
    # parameter counts are too rough a proxy to go inside the parts
    coarse = plan_modules(_Net(3), 2, sample=(x,), cost="params")
    assert all(u.level < 2 for u in coarse.units)
    assert coarse.imbalance > 1.3


class _Gated(_Chain):
    """``fc3(relu(fc1(x)) * fc2(x))``: no stage can begin at fc2's call (fc1's
    output is a temporary then)."""

    def forward(self, x):
        return self.fc3(torch.relu(self.fc1(x)) * self.fc2(x))


def test_a_measured_split_never_begins_at_a_call_that_strands_a_tensor():
    from annot.runtime.runners.stranded import stranded

    net, x = _Net(3), torch.randn(4, 16)
    for block in net.blocks:
        block.mlp.__class__ = _Gated
    assert "blocks.1.mlp.fc2" in stranded(net, x)
    plan = plan_modules(net, 2, sample=(x,), cost="flops")
    assert plan.boundaries == ("blocks.1.mlp.fc3",), plan.table()  # 5 | 4, not 4 | 5 at fc2


class _SelfMatmul(nn.Module):
    """A part whose forward multiplies by itself besides its linears (attention)."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        return self.o((q @ q.transpose(-1, -2)).softmax(-1) @ x)


def test_flops_of_a_part_include_what_it_computes_itself():
    from torch.utils.flop_counter import FlopCounterMode

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _SelfMatmul()

        def forward(self, x):
            return x + self.attn(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    net, x = Net(), torch.randn(3, 8, 16)
    plan = plan_modules(net, 2, sample=(x,), cost="flops")
    with FlopCounterMode(display=False) as counter:
        net(x).sum().backward()
    part = sum(counter.get_flop_counts()["Net.blocks.1.attn"].values())
    # two blocks balance at a block; each block's unit (its part, measured as
    # the part's units q | o and added up) holds the part's own two matmuls
    assert [u.path for u in plan.units] == ["blocks.0", "blocks.1"]
    linears = sum(sum(counter.get_flop_counts()[f"Net.blocks.1.attn.{n}"].values()) for n in "qo")
    assert plan.unit_costs[1] == part > linears


def test_a_part_forward_never_calls_is_no_unit_its_called_parts_are():
    # the block calls self.p.a and self.p.b directly: a stage can begin at
    # either call, never at p (no call of p happens)
    from annot.plan.units import call_order, units
    from annot.runtime.runners.stage_modules import record_calls

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.p = nn.LayerNorm(8), Part()

        def forward(self, x):
            return self.p.b(self.p.a(self.norm(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    net, x = Net(), torch.randn(2, 8)
    order = call_order(record_calls(net, x))
    for depth in (1, 2):
        found = [(u.path, u.level) for u in units(net, order, depth)]
        assert found[:3] == [("blocks.0", 0), ("blocks.0.p.a", 1), ("blocks.0.p.b", 1)], found


# ---- a user's own cost ----------------------------------------------------------------------


class _Isolate:
    """A user's cost (annot.plan.costs.UnitCost): every unit costs 1, the one
    at ``path`` a thousand."""

    needs = "params"

    def __init__(self, path):
        self.path = path
        self.name = f"1, {path} 1000"

    def unit_costs(self, units):
        return [1000.0 if u.name == self.path else 1.0 for u in units]


def test_a_users_cost_object_isolates_the_unit_it_makes_expensive():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])
    even = plan_modules(model, 3)
    assert even.boundaries == ("2", "5")  # 2 + 3 + 3 equal units
    plan = plan_modules(model, 3, cost=_Isolate("2"))
    assert plan.boundaries == ("2", "3")  # the expensive unit alone in stage 1
    assert plan.unit_costs == [1.0, 1.0, 1000.0, *[1.0] * 5]
    assert plan.cost == "1, 2 1000"
    assert "balanced cost: 1, 2 1000" in plan.table()
    # the memory figures are the unit source's, whatever is balanced
    assert plan.stage_memory == [d.total for d in plan.stage_detail]


def test_a_users_cost_that_needs_a_sample_is_refused_without_one():
    from annot.core.errors import HintError

    class Measured(_Isolate):
        needs = "flops"

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    with pytest.raises(HintError, match=r"cost='1, 0 1000' needs sample="):
        plan_modules(model, 2, cost=Measured("0"))
    with pytest.raises(HintError, match=r"annot\.plan\.costs\.UnitCost"):
        plan_modules(model, 2, cost=object())
