"""annot.runtime.recompute and the ``@recompute`` hint: checkpointed models give
the plain model's loss and gradients (dropout included: the recomputation
replays the same masks) and keep fewer activations for backward.

Single process: checkpointing is local to a rank.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from annot.core.errors import HintError
from annot.core.hints import (
    checkpoint,
    get_recompute,
    recompute,
    recomputed_classes,
    stage,
    stage_recompute,
)
from annot.runtime.recompute import (
    apply_recompute,
    recompute_stage,
)
from examples.gpt.model import GPT, Block, GPTConfig

CFG = dict(block_size=16, vocab_size=64, n_layer=3, n_head=4, n_embd=32)


def _batch(seed=0, b=2, t=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG["vocab_size"], (b, t), generator=g)
    y = torch.randint(0, CFG["vocab_size"], (b, t), generator=g)
    return x, y


def _loss_and_grads(model, x, y, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair(dropout):
    cfg = GPTConfig(**CFG, dropout=dropout)
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    ckpt = GPT(cfg)
    return plain, ckpt


def _assert_same(a, b, what):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), f"{what}: loss {loss_a} != {loss_b}"
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), f"{what}: grad {n} differs"


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointed_gpt_equals_plain(dropout):
    plain, ckpt = _pair(dropout)
    keys = list(ckpt.state_dict())
    assert apply_recompute(ckpt, {Block}) == CFG["n_layer"]
    assert list(ckpt.state_dict()) == keys  # no wrapper level in the keys
    assert [n for n, _ in ckpt.named_modules()] == [n for n, _ in plain.named_modules()]
    x, y = _batch()
    for step_seed in (1, 2):
        _assert_same(
            _loss_and_grads(plain, x, y, step_seed),
            _loss_and_grads(ckpt, x, y, step_seed),
            f"dropout={dropout} seed={step_seed}",
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_gpt_equals_plain_on_cuda_with_dropout():
    plain, ckpt = _pair(0.2)
    plain, ckpt = plain.cuda(), ckpt.cuda()
    apply_recompute(ckpt, {Block})
    x, y = (t.cuda() for t in _batch())
    _assert_same(_loss_and_grads(plain, x, y, 1), _loss_and_grads(ckpt, x, y, 1), "cuda dropout")


def test_dropout_test_would_see_different_masks():
    """The dropout parity above can fail: without restoring the generator the
    recomputation draws other masks and the gradients differ."""
    plain, ckpt = _pair(0.2)
    for block in ckpt.h:
        fwd = block.forward
        block.forward = lambda x, fwd=fwd: torch_checkpoint(
            fwd, x, use_reentrant=False, preserve_rng_state=False
        )
    x, y = _batch()
    loss_p, grads_p = _loss_and_grads(plain, x, y, 1)
    loss_c, grads_c = _loss_and_grads(ckpt, x, y, 1)
    assert torch.equal(loss_p, loss_c)  # the first forward is the same
    assert any(not torch.equal(grads_p[n], grads_c[n]) for n in grads_p)


def test_eval_and_no_grad_run_the_plain_forward():
    plain, ckpt = _pair(0.2)
    apply_recompute(ckpt, {Block})
    x, y = _batch()
    plain.eval(), ckpt.eval()
    with torch.no_grad():
        assert torch.equal(plain(x, y)[1], ckpt(x, y)[1])


def test_wrapping_twice_and_nested_classes_count_once():
    plain, ckpt = _pair(0.0)
    assert apply_recompute(ckpt, {Block}) == 3
    assert apply_recompute(ckpt, {Block}) == 0
    _, fresh = _pair(0.0)
    # the MLPs are inside the checkpointed blocks: the outer recomputation covers them
    from examples.gpt.model import MLP

    assert apply_recompute(fresh, {Block, MLP}) == 3
    assert apply_recompute(_pair(0.0)[1], {MLP}) == 3


def test_deepcopy_keeps_checkpointing_on_the_copy():
    plain, ckpt = _pair(0.0)
    apply_recompute(ckpt, {Block})
    twin = copy.deepcopy(ckpt)
    assert twin.h[0].forward.__wrapped__.__self__ is twin.h[0]
    x, y = _batch()
    _assert_same(_loss_and_grads(plain, x, y, 0), _loss_and_grads(twin, x, y, 0), "deepcopy")
    assert all(p.grad is None for p in ckpt.parameters())  # the original was not touched


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, scale, bias=None, debug=False):  # debug: a name checkpoint() uses
        y = torch.tanh(self.lin(x)) * scale
        return {"y": y if bias is None else y + bias, "n": 3}


def test_keyword_arguments_and_dict_outputs():
    torch.manual_seed(0)
    plain = Scaled()
    ckpt = copy.deepcopy(plain)
    assert apply_recompute(ckpt, [Scaled]) == 1
    results = []
    for m in (plain, ckpt):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        bias = torch.zeros(8, requires_grad=True)
        out = m(x, scale=2.0, bias=bias, debug=True)
        assert out["n"] == 3
        out["y"].pow(2).sum().backward()
        results.append((x.grad, bias.grad, m.lin.weight.grad))
    for a, b in zip(*results):
        assert b is not None
        assert torch.equal(a, b)


def test_bad_classes_are_refused():
    with pytest.raises(HintError, match=r"nn.Module subclasses, got \[<class 'int'>\]"):
        apply_recompute(nn.Linear(2, 2), {int})


# --------------------------------------------------------------------------- #
# Saved activations: the memory checkpointing exists to save
# --------------------------------------------------------------------------- #


class Deep(nn.Module):
    def __init__(self, depth=8, width=64):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width))
            for _ in range(depth)
        )  # fmt: skip

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _saved_bytes(model, x, watch=()) -> int:
    """Bytes of the distinct storages autograd keeps for backward: those saved
    through ``saved_tensors_hooks`` plus the inputs of the ``watch`` modules
    (a checkpointed module keeps its inputs for the recomputation)."""
    storages = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    def pack(t):
        keep(t)
        return t

    def keep_inputs(module, args):
        for a in args:
            keep(a)

    hooks = [m.register_forward_pre_hook(keep_inputs) for m in watch]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for h in hooks:
        h.remove()
    out.sum().backward()
    return sum(storages.values())


def test_checkpointing_keeps_fewer_activations():
    torch.manual_seed(0)
    plain = Deep()
    ckpt = copy.deepcopy(plain)
    apply_recompute(ckpt, {nn.Sequential})
    x = torch.randn(16, 32, 64)
    full = _saved_bytes(plain, x, watch=plain.blocks)
    kept = _saved_bytes(ckpt, x, watch=ckpt.blocks)
    # per block, plain keeps the LayerNorm input and output, both Linear inputs,
    # the GELU input (4x wide each): ~12 residual-sized tensors; checkpointed: 1
    assert kept * 5 < full, (kept, full)


def test_checkpoint_stage_equals_plain_and_keeps_less():
    torch.manual_seed(0)
    model = Deep(depth=6)

    def stage(x, *, skip=None):  # a pipeline stage: a slice of the blocks, any outputs
        for b in model.blocks[:4]:
            x = x + b(x)
        return {"x": x if skip is None else x + skip, "meta": None}

    wrapped = recompute_stage(stage)
    assert wrapped.__name__ == "stage"
    x = torch.randn(4, 8, 64)
    skip = torch.randn(4, 8, 64, requires_grad=True)
    grads = []
    for fn in (stage, wrapped):
        model.zero_grad(set_to_none=True)
        skip.grad = None
        out = fn(x, skip=skip)
        assert out["meta"] is None
        out["x"].square().sum().backward()
        grads.append([skip.grad] + [p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 1
    for a, b in zip(*grads):
        assert torch.equal(a, b)

    class Stage(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)["x"]

    plain_stage, ckpt_stage = Stage(stage), Stage(wrapped)
    full = _saved_bytes(plain_stage, x, watch=[plain_stage])
    kept = _saved_bytes(ckpt_stage, x, watch=[ckpt_stage])
    assert kept * 5 < full, (kept, full)


# --------------------------------------------------------------------------- #
# The @recompute hint
# --------------------------------------------------------------------------- #


def test_checkpoint_hint_records_and_returns_the_class():
    @recompute
    class A(nn.Module):
        pass

    @recompute()
    class B(nn.Module):
        pass

    class C(A):
        pass

    assert A.__annot_recompute__ is True
    assert get_recompute(A)
    assert get_recompute(B)
    assert not get_recompute(C)  # declared on A, not inherited
    assert not get_recompute(nn.Linear)
    assert isinstance(A(), nn.Module)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.lin = A(), B(), nn.Linear(2, 2)

    assert recomputed_classes(Model()) == {A, B}


def test_checkpoint_hint_refuses_a_non_module():
    with pytest.raises(
        HintError, match=r"@recompute on NotAModule: expected an nn.Module subclass"
    ):

        @recompute
        class NotAModule:
            pass

    def f():
        pass

    with pytest.raises(HintError, match="@recompute on f:"):
        checkpoint(f)


def test_the_old_names_of_recompute_warn_and_still_apply():
    """``annot.checkpoint`` and ``@stage(checkpoint=True)`` were the names of
    activation recompute; "checkpoint" now names saved checkpoints only."""
    from annot.rewriters.analysis.hint_reader import read_stage_hints

    with pytest.warns(DeprecationWarning, match="annot.recompute"):

        @checkpoint
        class A(nn.Module):
            pass

    with pytest.warns(DeprecationWarning, match=r"@stage\(recompute=\.\.\.\)"):

        @stage(split=["h.1"], checkpoint=True)
        class B(nn.Module):
            pass

    assert get_recompute(A)
    assert stage_recompute(B)
    assert recompute(A) is A
    source = "from annot import stage\n\n@stage(split=['h.1'], checkpoint=True)\nclass B: pass\n"
    assert read_stage_hints(source)["B"].recompute
