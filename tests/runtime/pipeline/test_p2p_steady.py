"""annot.runtime.pipeline.p2p's steady-shape fast path: once a channel's header was
checked, later messages with the same header are rebuilt from the views and
the rebuild function cached for it (p2p_codec.rebuilder); any change (a
shape, a dtype, requires_grad, the structure, a plain value, a bool for an
int) goes through the full protocol again and arrives exactly."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from annot.runtime.pipeline.p2p import post_recv, recv_pytree, send_pytree
from annot.runtime.pipeline.p2p_codec import flatten, rebuilder, unflatten
from annot.runtime.pipeline.p2p_wire import FIRST_BYTES, MAX_FIRST_BYTES
from annot.testing import run_ranks

TIMEOUT_S = 60.0


def _message(i: int) -> Any:
    """The i-th message of the session: steady runs broken by one change each."""
    rows = 3 if i < 4 or i >= 12 else 5  # a shape change at 4, back at 12
    h = torch.full((rows, 4), float(i), requires_grad=i != 8)  # requires_grad flips at 8
    mask = torch.arange(rows) % 2 == 0
    if i == 6:
        mask = mask.long()  # a dtype change
    extra: Any = 1 if i != 10 else True  # a bool where an int was: not merged
    msg: Any = {"h": h, "aux": [mask, None, extra], "t": (torch.tensor(float(i)),)}
    if i == 14:
        msg["new"] = torch.ones(2)  # a structure change
    return msg


N = 18


def _session() -> Any:
    rank = dist.get_rank()
    if rank == 0:
        for i in range(N):
            send_pytree(_message(i), 1, tag=(0, 1, i), timeout_s=TIMEOUT_S).wait()
        return None
    got = []
    for _ in range(N):
        tag, obj = recv_pytree(0, tagged=True, timeout_s=TIMEOUT_S)
        before = obj["h"]._version
        obj["t"][0].add_(1)  # in place on a neighbour in the same buffer
        got.append((tag, obj, obj["h"]._version - before))
    return pickle.dumps(got)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_steady_channel_detects_every_change_and_rebuilds_exactly():
    (_, raw) = run_ranks(_session, 2, timeout=240)
    got = pickle.loads(raw)
    assert [tag for tag, _, _ in got] == [(0, 1, i) for i in range(N)]
    for i, (_, obj, version) in enumerate(got):
        want = _message(i)
        want["t"][0].add_(1)
        assert _same(want, obj), (i, want, obj)
        # each received tensor has its own version counter: t's add_ left h's alone
        assert version == 0, i


def test_rebuilder_matches_unflatten():
    cases = [
        torch.ones(2),
        {"h": torch.ones(2), "m": [1, True, 1.5, None, "x", (torch.zeros(1),)]},
        [(), [], {}, (torch.ones(1), torch.zeros(2))],
        {"n": {"k": {"j": [torch.ones(1)]}}},
    ]
    for obj in cases:
        tree, tensors = flatten(obj)
        build = rebuilder(tree)
        assert build is not None
        assert _same(build(tensors), unflatten(tree, tensors))
    # kinds that need unflatten's device or class lookup are not rebuilt directly
    for obj in ({"d": torch.device("cpu")}, {"s": torch.Size([2])}, torch.float16):
        assert rebuilder(flatten(obj)[0]) is None


def _lanes_session(outputs_lane: int) -> Any:
    """Activations on lane 0, each followed by a small message of another kind
    on ``outputs_lane``; the sender counts the sends each transfer took."""
    rank = dist.get_rank()
    if rank == 0:
        real, counts = dist.isend, []

        def counting(*args: Any, **kwargs: Any) -> Any:
            counts[-1] += 1
            return real(*args, **kwargs)

        dist.isend = counting
        try:
            for i in range(6):
                counts.append(0)
                h = torch.full((4, 256), float(i))  # 4 KiB: past the first 4 KiB message
                send_pytree({"h": h}, 1, timeout_s=TIMEOUT_S).wait()
                send_pytree(
                    torch.tensor(float(i)), 1, lane=outputs_lane, timeout_s=TIMEOUT_S
                ).wait()
        finally:
            dist.isend = real
        return counts
    got = []
    for i in range(6):
        h = recv_pytree(0, timeout_s=TIMEOUT_S)["h"]
        loss = recv_pytree(0, lane=outputs_lane, timeout_s=TIMEOUT_S)
        got.append(bool(torch.equal(h, torch.full((4, 256), float(i)))) and float(loss) == i)
    return got


def test_a_lane_keeps_a_channel_steady_between_other_messages():
    counts, got = run_ranks(_lanes_session, 2, 1, timeout=240)
    assert all(got)
    # the first transfer learns the size (two parts per activation, one per loss);
    # after it, an activation and the loss on its own lane are one send each
    assert counts[0] == 3, counts
    assert counts[1:] == [2] * 5, counts
    counts, got = run_ranks(_lanes_session, 2, 0, timeout=240)
    assert all(got)
    assert counts[1:] == [3] * 5, counts  # one lane: each loss resets the activation's size


def _counting_sends(body: Any) -> list[list[int]]:
    """Run ``body(i)`` for i = 0, 1, 2; the bytes of each send each call made."""
    real, counts = dist.isend, []

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts[-1].append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        for i in range(3):
            counts.append([])
            body(i)
    finally:
        dist.isend = real
    return counts


def _large_session() -> Any:
    """The same shapes three times, the payload larger than any first message."""
    n = MAX_FIRST_BYTES // 4 + 1024  # float32: past the first message's bound

    def send(i: int) -> None:
        send_pytree({"h": torch.full((n,), float(i))}, 1, timeout_s=TIMEOUT_S).wait()

    if dist.get_rank() == 0:
        return _counting_sends(send)
    return [bool(torch.equal(recv_pytree(0)["h"], torch.full((n,), float(i)))) for i in range(3)]


def test_steady_shapes_larger_than_a_first_message_arrive_exactly():
    """A payload that cannot ride in the first message is never sent as a
    steady one-message transfer (it crashed with a numpy broadcast error on
    the second message before): each message is a first message of the
    smallest size and the payload, and each arrives exactly."""
    sizes, got = run_ranks(_large_session, 2, timeout=240)
    assert got == [True] * 3
    payload = (MAX_FIRST_BYTES // 4 + 1024) * 4
    assert sizes == [[FIRST_BYTES, payload]] * 3, sizes  # not padded to the bound


def _lane_tags_session() -> Any:
    """Rank 0 sends on lane 0 then on lane 1; rank 1 receives them in the
    other order (lane 1 first), once posted ahead and once not."""
    if dist.get_rank() == 0:
        for i in range(2):
            a = send_pytree(torch.full((3,), float(i)), 1, timeout_s=TIMEOUT_S)
            b = send_pytree({"loss": torch.tensor(10.0 + i)}, 1, lane=1, timeout_s=TIMEOUT_S)
            a.wait()
            b.wait()
        return None
    got = []
    for i in range(2):
        posted = post_recv(0, lane=1) if i == 1 else None
        loss = recv_pytree(0, lane=1, posted=posted, timeout_s=TIMEOUT_S)["loss"]
        h = recv_pytree(0, timeout_s=TIMEOUT_S)
        got.append((float(loss), h.tolist()))
    return got


def test_a_lane_is_a_message_tag_under_gloo():
    """gloo matches a receive to a send by tag, and a lane is the tag: a
    lane's message is received apart from the other lanes', in any order."""
    _, got = run_ranks(_lane_tags_session, 2, timeout=240)
    assert got == [(10.0, [0.0] * 3), (11.0, [1.0] * 3)]
