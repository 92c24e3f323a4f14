"""Schedules as data: invariants checked with no processes."""

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from annot.core.errors import PipelineError
from annot.runtime.pipeline.schedule_check import peak_in_flight, simulate, validate
from annot.runtime.pipeline.schedule_table import format_table
from annot.runtime.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    W,
    forward_only,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
)
from annot.runtime.pipeline.trace import (
    Tracer,
    schedule_to_chrome_trace,
    to_chrome_trace,
    write_chrome_trace,
)

PP = st.integers(1, 8)
MB = st.integers(1, 16)
CHUNKS = st.integers(1, 4)
FAST = settings(max_examples=150, deadline=None, derandomize=True)


def _computes(schedule, rank):
    return [a for a in schedule[rank] if a.kind in (F, B)]


def _interleaved_ok(pp, mb):
    return mb % pp == 0


# -- notation ----------------------------------------------------------------


def test_action_notation_round_trips():
    a = Action(SEND_F, 1, 3)
    assert str(a) == "1SEND_F3"
    assert str(Action(F, 0, 12)) == "0F12"
    for text in ("1F3", "0B0", "1I3", "0W12", "12RECV_B7", "3SEND_B0", "2RECV_F1", "1SEND_F3"):
        assert str(Action.parse(text)) == text
    with pytest.raises(PipelineError, match="<stage><KIND><microbatch>"):
        Action.parse("F3")


def test_messages_pair_sends_with_receives():
    assert Action(SEND_F, 1, 3).message == Action(RECV_F, 2, 3).message
    assert Action(SEND_B, 2, 3).message == Action(RECV_B, 1, 3).message
    assert Action(F, 1, 3).message is None


# -- invariants over random sizes ----------------------------------------------


@FAST
@given(pp=PP, mb=MB)
@example(pp=4, mb=1)
@example(pp=8, mb=3)
def test_gpipe_and_1f1b_are_valid(pp, mb):
    for name in ("gpipe", "1f1b"):
        schedule = get_schedule(name, pp, mb)
        validate(schedule, pp, mb)
        for r in range(pp):
            comps = _computes(schedule, r)
            assert sorted(comps) == sorted(
                [Action(F, r, m) for m in range(mb)] + [Action(B, r, m) for m in range(mb)]
            )
            for m in range(mb):  # forward before backward, on the owning rank
                assert comps.index(Action(F, r, m)) < comps.index(Action(B, r, m))


@FAST
@given(pp=PP, mb=MB, chunks=CHUNKS)
@example(pp=2, mb=4, chunks=2)
@example(pp=1, mb=5, chunks=3)
def test_interleaved_is_valid_and_covers_every_chunk(pp, mb, chunks):
    assume(_interleaved_ok(pp, mb))
    schedule = interleaved_1f1b(pp, mb, chunks)
    validate(schedule, pp, mb, chunks)
    for r in range(pp):
        stages = {a.stage for a in _computes(schedule, r)}
        assert stages == {r + c * pp for c in range(chunks)}
        for s in stages:
            for m in range(mb):
                comps = _computes(schedule, r)
                assert comps.index(Action(F, s, m)) < comps.index(Action(B, s, m))


@FAST
@given(pp=st.integers(2, 8), mb=MB, chunks=st.integers(2, 4))
def test_interleaved_refuses_microbatches_not_a_multiple_of_pp(pp, mb, chunks):
    assume(mb % pp)
    with pytest.raises(PipelineError, match=r"multiple of pp .* schedule='1f1b'"):
        interleaved_1f1b(pp, mb, chunks)


def test_interleaved_error_suggests_counts():
    with pytest.raises(PipelineError, match="got microbatches=3, pp=2; use microbatches=2 or 4"):
        get_schedule("interleaved", 2, 3, chunks=2)


@FAST
@given(pp=PP, mb=MB)
def test_1f1b_keeps_at_most_pp_minus_rank_in_flight(pp, mb):
    schedule = one_f_one_b(pp, mb)
    assert peak_in_flight(schedule, 0) <= pp
    for r in range(pp):
        assert peak_in_flight(schedule, r) == min(pp - r, mb)
    assert peak_in_flight(gpipe(pp, mb), 0) == mb


@FAST
@given(pp=PP, mb=MB)
def test_gpipe_is_fill_drain(pp, mb):
    schedule = gpipe(pp, mb)
    for r in range(pp):
        want = [Action(F, r, m) for m in range(mb)] + [Action(B, r, m) for m in range(mb)]
        assert _computes(schedule, r) == want
    # with unit costs, rank r's forward of microbatch m runs at step r + m
    timeline = simulate(schedule, 1, 1)
    for r in range(pp):
        starts = {s.action: s.start for s in timeline[r]}
        assert [starts[Action(F, r, m)] for m in range(mb)] == [r + m for m in range(mb)]


@FAST
@given(pp=PP, mb=MB, cost_f=st.integers(1, 3), cost_b=st.integers(1, 3))
def test_bubble_of_gpipe_and_1f1b(pp, mb, cost_f, cost_b):
    """Makespan (M + pp - 1)(cf + cb), each rank busy M(cf + cb): the bubble is
    (pp - 1) / (M + pp - 1), for any forward/backward cost."""
    for name in ("gpipe", "1f1b"):
        timeline = simulate(get_schedule(name, pp, mb), cost_f, cost_b)
        assert timeline.makespan == (mb + pp - 1) * (cost_f + cost_b)
        bubble = Fraction(pp - 1, mb + pp - 1)
        assert timeline.bubble == pytest.approx(float(bubble))


@FAST
@given(pp=PP, mb=MB, chunks=st.integers(2, 4), cost_b=st.integers(1, 3))
def test_bubble_of_interleaved_shrinks_by_chunks(pp, mb, chunks, cost_b):
    """With each virtual stage costing cf / cb: bubble (pp - 1) / (v M + pp - 1)."""
    assume(_interleaved_ok(pp, mb))
    timeline = simulate(interleaved_1f1b(pp, mb, chunks), 1, cost_b)
    assert timeline.makespan == (chunks * mb + pp - 1) * (1 + cost_b)
    assert timeline.bubble == pytest.approx((pp - 1) / (chunks * mb + pp - 1))


# -- the checker catches broken schedules --------------------------------------


def test_validate_catches_backward_before_forward():
    schedule = gpipe(1, 2)
    schedule[0] = [Action(B, 0, 0), Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 1)]
    with pytest.raises(PipelineError, match="rank 0: 0B0 runs before its forward 0F0"):
        validate(schedule, 1, 2)


def test_validate_catches_missing_and_foreign_actions():
    schedule = one_f_one_b(2, 2)
    schedule[1] = [a for a in schedule[1] if a not in (Action(B, 1, 1), Action(SEND_B, 1, 1))]
    with pytest.raises(PipelineError, match="missing 1B1, 1SEND_B1$"):
        validate(schedule, 2, 2)
    schedule = one_f_one_b(2, 2)
    schedule[0].append(Action(F, 1, 0))
    with pytest.raises(PipelineError, match="stage 1 belongs to rank 1"):
        validate(schedule, 2, 2)


def test_validate_catches_deadlock():
    # both ranks wait for the other's gradient before sending anything back
    schedule = [
        [Action(F, 0, 0), Action(SEND_F, 0, 0), Action(RECV_B, 0, 0), Action(B, 0, 0)],
        [Action(RECV_F, 1, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SEND_B, 1, 0)],
    ]
    validate(schedule, 2, 1)  # fine
    schedule = [
        [Action(RECV_B, 0, 0), Action(F, 0, 0), Action(SEND_F, 0, 0), Action(B, 0, 0)],
        [Action(RECV_F, 1, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SEND_B, 1, 0)],
    ]
    with pytest.raises(PipelineError, match="runs before its forward|deadlock"):
        validate(schedule, 2, 1)
    with pytest.raises(PipelineError, match="deadlocks: rank 0 waits at 0RECV_B0; rank 1 waits"):
        simulate(schedule)


@FAST
@given(pp=PP, mb=MB, chunks=CHUNKS)
def test_forward_only_schedules_are_valid(pp, mb, chunks):
    assume(chunks == 1 or _interleaved_ok(pp, mb))
    name = "interleaved" if chunks > 1 else "1f1b"
    schedule = forward_only(get_schedule(name, pp, mb, chunks))
    validate(schedule, pp, mb, chunks, forward_only=True)
    assert all(a.kind in (F, SEND_F, RECV_F) for acts in schedule for a in acts)
    with pytest.raises(PipelineError, match="missing"):
        validate(schedule, pp, mb, chunks)


def test_get_schedule_names():
    assert get_schedule("1F1B", 2, 3) == one_f_one_b(2, 3)
    assert get_schedule("interleaved", 2, 4, chunks=1) == one_f_one_b(2, 4)
    assert get_schedule("zero-bubble", 2, 4) == get_schedule("ZB-H1", 2, 4) == zero_bubble_h1(2, 4)
    with pytest.raises(
        PipelineError, match="expected one of 'gpipe', '1f1b', 'interleaved', 'zbh1'"
    ):
        get_schedule("dualpipe", 2, 4)
    with pytest.raises(PipelineError, match="runs one stage per rank but chunks=2"):
        get_schedule("zbh1", 2, 4, chunks=2)
    with pytest.raises(PipelineError, match="use schedule='interleaved'"):
        get_schedule("gpipe", 2, 4, chunks=2)
    with pytest.raises(PipelineError, match="microbatches=0: must be an int >= 1"):
        get_schedule("gpipe", 2, 0)


# -- zero bubble (ZB-H1) ---------------------------------------------------------


@FAST
@given(pp=PP, mb=MB)
@example(pp=4, mb=8)
@example(pp=8, mb=2)
def test_zero_bubble_h1_is_valid_with_1f1b_memory(pp, mb):
    schedule = zero_bubble_h1(pp, mb)
    validate(schedule, pp, mb)
    validate(forward_only(schedule), pp, mb, forward_only=True)
    for r in range(pp):
        comps = [a for a in schedule[r] if a.kind in (F, I, W)]
        assert sorted(comps) == sorted(Action(k, r, m) for k in (F, I, W) for m in range(mb))
        assert not any(a.kind == B for a in schedule[r])
        for m in range(mb):
            assert comps.index(Action(F, r, m)) < comps.index(Action(I, r, m))
            assert comps.index(Action(I, r, m)) < comps.index(Action(W, r, m))
        # the paper's bound: rank 0's 1F1B peak held to W, 1F1B's per rank held to I
        assert peak_in_flight(schedule, r) <= min(pp, mb)
        waiting_for_i = peak = 0
        for a in comps:
            waiting_for_i += {F: 1, I: -1}.get(a.kind, 0)
            peak = max(peak, waiting_for_i)
        assert peak <= min(pp - r, mb)


@FAST
@given(pp=st.integers(2, 8), mb=MB)
def test_zero_bubble_h1_shrinks_1f1bs_bubble(pp, mb):
    """On the paper's unit costs (F = I = W = 1, so B = 2) ZB-H1 is never
    slower than 1F1B, strictly faster from M >= 2, and within (pp + 1) // 2
    units of the paper's 3M + pp - 1 when M >= pp (1F1B: 3M + 3(pp - 1))."""
    zb = simulate(zero_bubble_h1(pp, mb), 1, 2)
    base = simulate(one_f_one_b(pp, mb), 1, 2)
    assert zb.makespan <= base.makespan
    if mb >= 2:
        assert zb.makespan < base.makespan
        assert zb.bubble < base.bubble
    if mb >= pp:
        assert base.makespan == 3 * mb + 3 * (pp - 1)
        assert zb.makespan <= 3 * mb + pp - 1 + (pp + 1) // 2


def test_zero_bubble_h1_reaches_the_papers_step_on_a_square_pipeline():
    for pp in (2, 3, 4, 8):
        assert simulate(zero_bubble_h1(pp, pp), 1, 2).makespan == 3 * pp + pp - 1


# -- zero bubble in a V (ZB-V) ---------------------------------------------------


@FAST
@given(pp=st.integers(2, 8), mb=MB)
@example(pp=2, mb=1)
@example(pp=4, mb=8)
def test_zero_bubble_v_is_valid_in_a_v_with_1f1b_memory(pp, mb):
    schedule = zero_bubble_v(pp, mb)
    validate(schedule, pp, mb, 2, v=True)
    validate(forward_only(schedule), pp, mb, 2, forward_only=True, v=True)
    for r in range(pp):
        comps = [a for a in schedule[r] if a.kind in (F, I, W)]
        mine = (r, 2 * pp - 1 - r)  # the V: down on rank r, back up on it
        assert sorted(comps) == sorted(
            Action(k, s, m) for k in (F, I, W) for s in mine for m in range(mb)
        )
        # half-size stages in flight: at most 2 pp, what 1F1B's first rank holds
        assert peak_in_flight(schedule, r) <= 2 * pp
    with pytest.raises(PipelineError, match="belongs to rank"):
        validate(schedule, pp, mb, 2)  # read as the loop placement: wrong ranks


@FAST
@given(pp=st.integers(2, 8), mb=st.integers(1, 32))
def test_zero_bubble_v_shrinks_the_bubble(pp, mb):
    """Two half-size stages per rank (F = I = W = 1/2 of a whole stage's unit):
    never slower than ZB-H1 (and so 1F1B) on the same model; from M >= 2 pp
    within pp - 1 units of the bubble-free 3M (1F1B: 3M + 3(pp - 1))."""
    zbv = simulate(zero_bubble_v(pp, mb), 0.5, 1.0, cost_w=0.5)
    assert zbv.makespan <= simulate(zero_bubble_h1(pp, mb), 1, 2).makespan
    assert zbv.makespan <= simulate(one_f_one_b(pp, mb), 1, 2).makespan
    if mb >= 2 * pp:
        assert zbv.makespan <= 3 * mb + pp - 1


def test_zbv_needs_two_stages_per_rank():
    assert get_schedule("zero-bubble-v", 2, 4, chunks=2) == zero_bubble_v(2, 4)
    with pytest.raises(PipelineError, match="chunks=2, placement='v'"):
        get_schedule("zbv", 2, 4)


def test_validate_names_split_backward_mistakes():
    good = zero_bubble_h1(2, 2)

    def edited(rank, fn):
        out = [list(acts) for acts in good]
        out[rank] = fn(out[rank])
        return out

    w_first = edited(1, lambda acts: [Action(W, 1, 0)] + [a for a in acts if a != Action(W, 1, 0)])
    with pytest.raises(PipelineError, match="rank 1: 1W0 runs before its input gradients 1I0"):
        validate(w_first, 2, 2)
    both = edited(1, lambda acts: acts + [Action(B, 1, 0)])
    with pytest.raises(PipelineError, match="1B0 is not expected"):
        validate(both, 2, 2)
    no_w = edited(0, lambda acts: [a for a in acts if a.kind != W])
    with pytest.raises(PipelineError, match="missing 0W0, 0W1"):
        validate(no_w, 2, 2)
    early_send = edited(
        1, lambda acts: [Action(SEND_B, 1, 0)] + [a for a in acts if a != Action(SEND_B, 1, 0)]
    )
    with pytest.raises(PipelineError, match="1SEND_B0 sends before 1I0 computed it"):
        validate(early_send, 2, 2)


def test_split_backward_costs_what_b_costs():
    """simulate: I takes cost_b - cost_w and W cost_w, so a schedule whose
    backwards are split and run back to back takes 1F1B's time."""
    back_to_back = [
        [Action(I if a.kind == B else a.kind, a.stage, a.microbatch) for a in acts]
        for acts in one_f_one_b(3, 4)
    ]
    for acts in back_to_back:
        for k in range(len(acts) - 1, -1, -1):
            if acts[k].kind == I:
                acts.insert(k + 1, Action(W, acts[k].stage, acts[k].microbatch))
    validate(back_to_back, 3, 4)
    for cost_w in (0.5, 1, 1.5):
        assert simulate(back_to_back, 1, 2, cost_w=cost_w).makespan == pytest.approx(
            simulate(one_f_one_b(3, 4), 1, 2).makespan
        )


# -- drawing ------------------------------------------------------------------


def test_format_table_snapshot():
    assert format_table(one_f_one_b(2, 3)) == "\n".join(
        [
            "step   | 0  1  2  3  4  5  6  7",
            "rank 0 | F0 F1 .  B0 F2 B1 .  B2",
            "rank 1 | .  F0 B0 F1 B1 F2 B2 .",
        ]
    )
    assert format_table(gpipe(2, 1), cost_b=2) == "\n".join(
        ["step   | 0  1  2  3  4  5", "rank 0 | F0 .  .  .  B0 B0", "rank 1 | .  F0 B0 B0 .  ."]
    )


def test_format_table_draws_zero_bubble():
    assert format_table(zero_bubble_h1(2, 4)) == "\n".join(
        [
            "step   | 0  1  2  3  4  5  6  7  8  9  10 11 12",
            "rank 0 | F0 F1 .  I0 W0 I1 F2 W1 F3 I2 W2 I3 W3",
            "rank 1 | .  F0 I0 F1 I1 W0 W1 F2 I2 F3 I3 W2 W3",
        ]
    )
    wide = format_table(zero_bubble_h1(2, 1), cost_b=3, cost_w=1).splitlines()
    assert wide[1:] == ["rank 0 | F0 .  .  .  I0 I0 W0", "rank 1 | .  F0 I0 I0 W0 .  ."]
    with pytest.raises(PipelineError, match="cost_b - cost_w=0"):
        format_table(zero_bubble_h1(2, 1), cost_b=2, cost_w=2)
    trace = schedule_to_chrome_trace(zero_bubble_h1(2, 2), cost_f=1, cost_b=2, cost_w=1)
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans["1I0"]["cat"] == spans["1W0"]["cat"] == "backward"
    assert spans["1I0"]["dur"] == spans["1W0"]["dur"] == spans["1F0"]["dur"]


def test_format_table_names_stages_when_interleaved():
    table = format_table(interleaved_1f1b(2, 2, 2))
    assert table.splitlines()[1].startswith("rank 0 | 0F0 0F1 2F0 2F1")


def test_schedule_chrome_trace_structure():
    trace = schedule_to_chrome_trace(one_f_one_b(2, 2), cost_f=1, cost_b=2)
    json.dumps(trace)  # serialisable
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"} == {
        (0, "rank 0"),
        (1, "rank 1"),
    }
    assert {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"} == {(0, 0), (1, 1)}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * 2 * 2
    for e in spans:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["tid"] == e["pid"] == e["args"]["stage"]
    b0 = next(e for e in spans if e["name"] == "1B0")
    assert (b0["ts"], b0["dur"], b0["cat"]) == (2000.0, 2000.0, "backward")
    assert sum(e["ph"] == "i" for e in events) == 2 * 2 * 2  # one per send / recv


def test_tracer_spans_and_merge():
    t0, t1 = Tracer(rank=0), Tracer(rank=1)
    with t0.span("0F0", "forward", {"microbatch": 0}, tid=0):
        pass
    with pytest.raises(ValueError, match="^x$"), t1.span("1F0", "forward", tid=1):
        raise ValueError("x")
    with Tracer(enabled=False).span("nothing"):
        pass
    trace = to_chrome_trace([t0.events, t1.events])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"]) for e in spans] == [("0F0", 0, 0), ("1F0", 1, 1)]
    assert min(e["ts"] for e in spans) == 0.0
    assert all(e["dur"] >= 0 for e in spans)
    assert spans[1]["args"] == {"error": "ValueError"}


def test_write_chrome_trace(tmp_path):
    t = Tracer(rank=3)
    with t.span("3B1", "backward", {"microbatch": 1}, tid=3):
        pass
    path = write_chrome_trace(tmp_path / "step.json", {3: t.events})
    trace = json.loads(Path(path).read_text())
    (span,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (span["name"], span["pid"], span["tid"], span["args"]) == (
        "3B1",
        3,
        3,
        {"microbatch": 1},
    )
