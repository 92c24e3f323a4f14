"""Per-rank sizes read from a config object the module holds
(``Local("config.n_head")``, ``@shard(local=("config.n_head",))``): divided
where the attention's forward reads them, while the config it shares with the
other blocks and the root keeps the full sizes. Parity with the single-device
model (loss and every gradient, over AdamW steps) at tp=2 on real gloo ranks,
through the decorator, external hints on the class, and on a built instance."""

from annot.testing import run_ranks

MODES = ["decorator", "class", "instance"]


def _build(mode: str):
    import torch

    import annot
    from annot import Col, Local, Row
    from tests.config_models import Config, ConfigLM

    mesh = annot.Mesh(tp=2)
    if mode == "decorator":  # HintedAttention's @shard(local=("config.n_head", ...))
        return annot.parallelize(ConfigLM, Config(), True, mesh=mesh, seed=0)
    hints = {
        "blocks.*.attn.c_attn": Col(chunks=3),
        "blocks.*.attn.c_proj": Row(),
        "blocks.*.attn": Local("config.n_head", "config.n_embd"),
        "blocks.*.fc": Col(),
        "blocks.*.proj": Row(),
    }
    if mode == "class":
        return annot.parallelize(ConfigLM, Config(), mesh=mesh, hints=hints, seed=0)
    torch.manual_seed(0)
    return annot.parallelize(ConfigLM(Config()), mesh=mesh, hints=hints)


def _check_config(root, mode: str) -> None:
    """One config, shared and whole: the root and every block hold the same object."""
    assert all(b.attn.config is root.config for b in root.blocks), mode
    assert (root.config.n_head, root.config.n_embd) == (4, 16), mode


def _train(mode: str) -> str:
    import torch

    import annot
    from tests.config_models import Config, ConfigLM
    from tests.parity import assert_close, compare_grads, compare_state

    model = _build(mode)
    torch.manual_seed(0)
    ref = ConfigLM(Config(), mode == "decorator")
    _check_config(model.module, mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (model, ref)]

    @annot.jit(model, microbatches=2)
    def step(x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(2):
        x = torch.randint(0, 32, (4, 6), generator=g)
        y = torch.randint(0, 32, (4, 6), generator=g)
        loss = step(x, y).reduce_mean()
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert_close(loss, ref_loss, f"{mode} step {i}: loss")
        compare_grads(model, ref, f"{mode} step {i}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    compare_state(model, ref, f"{mode} after 2 AdamW steps")
    _check_config(model.module, mode)
    return mode


def _run(cache: str) -> list[str]:
    import os

    os.environ["ANNOT_CACHE_DIR"] = cache
    return [_train(mode) for mode in MODES]


def test_sizes_on_a_shared_config_are_local_where_read(tmp_path):
    assert run_ranks(_run, 2, str(tmp_path), timeout=300) == [MODES, MODES]
