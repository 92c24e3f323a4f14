"""annot.runtime.pipeline.p2p: pytrees round-trip between real gloo ranks with a header, never
a static shape; gradients come back; bad values and bad messages raise
PipelineError (never SIGABRT)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pickle
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from annot.core.errors import PipelineError
from annot.runtime.pipeline.p2p import post_recv, recv_pytree, reset_channels, send_pytree
from annot.runtime.pipeline.p2p_codec import (
    flatten,
    matcher,
    simple_signature,
    tensors_requiring_grad,
    unflatten,
)
from annot.runtime.pipeline.p2p_wire import FIRST_BYTES, MAGIC, PREAMBLE, VERSION
from annot.testing import run_ranks

TIMEOUT_S = 60.0


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Out:
    logits: Any
    loss: Any = None


# -- strategies -------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))  # [] is 0-d; a 0 is empty
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if dtype is torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype is torch.int64:
        t = torch.randint(-(2**40), 2**40, shape, generator=g)
    else:
        t = torch.randn(shape, generator=g).to(dtype)
        t.requires_grad_(draw(st.booleans()))
    return t


leaves = st.one_of(
    tensors(),
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.sampled_from(DTYPES),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.builds(
        slice,
        st.none() | st.integers(-5, 5),
        st.none() | st.integers(-5, 5),
        st.none() | st.integers(1, 3),
    ),
    st.just(Ellipsis),
)
keys = st.one_of(st.text(max_size=4), st.integers(-3, 3))
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(keys, inner, max_size=3),
        st.builds(Pair, inner, inner),
        st.builds(Out, inner, inner),
    ),
    max_leaves=8,
)


def draw_examples(strategy, n: int) -> list:
    """A fixed, seeded list of ``n`` examples (the same on every run)."""
    drawn: list = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x):
        drawn.append(x)

    collect()
    return drawn


CPU = torch.device("cpu")


def same(a: Any, b: Any, device: torch.device = CPU) -> bool:
    """Structural equality; a ``torch.device`` leaf in ``a`` arrives as ``device``."""
    if isinstance(a, torch.device):
        return b == device
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k], device) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, device) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(
            same(getattr(a, f.name), getattr(b, f.name), device) for f in dataclasses.fields(a)
        )
    return a == b


# -- one process: flatten / unflatten ---------------------------------------


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(trees)
def test_flatten_unflatten_round_trip(tree):
    structure, ts = flatten(tree)
    json.dumps(structure)  # the structure is plain JSON
    assert same(tree, unflatten(json.loads(json.dumps(structure)), ts, device="cpu"))


def _small_tensor(spec):
    dtype, n, requires_grad = spec
    return torch.zeros(n, dtype=dtype, requires_grad=requires_grad)


# Few choices, so two draws often have the same structure, dtypes and shapes.
small_tensors = st.tuples(
    st.sampled_from([torch.float32, torch.int64]), st.sampled_from([1, 2]), st.booleans()
).map(lambda s: _small_tensor(s) if s[0] is torch.float32 else _small_tensor((*s[:2], False)))
# Plain values that compare equal but encode apart (True == 1 == 1.0, 0.0 == -0.0).
plain_values = st.sampled_from([True, 1, 1.0, False, 0, 0.0, -0.0, float("nan"), "a", "1"])
simple_trees = st.recursive(
    small_tensors | st.none() | plain_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2),
        st.lists(inner, max_size=2).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
    ),
    max_leaves=4,
)


def _encoded(obj) -> tuple:
    structure, ts = flatten(obj)
    return json.dumps(structure), [(t.dtype, t.shape, t.requires_grad) for t in ts]


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(simple_trees, simple_trees)
def test_simple_signature_equal_iff_encoding_equal(a, b):
    """send_pytree reuses the header of an equal signature: equal signatures
    must mean equal headers, and the tensors are flatten's, in its order."""
    (key_a, ts_a), (key_b, _) = simple_signature(a), simple_signature(b)
    assert (key_a == key_b) == (_encoded(a) == _encoded(b))
    assert [id(t) for t in ts_a] == [id(t) for t in flatten(a)[1]]


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(simple_trees, simple_trees)
def test_matcher_accepts_exactly_the_objects_with_its_key(a, b):
    """A steady channel's sender checks each message with matcher(previous
    key) instead of building a key: it must accept exactly what
    simple_signature gives the same key, with the same tensors in order."""
    (key_a, _), (key_b, ts_b) = simple_signature(a), simple_signature(b)
    found = matcher(key_a)(b)
    assert (found is not None) == (key_a == key_b)
    if found is not None:
        assert [id(t) for t in found] == [id(t) for t in ts_b]


def test_matcher_refuses_a_str_subclass_key():
    """simple_signature refuses a dict whose key is a str subclass (flatten's
    path), though it compares equal to the str: so must the matcher."""

    class Name(str):
        pass

    t = torch.ones(1)
    key = simple_signature({"a": t})[0]
    assert simple_signature({Name("a"): t}) is None
    assert matcher(key)({Name("a"): t}) is None
    assert matcher(key)({"a": t}) == [t]


# Trees with several tensors that require grad, simple or not (a dict with int
# keys or a namedtuple inside takes flatten's path).
grad_trees = st.recursive(
    st.sampled_from([1, 2]).map(lambda n: torch.zeros(n, requires_grad=True))
    | small_tensors
    | st.none()
    | plain_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
        st.dictionaries(st.sampled_from([1, 2]), inner, max_size=2),
        st.tuples(inner, inner).map(lambda p: Pair(*p)),
    ),
    max_leaves=8,
)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(grad_trees)
def test_tensors_requiring_grad_is_flattens_order(tree):
    """The gradients of a boundary line up by this list on both sides: the
    simple messages' walk must give flatten's tensors in flatten's order."""
    want = [t for t in flatten(tree)[1] if t.requires_grad]
    assert [id(t) for t in tensors_requiring_grad(tree)] == [id(t) for t in want]


def test_simple_signature_never_merges_by_value_equality():
    t = torch.ones(1)
    assert simple_signature([t])[0] != simple_signature((t,))[0]
    assert simple_signature([t, None])[0] != simple_signature([None, t])[0]
    assert simple_signature(([t], None))[0] != simple_signature(([t, None],))[0]
    # plain leaves keep their type (True == 1 == 1.0) and a float its bits (0.0 == -0.0)
    keys = {simple_signature([t, v])[0] for v in (True, 1, 1.0, 0.0, -0.0, "1")}
    assert len(keys) == 6
    # other containers and leaves take flatten's path
    for obj in ({1: t}, {True: t}, Pair(t, t), Out(t), [[[[[t]]]]], [t, 1j], [t, torch.float32]):
        assert simple_signature(obj) is None
    assert simple_signature(torch.ones(1).to_sparse()) is None
    assert simple_signature(torch.ones(1, device="meta")) is None


def test_unsupported_leaf_names_its_path():
    with pytest.raises(
        PipelineError,
        match=r"cannot send obj\['cache'\]\[1\] of type set: .*"
        r"Sort it into a list",
    ):
        flatten({"x": torch.ones(1), "cache": [None, {1, 2}]})
    with pytest.raises(PipelineError, match=r"obj\.logits of type function: .*Code never crosses"):
        flatten(Out(logits=lambda: 1))
    with pytest.raises(PipelineError, match=r"key \(1, 2\) of obj\[0\] of type tuple: dict keys"):
        flatten([{(1, 2): 3}])
    loop: list = []
    loop.append(loop)
    with pytest.raises(PipelineError, match=r"obj\[0\] of type list: it contains itself"):
        flatten(loop)
    # send_pytree refuses before anything moves (no process group needed)
    with pytest.raises(
        PipelineError,
        match=r"cannot send obj\['cache'\]\[1\] of type set.*"
        r"\(send activations to rank 2\)",
    ):
        send_pytree({"cache": [0, {1}]}, 2, what="activations")
    for bad in ((1, 2), (1, 2, "3"), [1, 2, 3]):
        with pytest.raises(PipelineError, match=r"tag= must be a tuple of three ints"):
            send_pytree(torch.ones(1), 2, what="activations", tag=bad)


def test_local_namedtuple_is_refused_clearly():
    class Local(NamedTuple):
        a: int

    with pytest.raises(
        PipelineError,
        match=r"obj of type .*Local: the receiver cannot find this"
        r" namedtuple class by name; define it at module level",
    ):
        flatten(Local(1))


def test_tensors_requiring_grad_in_flatten_order():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, requires_grad=True) * 2
    obj = {"z": b, "n": torch.zeros(1), "a": (a, None)}
    assert [t is x for t, x in zip(tensors_requiring_grad(obj), [b, a])] == [True, True]


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.text(max_size=4),
            st.sampled_from(["T", "dtype", "tuple", "dict", "nt", "dc", "size"]),
        ),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["k", "v", "i", "type"]), inner),
        ),
        max_leaves=10,
    )
)
def test_malformed_structures_raise_pipeline_error_only(structure):
    with contextlib.suppress(PipelineError):
        unflatten(structure, [torch.ones(1)], device="cpu")


# -- real gloo ranks ----------------------------------------------------------


def _raw(*tensors_: torch.Tensor) -> None:
    for t in tensors_:
        dist.send(t, 1)


def _first(words: list, inline: bytes = b"") -> torch.Tensor:
    """A fixed-size first message: the preamble's int64 words (untagged), then
    an inline header."""
    buf = bytearray(FIRST_BYTES)
    buf[: PREAMBLE.size] = PREAMBLE.pack(*words, 0, 0, 0, 0)
    buf[PREAMBLE.size : PREAMBLE.size + len(inline)] = inline
    return torch.frombuffer(buf, dtype=torch.uint8)


STEADY = [2, 2, 2, 5, 5, 3000, 3000, 2]  # rows of each steady-shape message


def _p2p_session(examples: list) -> Any:
    """rank 0 sends, rank 1 receives: the drawn examples, changing shapes, a
    gradient round trip, steady shapes (a repeated header) with tags, then
    garbage."""
    rank = dist.get_rank()
    kw = dict(timeout_s=TIMEOUT_S)
    if rank == 0:
        handles = []
        for i, obj in enumerate(examples):  # several sends in flight
            handles.append(send_pytree(obj, 1, what=f"example {i}", **kw))
            if len(handles) == 3:
                handles.pop(0).wait()
        for n in range(1, 5):
            handles.append(send_pytree({"x": torch.full((n, 3), float(n))}, 1, **kw))
        handles += [send_pytree(obj, 1, **kw) for obj in _views()]
        for h in handles:
            h.wait()
        # gradients: send a non-leaf activation, get its gradient back
        torch.manual_seed(0)
        w = torch.randn(3, 4, requires_grad=True)
        h = torch.randn(2, 3) @ w
        out = {"h": h, "n": 2, "aux": (h.sum(), torch.arange(3))}
        send_pytree(out, 1, what="activations", **kw).wait()
        grads = recv_pytree(1, what="grads", **kw)
        pairs = [(t, g) for t, g in zip(tensors_requiring_grad(out), grads) if g is not None]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for i, n in enumerate(STEADY):  # repeated headers; a payload outgrows the first message
            send_pytree({"x": torch.full((n, 3), float(i))}, 1, tag=(1, 7, i), **kw).wait()
        # garbage: each fixed-size preamble is what a peer could send by mistake
        reset_channels()  # both ends: the next first message is FIRST_BYTES again
        header = json.dumps(
            {"v": VERSION, "tree": {"k": "T", "i": 0}, "tensors": [["float32", [4], False]]}
        ).encode()
        _raw(_first([12345, VERSION, 10, 0]))
        _raw(_first([MAGIC, 99, 10, 0]))
        _raw(_first([MAGIC, VERSION, 2**40, 0]))
        _raw(_first([MAGIC, VERSION, 8, 0], b"\xff\xfe{junk"))
        _raw(_first([MAGIC, VERSION, len(header), 0], header))
        int_grad = json.dumps(
            {"v": VERSION, "tree": {"k": "T", "i": 0}, "tensors": [["int64", [4], True]]}
        ).encode()
        _raw(_first([MAGIC, VERSION, len(int_grad), 0], int_grad))  # ints cannot need grad
        _raw(_first([MAGIC, VERSION, 0, 0]))  # "the previous header", with none before
        send_pytree(["still", "in", "step"], 1, **kw).wait()
        return pickle.dumps(w.grad)  # plain pickle: a queued tensor dies with its rank
    received = [recv_pytree(0, what=f"example {i}", **kw) for i in range(len(examples))]
    shapes = [tuple(recv_pytree(0, **kw)["x"].shape) for _ in range(4)]
    views = [recv_pytree(0, **kw) for _ in _views()]
    inp = recv_pytree(0, what="activations", **kw)
    flags = [t.requires_grad for t in flatten(inp)[1]]
    loss = (inp["h"] ** 2).sum() * inp["n"] + inp["aux"][0] * 3
    inp["aux"][1].add_(1)  # in place on a neighbour in the same payload buffer:
    loss.backward()  # autograd's saved h must not see a version bump
    send_pytree([t.grad for t in tensors_requiring_grad(inp)], 0, what="grads", **kw).wait()
    steady = []
    for i in range(len(STEADY)):  # every other one into a receive posted ahead
        posted = post_recv(0, what="steady", timeout_s=TIMEOUT_S) if i % 2 else None
        if posted is not None:
            try:  # posted for rank 0: refused before any wait
                recv_pytree(1, posted=posted, **kw)
            except PipelineError as err:
                steady.append(str(err))
        tag, obj = recv_pytree(0, tagged=True, posted=posted, **kw)
        steady.append((tag, tuple(obj["x"].shape), obj["x"].unique().tolist()))
    reset_channels()
    errors = []
    for i in range(7):
        try:
            recv_pytree(0, what=f"garbage {i}", **kw)
            errors.append(None)
        except PipelineError as err:
            errors.append(str(err))
    after = recv_pytree(0, **kw)
    return pickle.dumps((received, shapes, views, flags, steady, errors, after))


def _views() -> list:
    """Tensors the first message's numpy copy leaves to torch: strides, conj and
    neg bits (made on each rank: pickling a conj view drops its bit), a dtype
    numpy lacks, a ZeroTensor."""
    return [
        {"t": torch.arange(6.0).view(2, 3).t(), "c": torch.tensor([1 + 2j, 3 - 1j]).conj()},
        [torch.tensor([1 + 2j]).conj().imag, torch.tensor([1.5, -2.0], dtype=torch.bfloat16)],
        {"zeros": torch._efficientzerotensor(3)},  # no numpy view
    ]


def _reference_grad() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(3, 4, requires_grad=True)
    h = torch.randn(2, 3) @ w
    ((h**2).sum() * 2 + h.sum() * 3).backward()
    return w.grad


def test_p2p_between_two_gloo_ranks():
    examples = draw_examples(trees, 40)
    examples += [
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 5, dtype=torch.bfloat16),  # empty
        {"cache": [None, 3, "s", torch.float16, torch.device("cpu")], "t": torch.ones(2, 2)},
        Pair(Out(torch.ones(1, requires_grad=True)), (torch.zeros(0), torch.tensor(True))),
        None,
        [],
        (torch.ones(3, dtype=torch.int8), torch.full((2,), 7.0), torch.tensor([True])),  # gaps
    ]
    results = run_ranks(_p2p_session, 2, examples, timeout=240)
    w_grad, (received, shapes, views, flags, steady, errors, after) = map(pickle.loads, results)
    assert len(received) == len(examples)
    for sent, got in zip(examples, received):
        assert same(sent, got), (sent, got)
    assert shapes == [(1, 3), (2, 3), (3, 3), (4, 3)]
    for sent, got in zip(_views(), views, strict=True):
        assert same(sent, got), (sent, got)
    assert flags == [True, True, False]  # h, aux[0] (non-leaves that need grad); arange
    torch.testing.assert_close(w_grad, _reference_grad())
    refused = "recv_pytree from rank 1 was given a receive posted for rank 0"
    assert steady == [
        x
        for i, n in enumerate(STEADY)
        for x in ([refused] if i % 2 else []) + [((1, 7, i), (n, 3), [float(i)])]
    ]
    expected = [
        "bad preamble: expected magic 0x616e6e6f74503250, received 0x3039",
        f"protocol version mismatch: expected {VERSION}, received 99",
        "header length 1099511627776 is outside 2..",
        "the 8-byte header is not valid UTF-8 JSON",
        "the header's tensors take 16 payload bytes but the preamble says 0",
        "tensor 0: requires_grad=True for int64",
        "the sender repeats a previous header but none came on this channel",
    ]
    for i, (err, want) in enumerate(zip(errors, expected)):
        assert err is not None, err
        assert err.startswith(f"recv_pytree from rank 0 (garbage {i}): "), err
        assert want in err, err
    assert after == ["still", "in", "step"]
