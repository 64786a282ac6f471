"""Clock offset/drift estimation from (sent_ns, broker append) pairs, and alignment."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.clock import ClockEstimate, ClockEstimator, ClockSettings, align
from pipelines.refine.clock_hull import slopes_at
from schemas.wire import ClockBlock, SyncState

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000
MS = 1_000_000
C = ClockSettings().assumed_min_delay_ns


class Source:
    """A simulated source: offset + drift, one batch per second, delay = base + Exp(mu)."""

    def __init__(self, seed: int, off0: float, ppm: float, base: float, mu: float) -> None:
        self.rng = random.Random(seed)
        self.off0, self.drift, self.base, self.mu = off0, ppm * 1e-6, base, mu
        self.i = 0
        self.step = 0.0

    def offset(self, t_true: float) -> float:
        return self.off0 + self.step + self.drift * (t_true - T0)

    def next_pair(self) -> tuple[int, int, int]:
        t = T0 + self.i * S + self.rng.randint(0, 100 * MS)
        self.i += 1
        sent = round(t + self.offset(t))
        arrival = round(t + self.base + self.rng.expovariate(1 / self.mu))
        return sent, arrival, t


def sources(
    base_ms: tuple[float, float] = (0.2, 2), mu_ms: tuple[float, float] = (1, 5), off0: Any = None
) -> dict[str, Any]:
    """Strategies for :class:`Source`: any seed, offset up to ±1 h (or ``off0``), drift up to
    ±200 ppm, minimum delay ``base_ms`` and mean jitter ``mu_ms`` (ranges in ms)."""
    return {
        "seed": st.integers(0, 2**32),
        "off0": off0 if off0 is not None else st.floats(-3600 * S, 3600 * S),
        "ppm": st.floats(-200, 200),
        "base": st.floats(base_ms[0] * MS, base_ms[1] * MS),
        "mu": st.floats(mu_ms[0] * MS, mu_ms[1] * MS),
    }


def p99(xs: list[float]) -> float:
    xs = sorted(abs(x) for x in xs)
    return xs[int(0.99 * (len(xs) - 1))]


def run(src: Source, n: int, est: ClockEstimator) -> tuple[list[float], list[ClockEstimate]]:
    """Per batch after convergence: aligned - true for 20 samples stamped in the last second."""
    errs: list[float] = []
    ests = []
    for _ in range(n):
        sent, arrival, t = src.next_pair()
        e = est.observe(sent, arrival)
        ests.append(e)
        if e.converged:
            true_ts = [t - src.rng.randint(0, S) for _ in range(20)]
            ts_src = pa.array([round(x + src.offset(x)) for x in true_ts], pa.int64())
            aligned, off, err = align(ts_src, e)
            assert len(off) == 20 and err == e.error_ns
            errs += [a - x for a, x in zip(aligned.to_pylist(), true_ts, strict=True)]
    return errs, ests


@settings(max_examples=40, deadline=None)
@given(**sources(mu_ms=(1, 3)))
def test_property_converges_on_offset_drift_and_jitter(
    seed: int, off0: float, ppm: float, base: float, mu: float
) -> None:
    """Converged = 120 points since start or step (2 min at one batch/s), 240 batches.

    ``aligned - true = (base - assumed_min_delay) + filter error``. The first term is the
    minimum one-way delay, which no one-way method can separate from the offset (±0.9 ms
    over the 0.2-2 ms range); the filter error is what the estimator controls. Delay jitter
    here is Exp(1-3 ms); heavier jitter has its own, jitter-relative bound below."""
    src = Source(seed, off0, ppm, base, mu)
    errs, ests = run(src, 240, ClockEstimator())
    assert ests[119].converged and not ests[118].converged
    bias = base - C
    assert p99([e - bias for e in errs]) <= 0.8 * MS
    assert p99(errs) <= 1.5 * MS
    assert abs(ests[-1].drift_ppm - ppm) <= 20
    assert all(abs(e) <= ests[-1].error_ns + 0.8 * MS for e in errs[-200:])


@settings(max_examples=25, deadline=None)
@given(**sources(mu_ms=(3, 5)))
def test_property_filter_error_scales_with_heavy_jitter(
    seed: int, off0: float, ppm: float, base: float, mu: float
) -> None:
    """With Exp(3-5 ms) delay jitter the minimum-delay filter's p99 error grows with the
    jitter: measured over seeds 0-399 at 5 ms, at most 0.18 x mu (0.88 ms); the worst stream
    seen (seed 774) 0.21 x mu (1.03 ms). Claimed here: at most 0.3 x mu."""
    src = Source(seed, off0, ppm, base, mu)
    errs, ests = run(src, 240, ClockEstimator())
    assert ests[-1].converged
    assert p99([e - (base - C) for e in errs]) <= 0.3 * mu
    assert abs(ests[-1].drift_ppm - ppm) <= 20


@settings(max_examples=25, deadline=None)
@given(**sources(base_ms=(0.6, 1.6), mu_ms=(1, 2)))
def test_property_p99_within_1ms_when_min_delay_near_assumed(
    seed: int, off0: float, ppm: float, base: float, mu: float
) -> None:
    src = Source(seed, off0, ppm, base, mu)
    errs, _ = run(src, 240, ClockEstimator())
    assert p99(errs) <= 1 * MS


@settings(max_examples=50, deadline=None)
@given(
    exchanges=st.booleans(),
    **sources(off0=st.one_of(st.floats(1.01 * S, 3600 * S), st.floats(-3600 * S, -1.01 * S))),
)
def test_property_source_off_by_more_than_1s_flagged_within_10_batches(
    exchanges: bool, seed: int, off0: float, ppm: float, base: float, mu: float
) -> None:
    """Flagged once the bound proves it (|offset| - error > 1 s): with its exchanges, from
    the second batch on; the model alone needs its first points. Either needs a margin over
    1 s wider than its bound: a few ms of jitter make an exchange's interval several ms wide,
    so 1.05 s is flagged and 1.01 s may not be (and is then not claimed)."""
    if abs(off0) < 1.05 * S:
        off0 = math.copysign(1.05 * S, off0)
    src = Source(seed, off0, ppm, base, mu)
    exp, est = Exporter(src), ClockEstimator()
    alerts = []
    for _ in range(10):
        if exchanges:
            e, _ = exp.observe(est)
        else:
            e = est.observe(*src.next_pair()[:2])
        alerts.append(e.alert())
        assert e.alert() == (abs(e.offset_ns) - e.error_ns > S)
    assert alerts[-1] and alerts.index(True) < (2 if exchanges else 10)


def test_well_synced_source_not_flagged() -> None:
    src = Source(1, 0.3 * S, 50, MS, 3 * MS)
    est = ClockEstimator()
    assert not any(est.observe(*src.next_pair()[:2]).alert() for _ in range(50))


class Exporter:
    """A :class:`Source` whose batches carry its earlier exchanges with the broker, as an
    exporter's do: ``[S, A, R, 0]`` of its last sends (an ack ``ack`` after the append),
    those of before a step of its clock dropped."""

    def __init__(self, src: Source, ack: int = 2 * MS) -> None:
        self.src, self.ack = src, ack
        self.log: list[list[int]] = []
        self.setting = src.step

    def observe(self, est: ClockEstimator) -> tuple[ClockEstimate, int]:
        """One batch: its estimate and the source's true offset at its send."""
        sent, arrival, t = self.src.next_pair()
        if self.src.step != self.setting:  # the exporter saw its clock step
            self.log, self.setting = [], self.src.step
        block = ClockBlock(source="exchange", exchanges=[tuple(x) for x in self.log[-4:]])
        e = est.observe(sent, arrival, block)
        self.log.append([sent, arrival // MS, sent + (arrival - t) + self.ack, 0])
        return e, round(self.src.offset(t))


def test_steps_restart_the_fit() -> None:
    src = Source(3, 5 * MS, 20, MS, 2 * MS)
    exp = Exporter(src)
    est = ClockEstimator()
    for _ in range(60):
        exp.observe(est)
    src.step = 50 * MS  # offset jumps up: seen at once
    e, _ = exp.observe(est)
    assert e.step and e.points == 1
    for _ in range(20):
        e, true = exp.observe(est)
    assert abs(e.offset_ns - true) < 5 * MS and abs(e.offset_ns - true) <= e.error_ns
    src.step = -2 * S  # jumps down: confirmed after a few points, flagged once proven
    steps = [exp.observe(est) for _ in range(10)]
    assert any(x.step for x, _ in steps[:3])
    for x, true in steps:
        assert abs(x.offset_ns - true) <= x.error_ns
        assert x.alert() == (abs(x.offset_ns) - x.error_ns > S)  # a claim the bound makes
    fired = [x.alert() for x, _ in steps]
    # the first batch after the step carries no exchange of the new setting yet (the model's
    # bound then keeps the step's size: no claim); the next one's proves it
    assert fired.index(True) <= 2 and all(fired[fired.index(True) :])
    assert abs(steps[-1][0].offset_ns + 2 * S) < 10 * MS


def test_an_offset_within_the_threshold_never_fires_while_its_bound_is_wide() -> None:
    # a source 0.908 s behind: the model's first estimates are about -1.0 s ± 1 s, and its
    # exchanges' round trips reach 1.5 s (a loaded host)
    e = ClockEstimate(offset_ns=-1_018 * MS, anchor_ns=T0, drift_ppm=0.0, error_ns=S + MS,
                      points=1, converged=False)  # fmt: skip
    assert not e.alert() and e.alert_claim() is None
    for seed in range(5):
        src = Source(seed, -0.908 * S, 30, MS, 80 * MS)
        exp = Exporter(src, ack=round(random.Random(seed).uniform(0.2, 1.5) * S))
        est = ClockEstimator()
        claims = [exp.observe(est)[0].alert_claim() for _ in range(40)]
        assert True not in claims
    src = Source(9, 0.9 * S, 30, MS, 3 * MS)  # tight exchanges: proven within
    exp, est = Exporter(src), ClockEstimator()
    claims = [exp.observe(est)[0].alert_claim() for _ in range(10)]
    assert True not in claims and claims[-1] is False


def test_chrony_cross_check_widens_error_when_it_disagrees() -> None:
    src = Source(5, 20 * MS, 10, MS, 2 * MS)
    est = ClockEstimator()
    for _ in range(30):
        sent, arrival, t = src.next_pair()
        agree = ClockBlock(source="chrony", offset_ns=round(src.offset(t)), error_bound_ns=MS,
                           state=SyncState.SYNCED)  # fmt: skip
        e = est.observe(sent, arrival, agree)
    assert e.disagreement_ns is None
    sent, arrival, t = src.next_pair()
    bad = ClockBlock(source="chrony", offset_ns=round(src.offset(t)) + 100 * MS, error_bound_ns=MS)
    e = est.observe(sent, arrival, bad)
    assert e.disagreement_ns is not None and abs(e.disagreement_ns - 100 * MS) < 5 * MS
    assert e.error_ns >= 100 * MS


def test_align_applies_drift_per_row_and_state_round_trips() -> None:
    e = ClockEstimate(offset_ns=1000, anchor_ns=T0, drift_ppm=100.0, error_ns=5, points=9,
                      converged=True)  # fmt: skip
    ts, off, err = align(pa.array([T0, T0 + S, T0 - S], pa.int64()), e)
    assert off.to_pylist() == [1000, 1000 + 100_000, 1000 - 100_000]
    assert ts.to_pylist() == [T0 - 1000, T0 + S - 101_000, T0 - S + 99_000]
    assert err == 5
    src = Source(9, 7 * MS, -30, MS, 2 * MS)
    est = ClockEstimator()
    for _ in range(40):
        est.observe(*src.next_pair()[:2])
    back = ClockEstimator.from_dict(est.to_dict())
    assert back.estimate().offset_ns == est.estimate().offset_ns
    assert len(est.points) <= est.settings.window


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(2, 24),
    moves=st.lists(st.tuples(st.integers(-2, 4), st.integers(-6, 6)), min_size=1, max_size=200),
)
def test_property_the_kept_hull_and_x_sum_are_those_of_the_points(
    window: int, moves: list[tuple[int, int]]
) -> None:
    # small integer coordinates: equal x, collinear points, points out of order and steps
    # (restarts) all happen; after every observation the hull kept up to date as points come
    # and go must be the one built from the points, and so must the x sum
    from pipelines.refine.clock_hull import upper_hull

    est = ClockEstimator(ClockSettings(window=window, min_fit_points=3, step_threshold_ns=8))
    x = T0
    for dx, y in moves:
        x += dx
        est.observe(x, x - y)
        assert est._hull_now() == upper_hull(est.points)
        hull = est._hull_now()
        xs = sorted({p[0] + d for p in est.points for d in (-1, 0, 1)})
        spans = [
            next(((q[1] - p[1]) / (q[0] - p[0]) for p, q in itertools.pairwise(hull)
                  if p[0] <= x <= q[0] and q[0] > p[0]), None)
            for x in xs
        ]  # fmt: skip
        assert slopes_at(hull, xs) == spans
        assert est._xbar() == sum(p[0] for p in est.points) / len(est.points)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    seed=st.integers(0, 2**32),
    b_ppm=st.floats(-500, 500),
    spread=st.sampled_from([10, 10**6, 10**12, 1 << 61]),
)
def test_property_gap_statistics_are_those_of_the_sorted_python_floats(
    n: int, seed: int, b_ppm: float, spread: int
) -> None:
    # numpy computes the distances below the line from 48 points on: the same floats, so
    # the same order statistics as sorting Python's own, at any magnitude
    from collections import deque

    from pipelines.refine.clock_hull import gap_stats

    rng = random.Random(seed)
    xs = sorted(T0 + rng.randint(-spread, spread) for _ in range(n))
    pts = deque((x, rng.randint(-3600 * S, 3600 * S)) for x in xs)
    a, b, xa = float(rng.randint(-S, S)), b_ppm * 1e-6, xs[0]
    gaps = sorted(a + b * (p[0] - xa) - p[1] for p in pts)
    assert gap_stats(pts, a, b, xa) == (gaps[n // 8], gaps[n // 2], gaps[-1])


class LoadedSource(Source):
    """A :class:`Source` whose sends queue longer and longer from batch ``onset`` on: the
    delays' lower envelope rises by ``jump`` at once, then by ``rate`` (s per s)."""

    def __init__(self, *args: float, onset: int, rate: float, jump: float = 0.0) -> None:
        super().__init__(int(args[0]), *args[1:])
        self.onset, self.rate, self.jump, self.base0 = onset, rate, jump, self.base

    def next_pair(self) -> tuple[int, int, int]:
        late = self.i - self.onset
        self.base = self.base0 + (self.jump + late * self.rate * S if late >= 0 else 0.0)
        return super().next_pair()


def overshoots(src: Source, n: int, start: int) -> list[float]:
    """|offset error| - stated bound of each batch from ``start`` on (> 0: outside it)."""
    est, out = ClockEstimator(), []
    for i in range(n):
        sent, arrival, t = src.next_pair()
        e = est.observe(sent, arrival)
        if i >= start:
            out.append(abs(e.offset_at(sent) - src.offset(t)) - e.error_ns)
    return out


def trend_runs(
    seeds: range, drift_ppm: float, rate_ppm: tuple[float, float], onset: tuple[int, int]
) -> tuple[float, list[float]]:
    """Sources with a delay trend, drawn from each seed: drift up to ±``drift_ppm``, the
    trend's rate and onset in the ranges, Exp(1-3 ms) delays; 150 batches after the onset.
    Returns the share of those batches within their bound, and each source's worst miss."""
    within, worst = [], []
    for seed in seeds:
        rng = random.Random(seed)
        src = LoadedSource(
            seed, rng.uniform(-3600, 3600) * S, rng.uniform(-drift_ppm, drift_ppm),
            rng.uniform(0.2, 2) * MS, rng.uniform(1, 3) * MS,
            onset=rng.randint(*onset), rate=rng.uniform(*rate_ppm) * 1e-6,
        )  # fmt: skip
        over = overshoots(src, src.onset + 150, src.onset)
        within.append(sum(o <= 0 for o in over) / len(over))
        worst.append(max(over))
    return sum(within) / len(within), sorted(worst)


def test_a_steep_delay_trend_widens_the_bound() -> None:
    """Delays rising by 600-1000 µs a second tilt the envelope past any oscillator's drift
    (±100 ppm here). Over these 40 sources: 99.8 % of the batches within their bound, the
    worst miss 2.4 ms (without the widening: 22 % within, the worst misses 84-92 ms)."""
    share, worst = trend_runs(range(40), 100, (600, 1000), (40, 120))
    assert share >= 0.99
    assert worst[-1] <= 5 * MS


def test_a_delay_trend_that_begins_in_the_window_widens_the_bound() -> None:
    """A trend of 100-300 µs a second leaves a slope an oscillator could have (±200 ppm),
    but bends the hull where it began. Over these 40 sources every batch is within its
    bound (without the bend check: 48 % within, misses up to 44 ms). Trends near 100 µs/s
    on heavy jitter can go unseen for a while (hypothesis found a 2.9 ms miss at 100)."""
    share, worst = trend_runs(range(40), 200, (100, 300), (60, 100))
    assert share >= 0.99
    assert worst[-1] <= 1 * MS


def test_a_step_down_keeps_a_wide_bound_unless_the_drift_stays() -> None:
    # delays 30 ms longer at once, then growing 300 µs/s: read as a step down, but the slope
    # since differs from the one before it, so the bound keeps covering the error
    src = LoadedSource(11, 5 * MS, 80, MS, 2 * MS, onset=150, rate=300e-6, jump=30 * MS)
    est, steps, over = ClockEstimator(), 0, []
    for i in range(400):
        sent, arrival, t = src.next_pair()
        e = est.observe(sent, arrival)
        steps += e.step
        if i >= 150:
            over.append(abs(e.offset_at(sent) - src.offset(t)) - e.error_ns)
    assert steps == 1 and est.back_step_ns > 25 * MS
    assert max(over) <= 0
    # a clock that truly steps back 30 ms keeps its drift: wide for min_converged_points
    # batches, then as tight as before the step
    src = Source(11, 5 * MS, 80, MS, 2 * MS)
    est = ClockEstimator()
    for _ in range(150):
        est.observe(*src.next_pair()[:2])
    src.step = -30 * MS
    bounds = [est.observe(*src.next_pair()[:2]).error_ns for _ in range(250)]
    assert min(bounds[5:110]) > 30 * MS
    assert max(bounds[130:]) < 3 * MS


def test_the_widening_state_round_trips() -> None:
    # restored from its checkpoint mid-trend, an estimator goes on exactly as the original
    src = LoadedSource(12, 5 * MS, 120, MS, 2 * MS, onset=80, rate=400e-6, jump=30 * MS)
    est = ClockEstimator()
    for _ in range(150):
        est.observe(*src.next_pair()[:2])
    assert est.back_step_ns and est.scatter is not None
    back = ClockEstimator.from_dict(est.to_dict())
    for _ in range(60):
        sent, arrival, _ = src.next_pair()
        assert back.observe(sent, arrival) == est.observe(sent, arrival)
        assert back.scatter == est.scatter
    assert back.to_dict() == est.to_dict()


def test_the_estimate_says_why_its_bound_was_widened() -> None:
    def reasons(src: Source, n: int, start: int) -> set[str | None]:
        est, seen = ClockEstimator(), set()
        for i in range(n):
            e = est.observe(*src.next_pair()[:2])
            if i >= start:
                seen.add(e.widened)
        return seen

    # steady: never, once converged
    assert reasons(Source(3, 5 * MS, 20, MS, 2 * MS), 300, 120) == {None}
    steep = LoadedSource(4, 5 * MS, 20, MS, 2 * MS, onset=60, rate=800e-6)
    assert "delay_trend" in reasons(steep, 200, 100)
    slow = LoadedSource(5, 5 * MS, 50, MS, 2 * MS, onset=80, rate=150e-6)
    assert "bend" in reasons(slow, 230, 130)
    jump = LoadedSource(11, 5 * MS, 80, MS, 2 * MS, onset=150, rate=300e-6, jump=30 * MS)
    assert "step_down" in reasons(jump, 260, 150)


def test_a_batch_without_exchanges_keeps_the_model_bound_the_exchanges_proved() -> None:
    # a loaded host: every send waits 6 ms at least, beyond the model's assumed 0.2-2 ms, so
    # the model alone is ~5 ms off with a bound of ~1-2 ms; a batch that carries no exchange
    # (stamped before a step its exporter saw, sent after it) widens by what they showed
    src = Source(11, 40 * MS, 20, 6 * MS, 1 * MS)
    exp, est = Exporter(src), ClockEstimator()
    for i in range(40):
        e, true = exp.observe(est)
        assert (e.basis == "exchange") == (i > 0) and abs(e.offset_ns - true) <= e.error_ns
    alone = ClockEstimator.from_dict(est.to_dict())
    alone.excess.clear()  # the model without what the exchanges showed
    sent, arrival, t = src.next_pair()
    lying = alone.observe(sent, arrival, ClockBlock(source="none"))
    assert abs(lying.offset_ns - round(src.offset(t))) > lying.error_ns
    for kept in (est, ClockEstimator.from_dict(est.to_dict())):  # and after a restart
        e = kept.observe(sent, arrival, ClockBlock(source="none"))
        assert e.basis == "assumed" and abs(e.offset_ns - round(src.offset(t))) <= e.error_ns
        assert e.error_ns < 10 * MS
