"""Hooks users and libraries attach to a model's modules run as on one device:
forward hooks and pre-hooks (with kwargs) on the root and inside, on layers
tp splits (given the layer's whole tensors, whatever the hook does with them)
and on others, whichever path built the model (a class whose ``__init__``
registers them, an instance that carries them) and in pipelines under both
runners. Loss and every gradient against the single device, over two AdamW
steps; hooks annot cannot honour refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from annot import Col, Row
from annot.testing import run_ranks

HINTS = {"blocks.*.fc1": Col(), "blocks.*.fc2": Row()}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.out = nn.Linear(d, d)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _softmax_mix(module, args, out):  # not elementwise: reads every output feature
    return out + 0.5 * torch.softmax(out, dim=-1)


def _shift_input(module, args, kwargs):  # a pre-hook with kwargs, not elementwise
    (x,) = args
    return (x - x.mean(dim=-1, keepdim=True),), kwargs


def _scale_root(module, args, out):
    return out * 1.5


def _root_input(module, args):
    return (args[0] * 0.5 + 0.25,)


class HookedNet(Net):
    """A model that registers hooks on its own layers (as libraries do)."""

    def __init__(self, d: int = 16, n: int = 4):
        super().__init__(d, n)
        self.blocks[1].fc1.register_forward_hook(_softmax_mix)
        self.blocks[2].fc2.register_forward_pre_hook(_shift_input, with_kwargs=True)


def _attach(model: nn.Module) -> None:
    """The same hooks, attached from outside (to an instance)."""
    model.blocks[1].fc1.register_forward_hook(_softmax_mix)
    model.blocks[2].fc2.register_forward_pre_hook(_shift_input, with_kwargs=True)
    model.blocks[0].register_forward_hook(lambda m, a, out: out * 2.0)
    model.register_forward_pre_hook(_root_input)
    model.register_forward_hook(_scale_root)


def _train(cache: str, how: str, mesh_kw: dict, runner: str | None):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot
    from tests.parity import train_mse_against_reference

    mesh = annot.Mesh(**mesh_kw)
    torch.manual_seed(0)
    ref = HookedNet() if how == "class" else Net()
    if how != "class":
        _attach(ref)
    split = {"split": ["blocks.2"], "runner": runner} if mesh.pp > 1 else {}
    hints = HINTS if mesh.tp > 1 else None
    if how == "class":
        model = annot.parallelize(HookedNet, mesh=mesh, seed=0, hints=hints, **split)
    else:
        torch.manual_seed(0)
        inst = Net()
        _attach(inst)
        model = annot.parallelize(inst, mesh=mesh, hints=hints, **split)
    if how == "after":  # on the parallel model's modules, after it is built
        model = annot.parallelize(Net, mesh=mesh, seed=0, hints=hints, **split)
        _attach(model.module)

    train_mse_against_reference(model, ref, f"{how} {mesh_kw} {runner}")
    return True


@pytest.mark.parametrize(
    "how, mesh_kw, runner",
    [
        ("instance", {"tp": 2}, None),
        ("class", {"tp": 2}, None),
        pytest.param("after", {"tp": 2}, None, marks=pytest.mark.slow),
        ("instance", {"pp": 2}, "source"),
        pytest.param("instance", {"pp": 2}, "replay", marks=pytest.mark.slow),
        pytest.param("instance", {"pp": 2, "tp": 2}, "source", marks=pytest.mark.slow),
    ],
)
def test_hooks_run_as_on_one_device(tmp_path, how, mesh_kw, runner):
    import annot

    assert all(run_ranks(_train, annot.Mesh(**mesh_kw).size, str(tmp_path), how, mesh_kw, runner))


def _backward_hook_refused(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    model = annot.parallelize(Net, mesh=annot.Mesh(tp=2), seed=0, hints=HINTS)
    model.module.blocks[0].fc1.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(annot.IntegrationError) as e:
        model(torch.randn(2, 3, 16))
    return str(e.value)


def test_a_backward_hook_on_a_split_layer_is_refused(tmp_path):
    said = run_ranks(_backward_hook_refused, 2, str(tmp_path))[0]
    assert said.startswith("a backward hook on 'blocks.0.fc1', a ColumnParallelLinear split")


def _root_backward_hook_refused(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    model = annot.parallelize(Net, mesh=annot.Mesh(pp=2), seed=0, split=["blocks.2"])
    model.module.register_full_backward_hook(lambda m, gi, go: None)

    @annot.jit(model, microbatches=2)
    def step(x):
        model.backward(model(x).sum())

    with pytest.raises(annot.IntegrationError) as e:
        step(torch.randn(2, 3, 16))
    return str(e.value)


def test_a_backward_hook_on_a_pipelines_root_is_refused(tmp_path):
    said = run_ranks(_root_backward_hook_refused, 2, str(tmp_path))[0]
    assert said.startswith("a backward hook on the root module (Net) of a pipeline")


def _hook_inside_a_tp_region(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    torch.manual_seed(0)
    inst = Net()
    inst.blocks[0].act.register_forward_hook(lambda m, a, out: out / out.norm())
    model = annot.parallelize(inst, mesh=annot.Mesh(tp=2), hints=HINTS)
    with pytest.raises(annot.IntegrationError) as e:
        model(torch.randn(2, 3, 16))
    return str(e.value)


def test_a_hook_on_a_module_inside_a_tp_region_is_refused(tmp_path):
    """The GELU between a column and a row layer sees a shard of its features:
    its hook (here a norm over them) would see a part; refused by the first
    call, naming the module and the shapes."""
    said = run_ranks(_hook_inside_a_tp_region, 2, str(tmp_path))[0]
    assert said.startswith("a forward hook on 'blocks.0.act' (GELU): under tp"), said
    assert "(2, 3, 32)" in said, said  # this rank's half of the 64 features
    assert "(2, 3, 64)" in said, said


def _hook_blocks(model: nn.Module) -> None:
    """A library's helper: picks the modules to hook by their class."""
    for m in model.modules():
        if isinstance(m, Block):
            m.fc1.register_forward_hook(_softmax_mix)


class ClassHookedNet(Net):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__(d, n)
        _hook_blocks(self)


def _hooks_by_class(cache: str):
    os.environ["ANNOT_CACHE_DIR"] = cache
    import annot

    try:
        annot.parallelize(ClassHookedNet, mesh=annot.Mesh(tp=2), hints=HINTS, seed=0)
    except annot.IntegrationError as e:
        refused = str(e)
    torch.manual_seed(0)
    model = annot.parallelize(ClassHookedNet(), mesh=annot.Mesh(tp=2), hints=HINTS)
    torch.manual_seed(0)
    ref = ClassHookedNet()
    x = torch.randn(2, 3, 16)
    out = model(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=4e-5)
    return refused


def test_hooks_picked_by_class_refused_when_built_from_the_class(tmp_path):
    """``isinstance(m, Block)`` outside ``Block`` is False for annot's rewritten
    copy of ``Block``: built from the class, the hooks would be lost, so it
    is refused at build naming the fix; the instance keeps them, exactly."""
    said = run_ranks(_hooks_by_class, 2, str(tmp_path))[0]
    assert said.startswith(
        "ClassHookedNet(...) registers hooks on ['blocks.0.fc1', 'blocks.1.fc1', "
    ), said
    assert "annot.parallelize(model, ...)" in said, said
