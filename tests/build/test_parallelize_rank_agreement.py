"""Every rank plans its pipeline stages alone (no rank builds the whole model);
ranks that plan differently are refused at build, on every rank, naming them,
instead of hanging or mixing stages at the first step."""

import pytest

from annot.testing import RanksFailed, run_ranks


def _split_by_rank(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch.distributed as dist

    import annot
    from examples.gpt.model import GPT, GPTConfig

    split = ["h.1"] if dist.get_rank() == 0 else ["h.2"]  # a user's mistake
    cfg = GPTConfig(n_layer=3, n_embd=16, vocab_size=32, block_size=8)
    try:
        annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=2), seed=0, split=split)
    except annot.PipelineError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_ranks_that_plan_other_stages_are_refused_on_every_rank(tmp_path):
    found = run_ranks(_split_by_rank, 2, str(tmp_path))
    for message in found:
        assert message is not None
        assert "ranks [1] planned other pipeline stages than rank 0" in message
        assert "split=[...]" in message


@pytest.mark.slow
def test_the_random_state_check_still_names_the_rank(tmp_path):
    with pytest.raises(RanksFailed, match="would build different initial weights"):
        run_ranks(_unseeded_by_rank, 2, str(tmp_path))


def _unseeded_by_rank(cache: str):
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    import torch
    import torch.distributed as dist

    import annot
    from examples.gpt.model import GPT, GPTConfig

    torch.manual_seed(dist.get_rank())
    cfg = GPTConfig(n_layer=2, n_embd=16, vocab_size=32, block_size=8)
    annot.parallelize(GPT, cfg, mesh=annot.Mesh(pp=2))
