"""The clock estimator's kept hull (updated as points come and go, bursts of equal send
times included) gives exactly the estimates of a hull rebuilt from the points each time."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.clock import ClockEstimate, ClockEstimator, ClockSettings
from pipelines.refine.clock_hull import hull_without_first, upper_hull

T0 = 1_700_000_000_000_000_000


class _Rebuilt(ClockEstimator):
    """The estimator with no kept hull: built from the points whenever needed."""

    def _hull_now(self) -> list[tuple[int, int]]:
        self._hull = None
        return upper_hull(self.points)


def _fields(e: ClockEstimate) -> tuple[object, ...]:
    return (
        e.offset_ns, e.anchor_ns, e.drift_ppm, e.error_ns, e.points, e.converged, e.step,
        e.disagreement_ns, e.widened, e.basis,
    )  # fmt: skip


def _same_estimates(cfg: ClockSettings, pairs: list[tuple[int, int]]) -> int:
    kept, rebuilt = ClockEstimator(cfg), _Rebuilt(cfg)
    cached = 0
    for sent, arrival in pairs:
        a, b = kept.observe(sent, arrival), rebuilt.observe(sent, arrival)
        assert _fields(a) == _fields(b)
        assert a == b
        assert kept.points == rebuilt.points
        cached += kept._hull is not None
        assert kept._hull_now() == upper_hull(kept.points)
    return cached


@settings(max_examples=400, deadline=None)
@given(
    window=st.integers(2, 40),
    moves=st.lists(
        st.tuples(st.sampled_from([0, 0, 0, 1, 2, 5, -1, -3]), st.integers(-6, 6)),
        min_size=1,
        max_size=250,
    ),
)
def test_property_equal_x_runs_out_of_order_points_and_steps_estimate_as_rebuilt(
    window: int, moves: list[tuple[int, int]]
) -> None:
    # small coordinates: runs of equal x (in any order of y), collinear points, points out
    # of order and steps (restarts, some keeping their candidates in arrival order)
    cfg = ClockSettings(window=window, min_fit_points=3, step_threshold_ns=8, step_confirm=2)
    pairs, x = [], T0
    for dx, y in moves:
        x += dx
        pairs.append((x, x - y))
    _same_estimates(cfg, pairs)


@pytest.mark.parametrize("jitter", [True, False])
def test_bursts_sent_at_one_time_keep_the_hull_and_estimate_as_rebuilt(jitter: bool) -> None:
    # one-metric messages: bursts of up to 64 records with one send time, 1-5 ms delays
    # (or one delay: a burst's points all alike, all bursts on one line), drift, a step up
    # and a confirmed step down; a full window (the default 256 points)
    rng = random.Random(7)
    pairs, sent = [], T0
    for burst in range(400):
        sent += 1_000_000_000
        offset = 30_000_000 + sent % 10**12 // 50_000 + (40_000_000 if burst >= 200 else 0)
        offset -= 90_000_000 if burst >= 320 else 0
        for _ in range(rng.choice([1, 8, 64])):
            arrival = sent - offset + (rng.randrange(1_000_000, 5_000_000) if jitter else 0)
            pairs.append((sent, arrival))
    cached = _same_estimates(ClockSettings(), pairs)
    assert cached > 0.9 * len(pairs)  # the hull is kept, not rebuilt per point


@settings(max_examples=400, deadline=None)
@given(xs=st.lists(st.tuples(st.integers(0, 6), st.integers(-5, 5)), min_size=2, max_size=40))
def test_property_a_hull_without_its_first_point_is_the_one_built_again(
    xs: list[tuple[int, int]],
) -> None:
    pts = deque(sorted(xs, key=lambda p: p[0]))  # equal x keep their given order of y
    hull = upper_hull(pts)
    pts.popleft()
    assert hull_without_first(hull, pts) == upper_hull(pts)


def _below_or_on(hull: list[tuple[int, int]], p: tuple[int, int]) -> bool:
    """Whether ``p`` lies on or below the hull's chain (exact integers)."""
    if p[0] < hull[0][0] or p[0] > hull[-1][0]:
        return False
    for (ax, ay), (bx, by) in itertools.pairwise(hull):
        if ax <= p[0] <= bx and bx > ax:
            return (bx - ax) * (p[1] - ay) <= (by - ay) * (p[0] - ax)
    return all(p[1] <= h[1] for h in hull if h[0] == p[0])


def test_a_burst_at_the_left_end_keeps_its_highest_point_on_the_hull() -> None:
    # issue #42: the chain kept a bottom burst's first and last point, whatever their heights
    pts = deque([(0, -5), (0, 0), (0, -3), (10, -20), (20, -1)])
    hull = upper_hull(pts)
    assert hull == [(0, 0), (20, -1)]
    assert all(_below_or_on(hull, p) for p in pts)


@settings(max_examples=400, deadline=None)
@given(xs=st.lists(st.tuples(st.integers(0, 6), st.integers(-5, 5)), min_size=1, max_size=40))
def test_property_every_point_lies_on_or_below_the_hull_and_each_x_has_one_vertex(
    xs: list[tuple[int, int]],
) -> None:
    pts = deque(sorted(xs, key=lambda p: p[0]))  # equal x keep their given order of y
    hull = upper_hull(pts)
    assert all(_below_or_on(hull, p) for p in pts)
    assert [h[0] for h in hull] == sorted({h[0] for h in hull})  # no two vertices at one x
    for h in hull:
        assert h[1] == max(p[1] for p in pts if p[0] == h[0])
    # and the line the estimator fits lies above every point: no point above it
    est = ClockEstimator(ClockSettings(window=64, min_fit_points=2, step_threshold_ns=10**9))
    for x, y in pts:
        est.points.append((T0 + x, y))
    est._hull = None
    a, b, xa, _ = est._line()
    assert all(a + b * (x - xa) >= y - 1e-6 for x, y in est.points)
