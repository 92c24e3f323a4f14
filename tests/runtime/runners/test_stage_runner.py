"""What the executor asks a stage runner (annot.runtime.runners.stage_runner): where the
step body runs, and how a stage's function is called on its inputs."""

import pytest
import torch
import torch.nn as nn

from annot.core.errors import PipelineError
from annot.runtime.pipeline.executor import LocalStage, PipelineExecutor
from annot.runtime.runners.stage_runner import ReplayRunner, SourceRunner


def _echo(*args, **kwargs):
    return args, kwargs


def test_the_source_runner_calls_stage_0_with_the_model_call_and_later_stages_with_what_they_receive():
    runner = SourceRunner()
    assert not runner.body_runs_every_stage
    first = LocalStage(index=0, fn=_echo)
    assert runner.run_stage(first, None, ((1, 2), {"k": 3})) == ((1, 2), {"k": 3})
    later = LocalStage(index=1, fn=_echo)
    assert runner.run_stage(later, {"h": 1}, None) == ((), {"h": 1})
    assert runner.run_stage(later, (1, 2), None) == ((1, 2), {})
    assert runner.run_stage(later, [1, 2], None) == (([1, 2],), {})
    with pytest.raises(PipelineError, match="do not stop inside the model call"):
        runner.outputs_at_cut(later)


def test_the_replay_runner_runs_the_model_call_as_the_stage():
    runner = ReplayRunner()
    assert runner.body_runs_every_stage
    seen = []

    def stage_fn(received, call):
        seen.append(received)
        return call()

    class Model(nn.Module):
        def forward(self, x, scale=1):
            return x * scale

    stage = LocalStage(index=1, fn=stage_fn, module=Model(), runner=runner)
    assert runner.run_stage(stage, {"from": 0}, ((2,), {"scale": 3})) == 6
    assert seen == [{"from": 0}]
    with pytest.raises(PipelineError, match=r"give its LocalStage the model \(module=\)"):
        runner.run_stage(LocalStage(index=1, fn=stage_fn), None, ((2,), {}))


def test_the_executor_takes_the_runner_of_its_stages_and_refuses_two():
    ex = PipelineExecutor([LocalStage(index=0, fn=_echo)], num_stages=1, ctx=None)
    assert isinstance(ex.runner, SourceRunner)
    replay = LocalStage(index=0, fn=_echo, runner=ReplayRunner())
    assert PipelineExecutor([replay], num_stages=1, ctx=None).runner is replay.runner
    mixed = [LocalStage(index=0, fn=_echo), LocalStage(index=1, fn=_echo, runner=ReplayRunner())]
    with pytest.raises(PipelineError, match="different runners \\(ReplayRunner, SourceRunner\\)"):
        PipelineExecutor(mixed, num_stages=2, ctx=None, chunks=2, schedule="interleaved")


def test_the_last_stage_takes_from_the_call_what_only_it_reads():
    from types import SimpleNamespace

    from annot.runtime.runners.stage_runner import FROM_CALL, call_supplied

    def method(index, inputs, untouched):
        return SimpleNamespace(index=index, inputs=inputs, untouched=untouched)

    stages = [
        method(0, ("x", "y", "w"), ("y", "w")),
        method(1, ("h", "y", "w"), ("y",)),  # reads w
        method(2, ("h", "y", "w"), ()),
    ]
    assert call_supplied(stages) == {"y"}
    assert call_supplied(stages[:1]) == frozenset()

    class Model(nn.Module):
        def _annot_stage_0(self, x, y, w=2):
            return {"h": x + 1, "y": y, "w": w}

        def _annot_stage_1(self, h, y, w):
            seen.append(y)
            return {"h": h * w, "y": y, "w": w}

        def _annot_stage_2(self, h, y, w):
            return h - y

    seen: list = []
    split = SimpleNamespace(
        stages=[method(k, s.inputs, s.untouched) for k, s in enumerate(stages)], wrappers=()
    )
    for k, s in enumerate(split.stages):
        s.method = f"_annot_stage_{k}"
    runner = SourceRunner(split)
    model = Model()
    layout = SimpleNamespace(local_stage_ids=[0, 1, 2])
    fns = runner.stage_functions(model, layout, lambda f: f)
    x, y = torch.ones(2), torch.full((2,), 5.0)
    out0 = runner.run_stage(LocalStage(0, fns[0]), None, ((x, y), {}))
    assert set(out0) == {"h", "w"}  # y is left out: the last stage has the call
    out1 = runner.run_stage(LocalStage(1, fns[1]), out0, None)
    assert seen == [FROM_CALL]
    assert set(out1) == {"h", "w"}
    out2 = runner.run_stage(LocalStage(2, fns[2]), out1, ((x, y), {}))
    assert torch.equal(out2, (x + 1) * 2 - y)
    # sent as before where the call's value would differ from stage 0's
    assert "y" in runner.run_stage(LocalStage(0, fns[0]), None, ((x, x[:1]), {}))  # shares x
    assert "y" in runner.run_stage(LocalStage(0, fns[0]), None, ((x, y.requires_grad_()), {}))
    with pytest.raises(PipelineError, match=r"takes \['y'\] from the model call"):
        runner.run_stage(LocalStage(2, fns[2]), out1, None)


def test_a_stage_that_changes_the_containers_it_receives_leaves_them_whole():
    """B finds the received tensors in the stage's inputs again: a stage that
    pops from a received list (a U-Net's saved activations) must not take one
    out of what the executor holds."""
    runner = SourceRunner()

    def stage(x, saved):
        return x + saved.pop()

    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    inputs = {"x": a, "saved": [b]}
    runner.run_stage(LocalStage(1, stage), inputs, None)
    assert inputs["saved"] == [b]


def test_an_argument_whose_memory_cannot_be_read_leaves_the_target_sent():
    """A sparse tensor among the call's arguments: whether it shares the
    target's memory cannot be asked, so the target is sent as before."""
    from types import SimpleNamespace

    class Model(nn.Module):
        def _annot_stage_0(self, x, adj, y):
            return {"h": torch.sparse.mm(adj, x), "y": y}

        def _annot_stage_1(self, h, y):
            return h - y

    def method(index, inputs, untouched):
        return SimpleNamespace(
            index=index, inputs=inputs, untouched=untouched, method=f"_annot_stage_{index}"
        )

    split = SimpleNamespace(
        stages=[method(0, ("x", "adj", "y"), ("y",)), method(1, ("h", "y"), ())], wrappers=()
    )
    runner = SourceRunner(split)
    fns = runner.stage_functions(Model(), SimpleNamespace(local_stage_ids=[0, 1]), lambda f: f)
    x, y = torch.ones(2, 2), torch.zeros(2, 2)
    adj = torch.eye(2).to_sparse()
    out = runner.run_stage(LocalStage(0, fns[0]), None, ((x, adj, y), {}))
    assert out["y"] is y
