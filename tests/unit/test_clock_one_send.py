"""Records of one send are one observation of the source's clock.

Telegraf and collectd send one metric (or one value list) per message: a flush is dozens of
records stamped and appended alike. The estimator takes the first as the observation and
gives the others its estimate: they neither crowd the window nor count, one by one, toward
confirming a step that a single late send suggests."""

from __future__ import annotations

from pipelines.refine.clock import ClockEstimator
from pipelines.refine.clock_model import ClockSettings, DeclaredTiming

S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S


def _steady(est: ClockEstimator, seconds: int, declared: DeclaredTiming | None = None) -> int:
    """A source sending once a second, appended 2-4 ms after its stamp; returns the next x."""
    x = T0
    for k in range(seconds):
        x = T0 + k * S
        est.observe(x, x + (2 + k % 3) * MS, None, 0, declared)
    return x + S


def test_a_flush_of_many_records_is_one_point_with_the_first_records_estimate() -> None:
    for declared in (None, DeclaredTiming(15 * S)):
        est = ClockEstimator(ClockSettings())
        x = _steady(est, 40, declared)
        before = len(est.points)
        first = est.observe(x, x + 3 * MS, None, 0, declared)
        rest = [est.observe(x, x + 3 * MS, None, 0, declared) for _ in range(63)]
        assert len(est.points) == before + 1
        assert all(r == first for r in rest)
        # a record of the same flush appended a millisecond later is an observation of its own
        est.observe(x, x + 4 * MS, None, 0, declared)
        assert len(est.points) == before + 2


def test_one_late_flush_confirms_no_step_and_three_late_sends_do() -> None:
    s = ClockSettings()
    late = s.step_threshold_ns * 5  # far below the line: the clock stepped back, or it waited
    one = ClockEstimator(s)
    x = _steady(one, 40)
    flush = [one.observe(x, x + late, None, 0) for _ in range(2 * s.step_confirm)]
    assert not any(e.step for e in flush)
    assert len(one.candidates) == 1  # one suspect send, its bound widened to cover both
    assert all(e.error_ns >= late - 10 * MS for e in flush)
    three = ClockEstimator(s)
    x = _steady(three, 40)
    sends = [three.observe(x + k * S, x + k * S + late, None, 0) for k in range(s.step_confirm)]
    assert [e.step for e in sends] == [False] * (s.step_confirm - 1) + [True]


def test_a_repeat_after_a_restore_is_still_one_observation() -> None:
    """The window's newest point is state: a worker restarted between two records of one
    flush (from its checkpoint) gives the second the estimate the first got."""
    declared = DeclaredTiming(5 * S)
    est = ClockEstimator(ClockSettings())
    x = _steady(est, 30, declared)
    first = est.observe(x, x + 3 * MS, None, 0, declared)
    doc, packed = est.to_parts()
    back = ClockEstimator.from_dict(doc, ClockSettings(), packed or b"")
    again = back.observe(x, x + 3 * MS, None, 0, declared)
    assert again == first and len(back.points) == len(est.points)
