"""The replay's op cache (annot.runtime.runners.meta_ops.MetaOps): an op answered from the
recorded shapes is the op run on meta, in shape, strides, dtype and aliasing.

The end-to-end parity of replayed pipelines is in tests/e2e/test_pp_nested.py; here each
op is checked on its own, for drawn shapes, on the first call (run on meta) and
on the second (made from the cache).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from annot.runtime.runners.meta_ops import MetaOps

# (name, op): each op takes a meta tensor x of shape (a, b, c) and a real tensor r
# of the same shape, and calls one torch function with the arguments it passes.
OPS = [
    ("view", lambda x, r: (torch.Tensor.view, (x, -1), {})),
    ("transpose", lambda x, r: (torch.Tensor.transpose, (x, 0, 1), {})),
    ("slice", lambda x, r: (torch.Tensor.__getitem__, (x, (slice(None), slice(None, 1))), {})),
    ("ellipsis", lambda x, r: (torch.Tensor.__getitem__, (x, (Ellipsis, None)), {})),
    ("expand", lambda x, r: (torch.Tensor.expand, (x[None], 3, -1, -1, -1), {})),
    ("cat", lambda x, r: (torch.cat, ([x, r],), {"dim": 1})),
    ("chunk", lambda x, r: (torch.Tensor.chunk, (x, 2), {"dim": -1})),
    ("diff", lambda x, r: (torch.diff, (x,), {"prepend": x[..., :1], "dim": -1})),
    ("cumsum", lambda x, r: (torch.Tensor.cumsum, (x != 1, -1), {})),
    ("mixed", lambda x, r: (torch.add, (x, r), {})),
    ("to", lambda x, r: (torch.Tensor.to, (r,), {"dtype": torch.float16, "device": "cpu"})),
    ("iadd", lambda x, r: (torch.Tensor.__iadd__, (x, 1), {})),
    ("shape", lambda x, r: (torch.Tensor.size, (x,), {})),
    ("permute", lambda x, r: (torch.Tensor.contiguous, (x.permute(2, 0, 1),), {})),
]


def _meta_args(args, kwargs):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _describe(out, inputs):
    """Structure, and per tensor its shape, strides, dtype, device and which
    input (if any) it is."""
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, [_describe(o, inputs) for o in out])
    if isinstance(out, torch.Tensor):
        which = next((i for i, t in enumerate(inputs) if t is out), None)
        return (tuple(out.shape), out.stride(), out.dtype, out.device.type, which)
    return out


@pytest.mark.parametrize("name", [n for n, _ in OPS])
@settings(max_examples=15, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(2, 6)))
def test_cached_op_equals_the_op_on_meta(name, shape):
    op = dict(OPS)[name]
    ops = MetaOps()
    x = torch.empty(shape, device="meta")
    r = torch.randn(shape)
    func, args, kwargs = op(x, r)
    # the reference: the op with every operand on meta (what a replay computes)
    margs, mkwargs = _meta_args(args, kwargs)
    if func is torch.Tensor.to:
        mkwargs = {**mkwargs, "device": "meta"}
    ref = _describe(func(*margs, **mkwargs), [x])
    first = ops(func, args, kwargs)
    second = ops(func, args, kwargs)
    assert _describe(first, [x]) == ref
    assert _describe(second, [x]) == ref
    assert len(ops.entries) == 1  # the second call came from the cache


def test_ops_that_reshape_their_operand_in_place_run_every_time():
    ops = MetaOps()
    x = torch.empty(2, 3, device="meta")
    assert ops(torch.Tensor.unsqueeze_, (x, 0), {}) is x
    assert ops(torch.Tensor.unsqueeze_, (x, 0), {}) is x
    assert x.shape == (1, 1, 2, 3)  # both calls changed it
    assert not ops.entries
    out = torch.empty(6, device="meta")
    ops(torch.add, (x.flatten(), 1), {"out": out})
    assert not ops.entries


def test_new_shapes_make_new_entries_and_a_full_cache_starts_over():
    ops = MetaOps(size=2)
    for n in (3, 4, 3, 5):
        y = ops(torch.Tensor.transpose, (torch.empty(2, n, device="meta"), 0, 1), {})
        assert y.shape == (n, 2)
        assert y.stride() == (1, n)
    assert len(ops.entries) == 1  # 3, 4 filled it; 5 started over


def test_arguments_that_are_not_plain_values_are_not_cached():
    ops = MetaOps()
    x = torch.empty(4, 3, device="meta")
    idx = torch.tensor([0, 2])
    assert ops(torch.Tensor.__getitem__, (x, idx), {}).shape == (2, 3)  # a tensor: by shape
    assert len(ops.entries) == 1
    assert ops(torch.Tensor.__getitem__, (x, _Index()), {}).shape == (3,)
    assert len(ops.entries) == 1  # an object argument: run every time


class _Index:
    def __index__(self) -> int:
        return 1


def test_equal_plain_values_of_other_types_are_other_keys():
    # True == 1 == 1.0 as dict keys, but x * 2 is int64 and x * 2.0 float32
    ops = MetaOps()
    x = torch.ones(3, dtype=torch.long, device="meta")
    assert ops(torch.Tensor.__mul__, (x, 2), {}).dtype == torch.int64
    assert ops(torch.Tensor.__mul__, (x, 2.0), {}).dtype == torch.float32
    y = torch.ones(3, 4, device="meta")
    assert ops(torch.Tensor.std, (y, True), {}).shape == ()
    assert ops(torch.Tensor.std, (y, 1), {}).shape == (3,)
