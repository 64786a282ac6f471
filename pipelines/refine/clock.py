"""Per-source clock offset and drift from (source ``sent_ns``, broker LogAppendTime) pairs.

Convention (as in :data:`schemas.records.REFINED_SCHEMA`): ``offset = source clock - common
clock``, and ``ts = ts_source - offset``.

For each batch the broker stamps arrival ``A = sent_true + delay`` on the common clock while
the source stamped ``S = sent_true + offset``. So ``y = S - A = offset - delay``: every point
lies *below* the line ``offset(t) - d_min`` and the points with the least delay touch it.

Method (Moon-Skelly-Towsley 1999 linear programming, equivalently the upper convex hull of
Zhang-Liu-Xia 2002; see DATA-NOTES §5.4):

1. keep the last ``window`` points ``(x = S, y = S - A)`` since the last clock step;
2. fit the line ``a + b·x`` that lies on or above every point and is lowest at the mean
   ``x̄``: it is the edge of the upper convex hull spanning ``x̄``. This is the minimum-delay
   filter and the drift fit at once: queued (delayed) points never touch the hull;
3. ``offset(t) = a + b·t + assumed_min_delay``. The minimum one-way delay cannot be observed
   from one-way stamps (it is confounded with the offset), so a fixed estimate is added:
   1.1 ms, the middle of the 0.2-2 ms base delays of a datacenter producer → broker path; its
   half range (0.9 ms) is part of the error bound;
4. drift ``b`` is clamped to ±``max_drift_ppm``; with fewer than ``min_fit_points`` points
   the drift is taken as 0 and the line passes through the highest point.

Error bound: ``delay_uncertainty + 1.5 x envelope thickness`` (the ``1/8`` quantile of the
points' distances below the line: how well the minimum delay is pinned down), plus
``max_drift x span + initial_error`` before the fit has ``min_fit_points`` (at start and
after a step, a few points say nothing about their delays).

The bound above trusts the points' minimum delay to stay put over the window: the line's
slope is then the drift. Delays whose lower envelope rises or falls (a host or a link loaded
more and more: every send queued longer than the one before) tilt the line the same way, and
one-way stamps cannot tell the two apart. Oscillators do not drift by more than
``plausible_drift_ppm`` (200 ppm; real ones by tens): when the hull's slope at ``x̄`` is
steeper than that by more than the points' scatter explains (``2 x median gap / span``),
the tilt is taken as a delay trend, and only "some point of the window had a nominal delay"
is assumed. From such a point ``i`` the error at ``x`` is at most ``gap_i + |b - drift| x
|x - x_i|``, so the bound grows by ``largest gap + (|b| + plausible) x window span``.

A trend that began or ended within the window bends the hull instead. Drift is one slope
over minutes, so when the hull's slope at the first quarter of the span exceeds its slope at
the third quarter by more than ``8 x scatter / span`` (with ``32`` points or more; the
scatter is the points' median distance below the hull, which a bend does not inflate), or
at the first and last eighth by more than ``16 x scatter / span`` (with ``96`` or more: a
trend that began near the window's left end), the bound grows by ``largest gap + that
difference x span``. A steady delay trend slower than the plausible drift and older than the
window stays unseen.

Steps: a point more than ``step_threshold`` *above* the line cannot be explained by delay,
so the offset jumped up: restart the window at that point. ``step_confirm`` consecutive
points more than the threshold *below* the line mean it jumped down: restart with them
(until confirmed, such a point's error bound is widened to its distance below the line, so
a backward step is never reported with a tight bound). A confirmed step down looks the same
as delays that grew by as much: the bound keeps the step's size until
``min_converged_points`` points followed it, and for as long as the slope fitted since
differs from the one before it by more than the scatter explains (a clock that stepped keeps
its drift; delays that go on growing do not), by that difference x span as well. The
threshold is ``max(step_threshold_ns, 10 x median distance below the line)`` so heavy jitter
does not fake steps. Steps are looked for once the window has ``min_fit_points`` points (before
that, a point above the line is as likely the first low-delay point as a step).

Cross-check: when the source's :class:`~schemas.wire.ClockBlock` reports an offset, a
difference larger than both error bounds together is reported as ``disagreement_ns`` and
widens the error to cover it.

Convergence: ``converged`` once ``min_converged_points`` points (default 16, i.e. 16 s at one
batch per second) have been seen since the start or the last step.

State is bounded: ``window`` points plus a few step candidates.
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pipelines.refine._packed import PackedRows
from pipelines.refine.clock_bounds import exchanges_of, hard_interval
from pipelines.refine.clock_declared import DECLARED_POINTS, declared_estimate
from pipelines.refine.clock_hull import (
    BENDS,
    SCATTER_EVERY,
    Run,
    hull_push,
    hull_scatter,
    hull_without_first,
    move_gaps,
    run_drop_first,
    run_points,
    run_push,
    runs_of,
    slope_at,
    slopes_at,
    sorted_gaps,
    upper_hull,
)
from pipelines.refine.clock_model import (
    UNKNOWN,
    ClockEstimate,
    ClockSettings,
    DeclaredTiming,
    align,
    bounded,
    row_errors,
)
from schemas.wire import ClockBlock

# the model and its application live in clock_model; importers may take them from here
__all__ = [
    "UNKNOWN",
    "ClockEstimate",
    "ClockEstimator",
    "ClockSettings",
    "DeclaredTiming",
    "align",
    "bounded",
    "row_errors",
]

_EXCESS_KEPT = 32
# how many of a source's last points bound a declared send delay (:meth:`_declared`)
_DECLARED_POINTS = DECLARED_POINTS


@dataclass
class ClockEstimator:
    """Clock model of one source (keyed by ``node|exporter|instance``)."""

    settings: ClockSettings = field(default_factory=ClockSettings)
    points: deque[tuple[int, int]] = field(default_factory=deque)
    candidates: list[tuple[int, int]] = field(default_factory=list)
    since_step: int = 0
    # how far the last confirmed step went down (0 after a step up), and the drift fitted
    # before it: it may as well have been a delay episode (see the module's docstring)
    back_step_ns: int = 0
    back_step_drift: float = 0.0
    # the points' median distance below the hull, and ``since_step`` when it was measured:
    # measured anew every ``SCATTER_EVERY`` points (it moves slowly; ~95 k instructions)
    scatter: tuple[int, float] | None = None
    last: ClockEstimate = UNKNOWN
    # how far the model's offset may have been beyond its own bound, as the exchanges of the
    # last batches that carried any proved it (the far end of their hard interval): added to
    # the bound of a batch that carries none (a loaded host's minimum delay breaks the model's
    # assumed 0.2-2 ms; the bound widens rather than lie)
    excess: deque[int] = field(default_factory=lambda: deque(maxlen=_EXCESS_KEPT))
    _fit: tuple[float, float, int, float] | None = None  # a, b, xa, median gap
    # the declared estimate of the last send and its (x, timing): its other records get it
    # (the walk over the last points is most of a one-metric record's clock cost). Not state
    _declared_memo: tuple[tuple[int, DeclaredTiming], ClockEstimate] | None = field(
        default=None, repr=False, compare=False
    )
    # caches of ``points``, kept up to date as points come and go (None: rebuilt from the
    # points when next needed); not state. The hull of a full window was rebuilt per batch
    # before: ~170 µs of the ~230 µs an estimate took with 256 points.
    _hull: list[tuple[int, int]] | None = field(default=None, repr=False, compare=False)
    _xsum: int | None = field(default=None, repr=False, compare=False)
    # neighbouring points whose x decreases (a restart keeps its step candidates in arrival
    # order): the hull is not kept up to date while there are any. Equal x (a burst sent at
    # one time) keeps it: of a burst only its last highest point is a vertex.
    _unordered: int | None = field(default=None, repr=False, compare=False)
    # the points packed as int64 pairs (points come at the right and leave at the left): for
    # the gap statistics and the checkpoint, packed anew only when the points were replaced
    # (a full window took ~25-60 µs each time)
    _pack: PackedRows = field(
        default_factory=lambda: PackedRows(2), init=False, repr=False, compare=False
    )
    # the points' distances below the line ``_gap_key`` (a, b, xa), sorted, and the points
    # added (True) and dropped (False) since: under an unchanged line (most records of a
    # burst of one-metric messages) the gap statistics move by those points instead of
    # being taken over the whole window (~10 µs a record). None: taken anew.
    # the points' runs at one x (sorted points only; None: taken anew when needed): the hull
    # is rebuilt from a run's one or two points that matter (:func:`run_points`) when many
    # points share their x (a burst of one-metric messages keeps :func:`hull_without_first`
    # from stopping early: ~120 chain steps a record)
    _runs: deque[Run] | None = field(default=None, repr=False, compare=False)
    _gap_key: tuple[float, float, int] | None = field(default=None, repr=False, compare=False)
    _gaps: list[float] = field(default_factory=list, repr=False, compare=False)
    _gap_moves: list[tuple[bool, tuple[int, int]]] = field(
        default_factory=list, repr=False, compare=False
    )

    def observe(
        self,
        sent_ns: int,
        arrival_ns: int | None,
        clock: ClockBlock | None = None,
        partition: int | None = None,
        declared: DeclaredTiming | None = None,
    ) -> ClockEstimate:
        """Add one (source send time, broker append time) pair; returns the new estimate,
        bounded by the clock block's exchanges when it carries any (see :func:`bounded`).
        ``arrival_ns`` None: the record's timestamp is no append time (a CreateTime topic);
        it adds no point. ``partition``: the record's (its append time then also bounds the
        offset from below, see :func:`bounded`). ``declared``: what its topic declares of a
        producer without exchanges (see :meth:`_declared`). O(window) Python work per call,
        once per batch."""
        drift = self.settings.exchange_drift_ppm
        if arrival_ns is None:
            est = bounded(self.last, int(sent_ns), clock, drift)
            return est if est.basis == "exchange" else replace(est, basis="create_time")
        exchanges = clock is not None and bool(clock.exchanges)
        again = not exchanges and self._again(int(sent_ns), int(sent_ns) - int(arrival_ns))
        if again:
            # the newest point again: records of one send (one-metric messages of one flush,
            # as Telegraf and collectd send them, stamped and appended alike) are one
            # observation of the clock. Each one more point would crowd the window and count
            # once more toward confirming a step that one late send suggests; a step the
            # first found is not found again
            self.last = replace(self.last, step=False) if self.last.step else self.last
        else:
            self.last = self._observe(sent_ns, arrival_ns, clock)
        if declared is not None and not exchanges:
            memo = self._declared_memo
            if again and memo is not None and memo[0] == (int(sent_ns), declared):
                return memo[1]  # the state is that of the first of the send's records
            est = self._declared(int(sent_ns), declared)
            self._declared_memo = ((int(sent_ns), declared), est)
            return est
        self._declared_memo = None
        append = (int(arrival_ns), partition) if partition is not None else None
        est = bounded(self.last, int(sent_ns), clock, drift, append)
        if est.basis == "exchange" and clock is not None and clock.exchanges:
            self._calibrate(int(sent_ns), clock)
        elif self.excess:
            est = replace(est, error_ns=est.error_ns + max(self.excess))
        return est

    def _again(self, x: int, y: int) -> bool:
        """Whether ``(x, y)`` is the window's newest point (and there is an estimate)."""
        return bool(self.points) and self.points[-1] == (x, y) and self.last is not UNKNOWN

    def _declared(self, x: int, declared: DeclaredTiming) -> ClockEstimate:
        """The estimate of a producer without exchanges whose topic declares its send delay
        (:func:`pipelines.refine.clock_declared.declared_estimate`)."""
        drift = self.settings.exchange_drift_ppm
        return declared_estimate(self.points, self.last, x, declared, drift)

    def _calibrate(self, x: int, clock: ClockBlock) -> None:
        """Keep how far the model's offset at ``x`` may lie beyond its bound: its distance
        to the far end of the exchanges' hard interval, less its own bound."""
        hard = hard_interval(
            exchanges_of(clock.exchanges or []), x, self.settings.exchange_drift_ppm
        )
        if hard is None or self.last is UNKNOWN:
            return
        m = self.last.offset_at(x)
        self.excess.append(max(0, max(m - hard[0], hard[1] - m) - self.last.error_ns))

    def _observe(self, sent_ns: int, arrival_ns: int, clock: ClockBlock | None) -> ClockEstimate:
        s = self.settings
        x, y = int(sent_ns), int(sent_ns) - int(arrival_ns)
        step = False
        suspect = 0  # how far below the line an unconfirmed step candidate lies
        if len(self.points) >= s.min_fit_points and self._fit is not None:
            a, b, xa, median_gap = self._fit
            gap = a + b * (x - xa) - y  # distance below the line (negative: above)
            thresh = max(s.step_threshold_ns, 10 * median_gap)
            if gap < -thresh:
                step = True
                self._restart([])
            elif gap > thresh:
                self.candidates.append((x, y))
                if len(self.candidates) >= s.step_confirm:
                    step = True
                    self._restart(self.candidates[:-1])
                    self.back_step_ns, self.back_step_drift = round(gap), b
                else:
                    suspect = round(gap)
            else:
                self.candidates.clear()
        if x < (self.points[-1][0] if self.points else x):
            self.points = deque(sorted([*self.points, (x, y)]), maxlen=None)
            self._hull = self._xsum = self._unordered = self._gap_key = self._runs = None
            self._pack.invalidate()
        else:
            p = (x, y)
            self.points.append(p)
            self._pack.append(p)
            if self._runs is not None:
                run_push(self._runs, p)
            if self._gap_key is not None:
                self._gap_moves.append((True, p))
            if self._hull is not None:
                hull_push(self._hull, p)
            if self._xsum is not None:
                self._xsum += x
        while len(self.points) > s.window:
            self._drop_first(self.points.popleft())
        self.since_step += 1
        est = self._estimate(x, step, clock)
        if suspect:
            # Either a long delay (the line is right) or the clock stepped back by up to
            # ``suspect`` (not confirmed yet): the bound must cover both until we know.
            est = replace(est, error_ns=max(est.error_ns, suspect))
        return est

    def estimate(self) -> ClockEstimate:
        return self.last

    def _restart(self, keep: list[tuple[int, int]]) -> None:
        self.points = deque(keep)
        self.candidates = []
        self.since_step = len(keep)
        self.back_step_ns = 0
        self.scatter = None
        self._fit = None
        self._hull = self._xsum = self._unordered = self._gap_key = self._runs = None
        self._pack.invalidate()

    def _drop_first(self, gone: tuple[int, int]) -> None:
        """Update the caches for the first point leaving the window (the hull's first
        vertex: the chain never pops its bottom); the hull is rebuilt from the left only as
        far as it changes (see :func:`hull_without_first`)."""
        if self._xsum is not None:
            self._xsum -= gone[0]
        self._pack.drop_first()
        if self._gap_key is not None:
            self._gap_moves.append((False, gone))
        if self._unordered is not None and self.points and self.points[0][0] < gone[0]:
            self._unordered -= 1
        runs = self._runs
        if runs is not None and not (self.points and run_drop_first(runs, gone, self.points)):
            runs = self._runs = None
        hull, self._hull = self._hull, None
        if hull is not None and hull[0] is gone and self.points:
            if runs is not None and 4 * len(runs) <= len(self.points):
                self._hull = upper_hull(run_points(runs))
            else:
                self._hull = hull_without_first(hull, self.points)

    def _hull_now(self) -> list[tuple[int, int]]:
        if self._hull is not None:
            return self._hull
        if self._unordered is None:
            pairs = itertools.pairwise(self.points)
            self._unordered = sum(p[0] > q[0] for p, q in pairs)
        if self._unordered:
            return upper_hull(self.points)
        if self._runs is None:
            self._runs = runs_of(self.points)
        self._hull = upper_hull(run_points(self._runs)) if self._runs else []
        return self._hull

    def _xbar(self) -> float:
        if self._xsum is None:
            self._xsum = sum(p[0] for p in self.points)
        return self._xsum / len(self.points)

    def _line(self) -> tuple[float, float, int, float]:
        """``(a, b, xa, slope)``: the fitted ``y ≈ a + b·(x - xa)`` (upper envelope), and
        the hull's slope at ``x̄`` before ``b`` was clamped to ``max_drift_ppm``."""
        pts = self.points
        s = self.settings
        xa = pts[0][0]
        if len(pts) < s.min_fit_points:
            top = max(pts, key=lambda p: p[1])
            return float(top[1]), 0.0, top[0], 0.0
        hull = self._hull_now()
        b = slope = slope_at(hull, self._xbar()) or 0.0
        bmax = s.max_drift_ppm * 1e-6
        b = min(max(b, -bmax), bmax)
        # the line of slope b touching the hull from above
        a = max(p[1] - b * (p[0] - xa) for p in hull)
        return a, b, xa, slope

    def _estimate(self, x: int, step: bool, clock: ClockBlock | None) -> ClockEstimate:
        s = self.settings
        a, b, xa, slope = self._line()
        pts = self.points
        eighth, median, top = self._gap_stats(a, b, xa)
        self._fit = (a, b, xa, median)
        error = s.delay_uncertainty_ns + 1.5 * eighth
        span_ns = pts[-1][0] - pts[0][0]
        span = max(span_ns, 1)
        widened = None
        if len(pts) < s.min_fit_points:
            error += s.max_drift_ppm * 1e-6 * span_ns + top
            error += s.initial_error_ns
        elif abs(slope) - 2 * median / span > s.plausible_drift_ppm * 1e-6:
            # The envelope's slope is no oscillator's, by more than the points' scatter
            # explains (two points half the span apart, each off by a median gap): the
            # delays' lower envelope moved. Only "some point of the window had a nominal
            # delay" is left: from any point i, |error| <= gap_i + |b - drift| x |x - x_i|.
            error += top + (abs(b) + s.plausible_drift_ppm * 1e-6) * span
            widened = "delay_trend"
        else:
            bend = self._bend(pts, span_ns, top)
            if bend:
                error += bend
                widened = "bend"
        offset = round(a + b * (x - xa)) + s.assumed_min_delay_ns
        disagreement = None
        if clock is not None and clock.offset_ns is not None:
            diff = clock.offset_ns - offset
            if abs(diff) > error + (clock.error_bound_ns or 0):
                disagreement = diff
                error = max(error, abs(diff) + (clock.error_bound_ns or 0))
        if self.back_step_ns and len(pts) >= s.min_fit_points:
            # a clock that stepped keeps its drift; delays that kept growing do not
            turn = abs(b - self.back_step_drift)
            turn = turn if turn * span > 2 * median else 0.0  # more than scatter
            if turn or self.since_step < s.min_converged_points:
                error += self.back_step_ns + turn * span
                widened = widened or "step_down"
        elif self.back_step_ns:
            error += self.back_step_ns
            widened = widened or "step_down"
        return ClockEstimate(
            offset_ns=offset,
            anchor_ns=x,
            drift_ppm=b * 1e6,
            error_ns=round(error),
            points=len(pts),
            converged=self.since_step >= s.min_converged_points,
            step=step,
            disagreement_ns=disagreement,
            widened=widened,
        )

    def _bend(self, pts: deque[tuple[int, int]], span_ns: int, top: float) -> float:
        """What a bent hull adds to the error bound: ``largest gap + bend x span`` when the
        hull's slope at a fraction ``1/div`` of the span exceeds its slope at ``1 - 1/div``
        by more than ``k x scatter / span`` (see :data:`BENDS`), else 0."""
        hull = self._hull_now()
        checks = [c for c in BENDS if len(pts) >= c[0]]
        at = sorted(pts[0][0] + m * span_ns // div for _, div, _ in checks for m in (1, div - 1))
        slope = dict(zip(at, slopes_at(hull, at), strict=True))
        scatter = None
        for _, div, k in checks:
            left = slope[pts[0][0] + span_ns // div]
            right = slope[pts[0][0] + (div - 1) * span_ns // div]
            if left is None or right is None or left == right:
                continue
            if scatter is None:
                scatter = self._scatter(hull, pts)
            if (left - right) * span_ns > k * scatter:
                return top + (left - right) * span_ns
        return 0.0

    def _scatter(self, hull: list[tuple[int, int]], pts: deque[tuple[int, int]]) -> float:
        kept = self.scatter
        if kept is None or not 0 <= self.since_step - kept[0] < SCATTER_EVERY:
            kept = self.scatter = (self.since_step, hull_scatter(hull, pts, self._xy()))
        return kept[1]

    def _xy(self) -> Any:
        """The points as an (n, 2) int64 array when numpy pays off (48 points or more) and
        they fit int64, else None."""
        if len(self.points) < 48:
            return None
        packed = self.packed_points()
        return None if packed is None else np.frombuffer(packed, dtype="<i8").reshape(-1, 2)

    def _gap_stats(self, a: float, b: float, xa: int) -> tuple[float, float, float]:
        """:func:`gap_stats` of the points below ``a + b·(x - xa)``: from the sorted gaps
        kept under that very line, moved by the points added and dropped since (each gap
        is the float that :func:`gap_stats` computes for its point), else taken anew."""
        key = (a, b, xa)
        gaps, moves = self._gaps, self._gap_moves
        n = len(self.points)
        if not (self._gap_key == key and move_gaps(gaps, moves, a, b, xa) and len(gaps) == n):
            gaps = self._gaps = sorted_gaps(self.points, a, b, xa, self._xy())
        self._gap_key = key
        moves.clear()
        return gaps[n // 8], gaps[n // 2], gaps[-1]

    def to_dict(self) -> dict[str, Any]:
        return self._doc([list(p) for p in self.points])

    def _doc(self, points: list[list[int]] | int) -> dict[str, Any]:
        return {
            "points": points,
            "candidates": [list(p) for p in self.candidates],
            "since_step": self.since_step,
            "back_step_ns": self.back_step_ns,
            "back_step_drift": self.back_step_drift,
            "scatter": list(self.scatter) if self.scatter is not None else None,
            "excess": list(self.excess),
        }

    def to_parts(self) -> tuple[dict[str, Any], bytes | None]:
        """:meth:`to_dict` with the window's points packed as little-endian int64 pairs
        instead (``"points"`` then holds their count): 256 points pack in ~23 µs where their
        JSON took ~145 µs, once per source per checkpoint. A coordinate past int64 keeps
        them in the dict (packed None). :meth:`from_dict` reads either."""
        packed = self.packed_points()
        if packed is None:
            return self.to_dict(), None
        return self._doc(len(self.points)), packed

    def packed_points(self) -> bytes | None:
        """The points as little-endian int64 pairs, in order (None when one is past int64):
        the last call's bytes less the points dropped since, plus those added."""
        return self._pack.get(lambda: self.points, len(self.points))

    @classmethod
    def from_dict(
        cls, doc: dict[str, Any], settings: ClockSettings | None = None, packed: bytes = b""
    ) -> ClockEstimator:
        """The estimator :meth:`to_dict` wrote, or :meth:`to_parts` with its ``packed``
        points."""
        est = cls(settings or ClockSettings())
        if isinstance(doc["points"], int):
            if len(packed) != 16 * doc["points"]:
                raise ValueError(f"{len(packed)} bytes for {doc['points']} clock points")
            flat = iter(struct.unpack(f"<{2 * doc['points']}q", packed))
            est.points = deque(zip(flat, flat, strict=True))
        else:
            est.points = deque((int(x), int(y)) for x, y in doc["points"])
        est.candidates = [(int(x), int(y)) for x, y in doc["candidates"]]
        est.since_step = int(doc["since_step"])
        est.back_step_ns = int(doc.get("back_step_ns", 0))
        est.back_step_drift = float(doc.get("back_step_drift", 0.0))
        if doc.get("scatter") is not None:
            est.scatter = (int(doc["scatter"][0]), float(doc["scatter"][1]))
        est.excess.extend(int(v) for v in doc.get("excess", []))
        if est.points:
            x = est.points[-1][0]
            est.last = est._estimate(x, False, None)
        return est
