"""annot.plan.partition: the optimal split checked against brute force over every
composition (n <= 9) and against a plain O(k * n^2) DP (n <= 60), with
memory budgets, shared (tied) parameters and communication."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from annot.core.errors import PartitionError
from annot.plan.partition import Partition, evaluate, fit, partition

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- reference implementations ------------------------------------------------


def stage_time(c, x, bw, a, b):
    n = len(c)
    t = float(sum(c[a:b]))
    if x is not None:
        if a > 0:
            t += x[a - 1] / bw
        if b < n:
            t += x[b - 1] / bw
    return t


def stage_mem(m, shared, a, b):
    return sum(m[a:b]) + sum(nb for nb, members in shared if any(a <= j < b for j in members))


def splits(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield list(zip((0, *cuts), (*cuts, n)))


def brute(c, m, k, budget=None, x=None, bw=None, shared=()):
    """(bottleneck, smallest sum of squares at that bottleneck) or None."""
    best = None
    for bounds in splits(len(c), k):
        if budget is not None and max(stage_mem(m, shared, a, b) for a, b in bounds) > budget:
            continue
        times = [stage_time(c, x, bw, a, b) for a, b in bounds]
        key = (max(times), sum(t * t for t in times))
        best = key if best is None else min(best, key)
    return best


def feasible_counts(m, budget, shared, max_k):
    n = len(m)
    return [
        k
        for k in range(1, min(n, max_k) + 1)
        if any(max(stage_mem(m, shared, a, b) for a, b in bs) <= budget for bs in splits(n, k))
    ]


def reference_dp(c, k):
    """Plain O(k n^2) DP: min bottleneck, then min sum of squares at it."""
    n = len(c)
    pre = [0]
    for v in c:
        pre.append(pre[-1] + v)
    inf = math.inf
    f = [[inf] * (n + 1) for _ in range(k + 1)]
    f[0][0] = 0
    for s in range(1, k + 1):
        for b in range(1, n + 1):
            f[s][b] = min((max(f[s - 1][a], pre[b] - pre[a]) for a in range(b)), default=inf)
    L = f[k][n]
    g = [[inf] * (n + 1) for _ in range(k + 1)]
    g[0][0] = 0
    for s in range(1, k + 1):
        for b in range(1, n + 1):
            g[s][b] = min(
                (g[s - 1][a] + (pre[b] - pre[a]) ** 2 for a in range(b) if pre[b] - pre[a] <= L),
                default=inf,
            )
    return L, g[k][n]


def check_shape(p: Partition, n: int, k: int) -> None:
    assert p.n_stages == k
    assert p.bounds[0][0] == 0
    assert p.bounds[-1][1] == n
    assert all(a < b for a, b in p.bounds), "every stage is non-empty"
    assert all(p.bounds[i][1] == p.bounds[i + 1][0] for i in range(k - 1)), "contiguous"
    assert p.boundaries == [a for a, _ in p.bounds[1:]]


# -- strategies ---------------------------------------------------------------


@st.composite
def problems(draw, comm=False, with_shared=False, integral=True):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, n))
    if integral:
        c = draw(st.lists(st.integers(0, 12).map(float), min_size=n, max_size=n))
    else:
        c = draw(
            st.lists(
                st.floats(0, 1e3, allow_nan=False, allow_subnormal=False), min_size=n, max_size=n
            )
        )
    m = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    budget = draw(st.none() | st.integers(1, 60))
    x = bw = None
    if comm:
        x = draw(st.lists(st.integers(0, 12).map(float), min_size=n, max_size=n))
        bw = draw(st.sampled_from([1.0, 2.0, 4.0]))
    shared = []
    if with_shared:
        for _ in range(draw(st.integers(0, 2))):
            members = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))
            shared.append((draw(st.integers(0, 12)), members))
    return c, m, k, budget, x, bw, shared


def run_both(c, m, k, budget, x, bw, shared):
    expected = brute(c, m, k, budget, x, bw, shared)
    kwargs = dict(memory_budget=budget, cross_bytes=x, bandwidth=bw, shared=shared)
    if expected is None:
        with pytest.raises(PartitionError):
            partition(c, m, k, **kwargs)
        return None, None
    p = partition(c, m, k, **kwargs)
    check_shape(p, len(c), k)
    for (a, b), t, mem in zip(p.bounds, p.stage_costs, p.stage_memory):
        assert t == pytest.approx(stage_time(c, x, bw, a, b))
        assert mem == stage_mem(m, shared, a, b)
        if budget is not None:
            assert mem <= budget
    return p, expected


# -- optimality ---------------------------------------------------------------


@SETTINGS
@given(problems())
@example(([3.0, 1.0, 1.0, 1.0, 3.0], [1] * 5, 3, None, None, None, []))
@example(([0.0, 0.0, 0.0], [0, 0, 0], 3, None, None, None, []))
@example(([5.0, 0.0, 0.0, 5.0], [9, 1, 1, 9], 2, 10, None, None, []))
def test_matches_brute_force(prob):
    p, expected = run_both(*prob)
    if p is not None:
        assert p.bottleneck == expected[0]
        assert sum(t * t for t in p.stage_costs) == expected[1], "most even among optimal"


@SETTINGS
@given(problems(with_shared=True))
@example(([4.0, 1.0, 1.0, 1.0, 1.0, 4.0], [1] * 6, 2, 20, None, None, [(10, {0, 5})]))
def test_shared_groups_match_brute_force(prob):
    p, expected = run_both(*prob)
    if p is not None:
        assert p.bottleneck == expected[0]
        assert sum(t * t for t in p.stage_costs) == expected[1]


@SETTINGS
@given(problems(comm=True, with_shared=True))
@example(([1.0, 1.0, 1.0, 1.0], [0] * 4, 2, None, [0.0, 12.0, 0.0, 0.0], 1.0, []))
def test_communication_matches_brute_force(prob):
    p, expected = run_both(*prob)
    if p is not None:
        assert p.bottleneck == expected[0]
        assert sum(t * t for t in p.stage_costs) == expected[1]


@SETTINGS
@given(problems(integral=False))
def test_float_costs_bottleneck_matches_brute_force(prob):
    p, expected = run_both(*prob)
    if p is not None:
        assert math.isclose(p.bottleneck, expected[0], rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(20, 60).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n), st.integers(2, 8)
        )
    )
)
def test_medium_sizes_match_reference_dp(case):
    c, k = case
    L, sq = reference_dp(c, k)
    p = partition(c, None, k)
    check_shape(p, len(c), k)
    assert p.bottleneck == L
    assert sum(t * t for t in p.stage_costs) == sq


def test_comm_can_make_a_longer_stage_faster():
    # Cutting after segment 1 costs 12 on both sides; the optimum avoids it
    # even though that makes a stage longer than the plain balanced split.
    c = [1.0, 1.0, 1.0, 1.0]
    p = partition(c, None, 2, cross_bytes=[0.0, 12.0, 0.0, 0.0], bandwidth=1.0)
    assert p.bounds != [(0, 2), (2, 4)]
    assert p.bottleneck == 3.0
    assert p.stage_comm == [0.0, 0.0]
    assert partition(c, None, 2).bounds == [(0, 2), (2, 4)]


# -- fit and errors -------------------------------------------------------------


@SETTINGS
@given(problems(with_shared=True), st.integers(1, 9))
def test_fit_returns_the_smallest_feasible_stage_count(prob, max_stages):
    c, m, _, budget, _, _, shared = prob
    budget = 30 if budget is None else budget
    max_stages = min(max_stages, len(c))
    counts = feasible_counts(m, budget, shared, max_stages)
    if not counts:
        with pytest.raises(PartitionError):
            fit(c, m, budget, max_stages=max_stages, shared=shared)
        return
    p = fit(c, m, budget, max_stages=max_stages, shared=shared)
    assert p.n_stages == counts[0]
    assert p.bottleneck == brute(c, m, counts[0], budget, shared=shared)[0]
    assert max(p.stage_memory) <= budget


def test_segment_too_big_for_the_budget():
    with pytest.raises(PartitionError) as err:
        partition([1.0, 1.0, 1.0], [4, 11, 4], 3, memory_budget=10)
    assert str(err.value) == (
        "segment 1 alone needs 11 bytes (its own memory plus the shared parameters it holds) "
        "> memory budget 10 bytes; no partition can fit: raise memory_budget or split that "
        "segment at more candidate points"
    )
    with pytest.raises(PartitionError, match=r"segment 0 alone needs 12 bytes"):
        fit([1.0, 1.0], [4, 4], 10, max_stages=2, shared=[(8, {0})])


def test_too_few_stages_for_the_budget_says_how_many_would_fit():
    with pytest.raises(PartitionError) as err:
        partition([1.0] * 6, [5] * 6, 2, memory_budget=10)
    assert str(err.value) == (
        "no split into 2 stages fits memory budget 10 bytes: the best 2-stage split has a "
        "stage of 15 bytes; 3 stages would fit (fit(..., max_stages=...) picks the count), "
        "or raise memory_budget"
    )


def test_fit_error_names_the_best_split_and_the_budget():
    gib = 2**30
    with pytest.raises(PartitionError) as err:
        fit([1.0] * 6, [3 * gib] * 6, 4 * gib, max_stages=4)
    assert str(err.value) == (
        "needs more than max_stages=4 stages: best with 4 stages has a stage of 6.00 GiB > "
        "budget 4.00 GiB; raise max_stages or memory_budget"
    )


def test_shared_group_is_charged_once_per_stage_holding_it():
    # Embedding (0) tied to the head (3): 8 bytes shared, charged once to a
    # stage holding both, and in full to each stage holding one.
    shared = [(8, {0, 3})]
    p = evaluate([1.0] * 4, [1] * 4, [], shared=shared)
    assert p.stage_memory == [4 + 8]
    p = evaluate([1.0] * 4, [1] * 4, [2], shared=shared)
    assert p.stage_memory == [2 + 8, 2 + 8]
    assert fit([1.0] * 4, [1] * 4, 12, max_stages=4, shared=shared).n_stages == 1
    assert fit([1.0] * 4, [1] * 4, 11, max_stages=4, shared=shared).n_stages == 2


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: partition([1.0, 2.0], None, 3), "cannot split 2 segments into 3 non-empty"),
        (lambda: partition([1.0, 2.0], None, 0), "n_stages must be in 1..2"),
        (lambda: partition([1.0, -2.0], None, 1), r"costs\[1\] = -2.0; expected a finite"),
        (lambda: partition([1.0, 2.0], [1], 1), "memories has 1 entries; expected one per"),
        (lambda: partition([1.0], None, 1, cross_bytes=[1.0]), "give cross_bytes= and bandwidth="),
        (lambda: partition([], None, 1), "costs is empty"),
        (lambda: partition([1.0], None, 1, shared=[(1, {4})]), "expected segment indices"),
        (lambda: evaluate([1.0, 1.0], None, [2]), "must increase strictly within 1..1"),
    ],
)
def test_bad_arguments_teach_the_fix(call, message):
    with pytest.raises(PartitionError, match=message):
        call()


# -- shape of the answer ----------------------------------------------------------


def test_exactly_n_stages_even_with_zero_costs():
    p = partition([0.0] * 7, None, 5)
    check_shape(p, 7, 5)
    assert p.bottleneck == 0.0
    assert p.imbalance == 1.0


def test_deterministic():
    import random

    rng = random.Random(7)
    c = [float(rng.randint(1, 3)) for _ in range(300)]
    m = [rng.randint(1, 5) for _ in range(300)]
    first = partition(c, m, 16, memory_budget=80, shared=[(20, {0, 299})])
    for _ in range(3):
        assert partition(c, m, 16, memory_budget=80, shared=[(20, {0, 299})]) == first


def test_uneven_model_is_balanced_where_a_uniform_split_is_not():
    # Big embedding and LM head (tied), 24 small blocks, 4 stages.
    costs = [4.0] + [1.0] * 24 + [4.0]
    memories = [0] + [100] * 24 + [0]
    shared = [(500, {0, 25})]
    n = len(costs)
    p = partition(costs, memories, 4, memory_budget=1000, shared=shared)
    uniform = evaluate(costs, memories, [round(i * n / 4) for i in range(1, 4)], shared=shared)
    assert p.imbalance <= 1.10
    assert uniform.imbalance > 1.10
    assert max(p.stage_memory) <= 1000
    assert p.bounds == [(0, 5), (5, 13), (13, 21), (21, 26)]


def test_many_segments_into_many_stages_is_sane():
    import random

    rng = random.Random(3)
    c = [rng.uniform(0.5, 1.5) for _ in range(3000)]
    m = [rng.randint(1, 100) for _ in range(3000)]
    budget = int(sum(m) / 48 * 1.1)
    p = partition(c, m, 48, memory_budget=budget)
    check_shape(p, 3000, 48)
    assert max(p.stage_memory) <= budget
    assert p.bottleneck >= max(max(c), sum(c) / 48)
    assert p.imbalance < 1.05
    # Interleaved virtual stages are just more stages.
    assert partition(c, m, 96).n_stages == 96


def test_bounds_are_ints_and_error_messages_use_gib_for_large_values():
    p = partition([1.0, 2.0, 3.0], [1, 1, 1], 2)
    assert all(type(a) is int and type(b) is int for a, b in p.bounds)
    with pytest.raises(PartitionError, match=re.escape("segment 0 alone needs 6.00 GiB (its own")):
        partition([1.0], [6 * 2**30], 1, memory_budget=5 * 2**30)
