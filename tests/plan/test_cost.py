"""annot.plan.cost: FLOPs, bytes, activations and timing per segment, the cache,
the bridge to the partitioner and the table. Single process, tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from annot.core.errors import PartitionError
from annot.plan.cost import partition_args, profile_segments
from annot.plan.cost_cache import cache_key
from annot.plan.cost_segments import Segment, SegmentCost
from annot.plan.cost_table import format_partition_table
from annot.plan.partition import partition

F32 = 4  # bytes per float32 element
N = 8  # rows in the sample microbatch


def linear_stack():
    torch.manual_seed(0)
    return [nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 8, bias=False)]


def test_flops_params_and_bytes_of_a_linear_stack():
    segs = linear_stack()
    x = torch.randn(N, 16)  # data: no grad, as in training
    costs = profile_segments(segs, x, repeats=1, warmup=0, progress=False)
    assert [c.name for c in costs] == ["0:Linear", "1:Linear", "2:Linear"]
    for c, (i, o, bias), first in zip(costs, [(16, 32, 1), (32, 64, 1), (64, 8, 0)], [1, 0, 0]):
        fwd = 2 * N * i * o  # FlopCounterMode: the bias add is not counted
        assert c.forward_flops == fwd
        # Backward: the weight gradient (one matmul), plus the input gradient
        # (another) except for the first segment, whose input needs none.
        assert c.flops == fwd + (1 if first else 2) * fwd
        n_params = i * o + bias * o
        assert c.n_params == n_params
        assert c.params == c.grads == n_params * F32
        assert c.optimizer == 2 * n_params * F32  # AdamW: exp_avg, exp_avg_sq
        assert c.activations == N * i * F32  # the saved input; the weight is not counted
        assert c.output_bytes == N * o * F32
        assert c.buffers == 0
        assert c.shared == {}
        assert c.memory == c.params + c.grads + c.optimizer + c.activations
        assert c.time > 0
        assert c.cost == c.time


@pytest.mark.parametrize("optimizer, states", [("adamw", 2), ("adam", 2), ("sgd", 1), ("none", 0)])
def test_optimizer_state_bytes(optimizer, states):
    torch.manual_seed(0)
    lin = nn.Linear(10, 20)
    frozen = nn.Linear(20, 5)
    frozen.requires_grad_(False)
    seg = Segment(nn.Sequential(lin, frozen), (lin, frozen), "both")
    (c,) = profile_segments(
        [seg], torch.randn(3, 10), optimizer=optimizer, repeats=1, progress=False
    )
    trainable, fixed = (10 * 20 + 20) * F32, (20 * 5 + 5) * F32
    assert c.params == trainable + fixed
    assert c.grads == trainable
    assert c.optimizer == states * trainable


def test_times_are_ordered_by_work():
    torch.manual_seed(0)
    small, big = nn.Linear(64, 64), nn.Linear(1024, 1024)
    # Each segment gets its own input: a plain callable ignoring the state.
    x_small, x_big = torch.randn(64, 64), torch.randn(256, 1024)
    segs = [
        Segment(lambda *_: small(x_small), (small,), "small"),
        Segment(lambda *_: big(x_big), (big,), "big"),
    ]
    costs = profile_segments(segs, torch.zeros(1), repeats=3, progress=False)
    assert costs[1].flops > 500 * costs[0].flops
    assert costs[1].time > costs[0].time  # a coarse ordering, no threshold


def test_cost_picks_the_scalar():
    segs, x = linear_stack(), torch.randn(N, 16)
    flops = profile_segments(segs, x, cost="flops", repeats=1, progress=False)
    params = profile_segments(segs, x, cost="params", repeats=1, progress=False)
    assert [c.cost for c in flops] == [float(c.flops) for c in flops]
    assert [c.cost for c in params] == [float(c.params) for c in params]


class Head(nn.Module):
    """An LM head that reuses the embedding's weight."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, h):
        return h @ self.emb.weight.t()


def tied_model():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    block = nn.Linear(16, 16)
    head = Head(emb)
    return emb, block, head


def test_tied_weights_are_shared_and_charged_once_per_stage():
    emb, block, head = tied_model()
    costs = profile_segments([emb, block, head], torch.randint(0, 50, (N, 4)), progress=False)
    key = "0:weight"
    weight = 50 * 16 * F32
    assert costs[0].shared == {key: weight * 4}  # param + grad + 2 AdamW states
    assert costs[2].shared == {key: weight * 4}
    assert costs[1].shared == {}
    assert costs[2].params == weight
    assert costs[2].n_params == 50 * 16
    args = partition_args(costs)
    assert args["shared"] == [(weight * 4, {0, 2})]
    assert args["memories"][0] == costs[0].memory - weight * 4
    p = partition(**args, n_stages=1)
    assert p.stage_memory == [sum(args["memories"]) + weight * 4]
    table = format_partition_table(p, None, costs)
    assert f"{(50 * 16 + 16 * 16 + 16) / 1000:.1f} K" in table  # the tied weight counted once


def test_segments_as_callables_with_modules_or_a_modules_attribute():
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)

    class Seg:
        modules = (b,)
        name = "tail"

        def __call__(self, h):
            return b(h).relu()

    costs = profile_segments(
        [lambda h: a(h) * 2, Seg()],
        torch.randn(2, 4),
        modules=[[a], [b]],
        progress=False,
        repeats=1,
    )
    assert [c.n_params for c in costs] == [20, 10]
    assert costs[1].name == "tail"
    costs = profile_segments(
        [Segment(a, (a,)), Seg()], torch.randn(2, 4), progress=False, repeats=1
    )
    assert [c.n_params for c in costs] == [20, 10]
    assert costs[0].name == "segment0"


def test_cache_hit_does_not_profile_again(tmp_path):
    calls = []
    lin = nn.Linear(8, 8)

    def seg(h):
        calls.append(1)
        return lin(h)

    x = torch.randn(4, 8)
    first = profile_segments([Segment(seg, (lin,), "lin")], x, cache_dir=tmp_path, progress=False)
    assert calls, "the first run profiles"
    assert len(list(tmp_path.glob("*.json"))) == 1
    calls.clear()
    again = profile_segments([Segment(seg, (lin,), "lin")], x, cache_dir=tmp_path, progress=False)
    assert calls == []
    assert again == first
    flops = profile_segments(
        [Segment(seg, (lin,), "lin")], x, cache_dir=tmp_path, progress=False, cost="flops"
    )
    assert calls == []
    assert flops[0].cost == float(first[0].flops)
    # Another input shape is another key, and is profiled.
    assert cache_key([Segment(seg, (lin,), "lin")], torch.randn(5, 8)) != cache_key(
        [Segment(seg, (lin,), "lin")], x
    )
    profile_segments(
        [Segment(seg, (lin,), "lin")], torch.randn(5, 8), cache_dir=tmp_path, progress=False
    )
    assert calls
    # So is every other setting the measurement depends on.
    segs = [Segment(seg, (lin,), "lin")]
    base = cache_key(segs, x)
    for change in ({"optimizer": "sgd"}, {"repeats": 3}, {"warmup": 2}):
        assert cache_key(segs, x, **change) != base, change


def test_corrupt_cache_is_ignored(tmp_path):
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    (tmp_path / f"{cache_key([lin], x)}.json").write_text("{not json")
    (c,) = profile_segments([lin], x, cache_dir=tmp_path, progress=False, repeats=1)
    assert c.n_params == 6


def test_gradients_rng_and_mode_are_left_alone():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    drop = nn.Sequential(lin, nn.Dropout(0.5))
    marker = torch.full_like(lin.weight, 7.0)
    lin.weight.grad = marker
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    profile_segments([drop], x, progress=False, repeats=2)
    assert lin.weight.grad is marker
    assert lin.bias.grad is None
    assert torch.equal(torch.get_rng_state(), state)
    assert drop.training


def test_progress_on_stderr(capsys):
    segs, x = linear_stack(), torch.randn(N, 16)
    profile_segments(segs, x, progress=True, repeats=1)  # stderr is not a terminal here
    assert capsys.readouterr().err == ""
    profile_segments(segs, x, progress="always", repeats=1)
    err = capsys.readouterr().err
    assert "profiling segment 1/3 (0:Linear) ..." in err
    assert "profiling segment 3/3 (2:Linear) ..." in err
    assert "profiled 3 segments in" in err


def test_partition_table():
    segs, x = linear_stack(), torch.randn(N, 16)
    costs = profile_segments(segs, x, cost="flops", repeats=1, progress=False)
    p = partition(**partition_args(costs, bandwidth=1e9), n_stages=2)
    table = format_partition_table(p, ["fc1", "fc2", "fc3"], costs)
    lines = table.splitlines()
    assert lines[0].split() == [
        "stage",
        "first",
        "last",
        "params",
        "FLOPs",
        "time",
        "memory",
        "sends",
    ]
    assert len(lines) == 2 + 2 + 1
    assert lines[-1] == f"imbalance (max/mean stage cost): {p.imbalance:.2f}"
    first = lines[2].split()
    assert first[:3] == ["0", "fc1", "fc1" if p.bounds[0] == (0, 1) else "fc2"]
    assert lines[3].rstrip().endswith("-")  # the last stage sends nothing


def test_bad_arguments():
    lin = nn.Linear(2, 2)
    with pytest.raises(PartitionError, match="cost='speed'; expected 'time', 'flops' or 'params'"):
        profile_segments([lin], torch.randn(1, 2), cost="speed")
    with pytest.raises(PartitionError, match="plain SGD keeps no state: 'none'"):
        profile_segments([lin], torch.randn(1, 2), optimizer="lion")
    with pytest.raises(PartitionError, match="modules has 2 entries for 1 segments"):
        profile_segments([lin], torch.randn(1, 2), modules=[[lin], [lin]])
    with pytest.raises(PartitionError, match="segment 0 is a int"):
        profile_segments([3], torch.randn(1, 2))


def test_segment_cost_round_trips_through_json_fields():
    c = SegmentCost("x", 1, 1, 1, 2, 0, 3, 4, 2, 0.5, 8, {"0:w": 4}, {"0:w": 1}, 0.5)
    assert c.memory == 1 + 1 + 2 + 0 + 3
