"""Where a pipeline boundary would strand a tensor (annot.runtime.runners.stranded): a
tensor made before a module's call and used after it that no local holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from annot.runtime.runners.stranded import stranded


class Gated(nn.Module):
    """``c(a(x) * b(x))``: while ``b`` runs, ``a(x)`` waits on Python's stack."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return self.c(torch.relu(self.a(x)) * self.b(x))


class Kept(nn.Module):
    """A tensor kept on a module by one call and used by a later one."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        self.scale = self.first(x).sigmoid()
        h = self.second(x)
        return self.third(h) * self.scale


class ShapeOnly(nn.Module):
    """A tensor kept on a module whose shape alone is read after a later call."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        self.like = self.a(x).sigmoid()
        return self.b(x).view(self.like.shape).expand(self.like.size())


def test_a_call_inside_an_expression_strands_the_operand_before_it():
    found = stranded(Gated(), torch.randn(2, 8))
    assert set(found) == {"b"}, found
    assert found["b"].startswith("the result of relu made at test_stranded.py:"), found["b"]
    assert "is used after that call, at test_stranded.py:" in found["b"]


def test_a_tensor_kept_on_a_module_is_stranded_until_its_last_use():
    found = stranded(Kept(), torch.randn(2, 8))
    assert set(found) == {"second", "third"}, found
    assert "the result of sigmoid" in found["second"]


def test_reading_a_shape_is_not_a_use():
    assert stranded(ShapeOnly(), torch.randn(2, 8)) == {}


def test_hf_llama_strands_only_up_proj_among_its_calls():
    # a model we did not write: LlamaMLP's down_proj(act_fn(gate_proj(x)) * up_proj(x))
    from tests.e2e.test_pp_nested import _llama

    cls, args = _llama()
    with torch.device("meta"):
        model = cls(*args)
    found = stranded(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    assert set(found) == {f"model.layers.{i}.mlp.up_proj" for i in range(4)}, found


def test_check_stranded_names_an_enclosing_module_or_the_variable_fix():
    from annot.build.stage_choice import check_stranded
    from annot.core.errors import HintError

    x = torch.randn(2, 8)
    kept = Kept()
    with pytest.raises(HintError) as top:  # a child of the root: nothing encloses it
        check_stranded(kept, ("second",), stranded(kept, x))
    assert "begin the stage at" not in str(top.value)
    assert str(top.value).endswith(
        "To fix: begin it at another module call, or assign that value to a local variable "
        "before the call"
    ), str(top.value)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.gated = Gated()

        def forward(self, x):
            return self.gated(x)

    outer = Outer()
    with pytest.raises(HintError, match=r"To fix: begin the stage at 'gated', which encloses it"):
        check_stranded(outer, ("gated.b",), stranded(outer, x))
    check_stranded(outer, ("gated.c",), stranded(outer, x))  # a safe call passes


def test_the_named_walk_collects_the_same_tensors():
    import sys

    from annot.runtime.frames import frame_tensors, named_frame_tensors

    def inner(a, pair, box):
        here = sys._getframe()
        return frame_tensors(here, outer.__code__, set()), named_frame_tensors(
            here, outer.__code__, set()
        )

    def outer():
        t = torch.ones(2)
        return inner(t, (torch.zeros(1), t), {"k": [torch.ones(3)]})

    plain, (named, names) = outer()
    assert [id(t) for t in plain] == [id(t) for t in named]
    assert len(plain) == 3
    tails = [n.rpartition("inner: ")[2] for n in names]
    assert tails == ["a", "pair[0]", "box['k'][0]"], names
