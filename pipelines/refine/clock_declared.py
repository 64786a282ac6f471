"""The clock estimate of a producer without exchanges whose topic declares how long its rows
wait before their append (``send_delay``) and, optionally, how close its hosts keep their
clocks (``clock_error``): see docs/clock.md, "declared". Pure functions over an estimator's
points ``(x = S, y = S - A)``, newest last."""

from __future__ import annotations

import itertools
import math
from collections import deque

from pipelines.refine.clock_bounds import MS, STEP_TOL_NS, drift_rate
from pipelines.refine.clock_model import UNKNOWN, ClockEstimate, DeclaredTiming

# how many of a source's last points bound a declared send delay
DECLARED_POINTS = 32

Points = deque[tuple[int, int]]


def declared_estimate(
    points: Points, last: ClockEstimate, x: int, declared: DeclaredTiming, drift_ppm: float
) -> ClockEstimate:
    """The estimate of a producer without exchanges whose rows wait at most
    ``delay_max_ns`` between their stamp and their append (declared per topic: Telegraf
    stamps at collection and sends at its flush, seconds later; the Collector's batch
    processor holds rows for up to 200 ms). Each of the last points (``S``, ``S - A``)
    bounds the offset to ``[S - A - 1 ms, S - A + delay_max]``, widened by the drift
    since; they are intersected newest first. Where one does not meet the newer ones
    (a step of the source's clock, or a flush of rows older than declared: without
    exchanges the two look alike), the bound spans both. A declared clock error ``E``
    (the site's hosts within ``E`` of the broker) narrows it to ``[-E, E]`` where the
    two meet; where they do not, the declaration is proven false for this source and is
    left out (``widened`` "clock_error"). The point is the model's, held inside; the
    bound reaches the interval's farther end (``basis`` "declared")."""
    delay_max_ns = declared.send_delay_max_ns
    rate = drift_rate(drift_ppm)
    met = _meet(points, x, delay_max_ns, rate)
    lo, hi = met if met is not None else _walk(points, x, delay_max_ns, rate)
    widened = None
    e = declared.clock_error_ns
    if e is not None:
        if max(lo, -e) <= min(hi, e):
            lo, hi = max(lo, -e), min(hi, e)
        else:
            widened = "clock_error"
    model = last.offset_at(x) if last is not UNKNOWN else (lo + hi) // 2
    offset = min(max(model, lo), hi)
    error = max(offset - lo, hi - offset) + 1
    return ClockEstimate(offset, x, 0.0, error, last.points, last.converged, last.step,
                         last.disagreement_ns, widened, "declared", rate)  # fmt: skip


def _meet(points: Points, x: int, delay_max_ns: int, rate: float) -> tuple[int, int] | None:
    """The intersection of the last points' intervals (:func:`declared_estimate`) when it is not
    empty, else None. Then every interval meets those newer than it, so the walk of
    :func:`_walk` intersects them all without a break: this is its result.
    The points of one send time (a burst of one-metric messages) share their widening:
    it is computed once per send time, from their highest and lowest ``S - A``."""
    lo, hi = -(2**62), 2**62
    gx = None
    top = low = 0
    for px, py in itertools.islice(reversed(points), DECLARED_POINTS):
        if px == gx:
            if py > top:
                top = py
            elif py < low:
                low = py
            continue
        if gx is not None:
            w = STEP_TOL_NS + math.ceil(rate * abs(x - gx))
            lo, hi = max(lo, top - MS - w), min(hi, low + delay_max_ns + w)
        gx, top, low = px, py, py
    if gx is not None:
        w = STEP_TOL_NS + math.ceil(rate * abs(x - gx))
        lo, hi = max(lo, top - MS - w), min(hi, low + delay_max_ns + w)
    return (lo, hi) if lo <= hi else None


def _walk(points: Points, x: int, delay_max_ns: int, rate: float) -> tuple[int, int]:
    """The points' intervals intersected newest first; where one does not meet the
    newer ones a second run starts, and the bound spans the first two runs."""
    runs: list[tuple[int, int]] = []
    lo, hi = -(2**62), 2**62
    for px, py in itertools.islice(reversed(points), DECLARED_POINTS):
        w = STEP_TOL_NS + math.ceil(rate * abs(x - px))
        a, b = py - MS - w, py + delay_max_ns + w
        if a > hi or b < lo:
            runs.append((lo, hi))
            if len(runs) == 2:
                break
            lo, hi = a, b
        else:
            lo, hi = max(lo, a), min(hi, b)
    runs.append((lo, hi))
    return min(r[0] for r in runs[:2]), max(r[1] for r in runs[:2])
