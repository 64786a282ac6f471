"""The clock model's settings and estimates, and how an estimate is applied: held to the
hard interval of a source's exchanges (:func:`bounded`), and to a batch's timestamps
(:func:`align`, :func:`row_errors`). The estimator that produces estimates is
:class:`pipelines.refine.clock.ClockEstimator`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array
from pipelines.refine.clock_bounds import (
    DRIFT_PPM,
    Exchange,
    drift_allowance,
    drift_rate,
    exchanges_of,
    hard_interval,
    own_floor,
)
from schemas.wire import ClockBlock


@dataclass(frozen=True)
class ClockSettings:
    window: int = 256
    min_fit_points: int = 8
    min_converged_points: int = 120
    assumed_min_delay_ns: int = 1_100_000
    delay_uncertainty_ns: int = 900_000
    max_drift_ppm: float = 500.0
    # The largest drift a source's oscillator is taken to have. A fitted slope beyond it is
    # read as a trend in the delays, not as drift; the error bound then widens (see the
    # docstring of pipelines.refine.clock).
    plausible_drift_ppm: float = 200.0
    # The drift of a source's oscillator against the broker's clock that exchanges are
    # widened by (pipelines.refine.clock_bounds.DRIFT_PPM): its time daemon's steps and slews
    # are carried by the exporter, so only the oscillator is left.
    exchange_drift_ppm: float = DRIFT_PPM
    step_threshold_ns: int = 10_000_000
    step_confirm: int = 3
    # Until min_fit_points points exist (at start and after a step) nothing bounds the delay
    # of the few points seen: the stated error includes this margin.
    initial_error_ns: int = 1_000_000_000
    alert_threshold_ns: int = 1_000_000_000


@dataclass(frozen=True)
class ClockEstimate:
    """``offset(t) = offset_ns + drift_ppm·1e-6·(t - anchor_ns)`` for ``t`` on the source
    clock; ``error_ns`` bounds ``|offset(t) - true offset|`` near ``anchor_ns``."""

    offset_ns: int
    anchor_ns: int
    drift_ppm: float
    error_ns: int
    points: int
    converged: bool
    step: bool = False  # a clock step was detected by the last observation
    disagreement_ns: int | None = None  # source's own report - ours, when beyond the bounds
    # why error_ns is wider than the delay model alone says (the first that applied):
    # "delay_trend" (a slope no oscillator has), "bend" (a trend that began in the window),
    # "step_down" (a step down that may be a delay episode); None: not widened so
    widened: str | None = None
    # what the bound rests on: "exchange" (the source's exchanges with the broker: holds by
    # construction, see pipelines.refine.clock_bounds), "declared" (a producer without
    # exchanges whose topic declares the most its rows wait before their append: holds while
    # that does), "assumed" (the minimum-delay model above),
    # "create_time" (the record carried no broker append time and the source no exchanges:
    # the last estimate, not moved by this record)
    basis: str = "assumed"
    # how fast the bound grows away from ``anchor_ns`` (per ns of |ts_source - anchor|)
    error_rate: float = 0.0

    def error_at(self, t_source_ns: int) -> int:
        """The bound at source time ``t_source_ns``."""
        return self.error_ns + math.ceil(self.error_rate * abs(t_source_ns - self.anchor_ns))

    def offset_at(self, t_source_ns: int) -> int:
        return self.offset_ns + round(self.drift_ppm * 1e-6 * (t_source_ns - self.anchor_ns))

    def alert(self, threshold_ns: int = 1_000_000_000) -> bool:
        """True when the bound proves the source's clock off the common clock by more than
        the threshold: ``|offset| - error > threshold``. An offset beyond the threshold whose
        bound reaches back within it is no claim yet (see :meth:`alert_claim`)."""
        return abs(self.offset_ns) - self.error_ns > threshold_ns

    def alert_claim(self, threshold_ns: int = 1_000_000_000) -> bool | None:
        """What the bound proves: True, the offset is beyond the threshold (:meth:`alert`);
        False, within it (``|offset| + error <= threshold``); None, neither (a wide bound:
        at a source's start, after a step): an alert stays as it was until one is proven."""
        if self.alert(threshold_ns):
            return True
        if abs(self.offset_ns) + self.error_ns <= threshold_ns:
            return False
        return None


UNKNOWN = ClockEstimate(0, 0, 0.0, 2**62, 0, False)


@dataclass(frozen=True)
class DeclaredTiming:
    """What a site declares of a producer without exchanges (per ingest topic): the most its
    rows wait between their stamp and their append, and optionally how close its hosts keep
    their clocks to the broker's (a fleet disciplined by chrony or PTP). See
    :meth:`pipelines.refine.clock.ClockEstimator.observe` and docs/clock.md."""

    send_delay_max_ns: int
    clock_error_ns: int | None = None


def bounded(
    est: ClockEstimate,
    x: int,
    clock: ClockBlock | None,
    drift_ppm: float = DRIFT_PPM,
    append: tuple[int, int] | None = None,
) -> ClockEstimate:
    """``est`` held to the hard interval ``[lo, hi]`` the clock block's exchanges give
    (:func:`pipelines.refine.clock_bounds.hard_interval`), for a batch sent at source time
    ``x``.

    The offset is the interval's middle, or, where the model's own interval ``offset ±
    error`` is narrower and meets it, the middle of the two's intersection: the model
    tightens the point, never the bound. The bound is the offset's distance to the hard
    interval's farther end, growing by ``|drift| + drift_ppm`` per ns away from its anchor.
    ``est`` as it is without exchanges.

    The anchor is ``x`` or the newest exchange's ack, whichever gives the smaller bound: a
    batch's rows were stamped between the two (an exporter carries only exchanges
    acknowledged before its first row was stamped), and the interval at any ``t`` lies in
    the one at the anchor widened by the drift over ``|t - anchor|``, so either holds for
    every row; from the ack, a row stamped early is not charged the drift of the way to ``x``
    and back.

    ``append``: ``(append time ns, partition)`` of the batch's own record. When it is on the
    exchanges' partition, the bound reaches down to :func:`own_floor` too (less the rows'
    ``stamps_ns``), where that is lower: a machine paused since the exchanges (its clocks
    stood still) lies below them, never below its own record's floor. The floor holds at
    ``x``; at an anchor before it, lower by the drift between the two. The point stays where
    the exchanges put it."""
    if clock is None or not clock.exchanges:
        return est
    exchanges = exchanges_of(clock.exchanges)
    if not exchanges:
        return est
    newest = max(exchanges, key=lambda e: e.sent_ns)
    floor = None
    if append is not None and newest.partition == append[1]:
        below = min(0, clock.stamps_ns[0]) if clock.stamps_ns else 0
        floor = own_floor(x, append[0]) + below
    best: tuple[int, int, int] | None = None
    for at in dict.fromkeys((x, min(x, newest.ack_ns))):
        got = _held(est, exchanges, at, x, floor, drift_ppm)
        if got is not None and (best is None or got[1] < best[1]):
            best = (got[0], got[1], at)
    if best is None:
        return est
    offset, error, at = best
    drift = min(max(est.drift_ppm, -drift_ppm), drift_ppm)
    return replace(
        est,
        offset_ns=offset,
        anchor_ns=at,
        drift_ppm=drift,
        error_ns=error,
        widened=None,
        basis="exchange",
        error_rate=abs(drift) * 1e-6 + drift_rate(drift_ppm),
    )


def _held(
    est: ClockEstimate,
    exchanges: list[Exchange],
    at: int,
    x: int,
    floor: int | None,
    drift_ppm: float,
) -> tuple[int, int] | None:
    """``(offset, error)`` at source time ``at`` (see :func:`bounded`); ``floor``: the
    record's own floor at ``x``, None when it does not apply."""
    hard = hard_interval(exchanges, at, drift_ppm)
    if hard is None:
        return None
    lo, hi, _ = hard
    low = lo
    if floor is not None:
        # the floor holds at x; at ``at`` the offset may lie lower by the drift between
        low = min(lo, floor - drift_allowance(x - at, drift_ppm))
    a, b = lo, hi
    if est is not UNKNOWN and 2 * est.error_ns < hi - lo:
        m = est.offset_at(at)
        a2, b2 = max(lo, m - est.error_ns), min(hi, m + est.error_ns)
        if a2 <= b2:
            a, b = a2, b2
    offset = (a + b) // 2
    # +1: the offset applied to a row is rounded to the ns
    return offset, max(offset - low, hi - offset) + 1


def align(ts_source: Array, estimate: ClockEstimate) -> tuple[Array, Array, int]:
    """Aligned timestamps for one batch: ``ts = ts_source - offset(ts_source)``, vectorized.

    Returns ``(ts, offset per row, error bound)``; int64 arrays of the input's length.
    """
    ts = pc.cast(ts_source, pa.int64())
    if estimate.drift_ppm == 0.0:
        off = pa.repeat(pa.scalar(estimate.offset_ns, pa.int64()), len(ts))
    else:
        dt = pc.cast(pc.subtract(ts, estimate.anchor_ns), pa.float64())
        corr = pc.round(pc.multiply(dt, estimate.drift_ppm * 1e-6))
        off = pc.add(pc.cast(corr, pa.int64()), estimate.offset_ns)
    return pc.subtract(ts, off), off, estimate.error_ns


def row_errors(ts_source: Array, anchor: Array, error: Array, rate: Array) -> Array:
    """Each row's bound: ``error + ceil(rate x |ts_source - anchor|)`` (int64), the per-row
    values of one or more estimates (:meth:`ClockEstimate.error_at`, vectorized; in numpy,
    ~10x cheaper than the same in Arrow kernels)."""
    d = np.abs(_np(ts_source) - _np(anchor)).astype(np.float64)
    d *= _np(rate)
    np.ceil(d, out=d)
    return pa.array(_np(error) + d.astype(np.int64))


def _np(a: Any) -> Any:
    return a.to_numpy() if isinstance(a, pa.ChunkedArray) else a.to_numpy(zero_copy_only=False)
