"""What the executor asks a stage runner (annot.runtime.stage_runner): where the
step body runs, and how a stage's function is called on its inputs."""

import pytest
import torch.nn as nn

from annot.core.errors import PipelineError
from annot.runtime.pipeline import LocalStage, PipelineExecutor
from annot.runtime.stage_runner import ReplayRunner, SourceRunner


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
