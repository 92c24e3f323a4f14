"""annot.training.clip_grad: ``torch.nn.utils.clip_grad_norm_(model.parameters(),
max_norm)`` called on each rank of a pipeline or under tp, as training
scripts and trainers call it, clips by the whole model's norm: the total norm
and every gradient after clipping equal torch's on the single-device model
(for three settings, the inf norm included), the same norm on every rank;
and a part of the parameters is refused on every rank before any gradient
changes (tests.test_parallel_model._clip with how="torch"). Without the
guard each stage was clipped by its own norm, with no error."""

import pytest

from annot.testing import run_ranks
from tests.test_parallel_model import _clip


@pytest.mark.parametrize(
    "world, mesh_kw, microbatches",
    [(2, {"pp": 2}, 2), pytest.param(2, {"tp": 2}, 1, marks=pytest.mark.slow)],
    ids=["pp2", "tp2"],
)
def test_torch_clip_on_the_model_clips_by_the_whole_model(tmp_path, world, mesh_kw, microbatches):
    norms = run_ranks(_clip, world, str(tmp_path), mesh_kw, microbatches, "torch", timeout=400)
    assert all(n == norms[0] for n in norms)  # the same norm on every rank
