"""The upper convex hull of a clock's (x = sent, y = sent - arrival) points and the
statistics read off it: slopes at given x, the points' distances below a line or below the
hull (see :mod:`pipelines.refine.clock` for the method)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np


def gap_stats(
    pts: deque[tuple[int, int]], a: float, b: float, xa: int, xy: Any = None
) -> tuple[float, float, float]:
    """The points' distances below the line ``a + b·(x - xa)``: (the ``n//8``-th smallest,
    the ``n//2``-th, the largest). In numpy, with the very floats Python computes
    ``a + b * (x - xa) - y`` to (int64 → float64 rounds as ``int * float`` does); in Python
    for a few points (cheaper there) and for coordinates past int64. The points are sorted
    by x; ``xy``: they as an (n, 2) int64 array, when the caller keeps them so."""
    n = len(pts)
    if n < 48 or pts[-1][0] - pts[0][0] >= 1 << 62:
        xy = None
    elif xy is None:
        with contextlib.suppress(OverflowError):
            xy = np.fromiter(itertools.chain.from_iterable(pts), np.int64, 2 * n).reshape(n, 2)
    if xy is None:
        gaps = sorted(a + b * (p[0] - xa) - p[1] for p in pts)
        return gaps[n // 8], gaps[n // 2], gaps[-1]
    g = a + b * (xy[:, 0] - xa) - xy[:, 1]
    part = np.partition(g, [n // 8, n // 2, n - 1])
    return float(part[n // 8]), float(part[n // 2]), float(part[n - 1])


def sorted_gaps(
    pts: deque[tuple[int, int]], a: float, b: float, xa: int, xy: Any = None
) -> list[float]:
    """All the points' distances below the line ``a + b·(x - xa)``, sorted: the floats
    :func:`gap_stats` computes (in numpy for the same points it takes there)."""
    if len(pts) < 48 or pts[-1][0] - pts[0][0] >= 1 << 62:
        xy = None
    elif xy is None:
        with contextlib.suppress(OverflowError):
            n = len(pts)
            xy = np.fromiter(itertools.chain.from_iterable(pts), np.int64, 2 * n).reshape(n, 2)
    if xy is None:
        return sorted(a + b * (p[0] - xa) - p[1] for p in pts)
    g = a + b * (xy[:, 0] - xa) - xy[:, 1]
    g.sort()
    out: list[float] = g.tolist()
    return out


def move_gaps(
    gaps: list[float], moves: list[tuple[bool, tuple[int, int]]], a: float, b: float, xa: int
) -> bool:
    """Move the sorted ``gaps`` (below ``a + b·(x - xa)``) by ``moves``: a point added
    (True) or dropped (False), in order. False when a dropped point's gap is not among them
    (``gaps`` is then to be taken anew)."""
    for added, p in moves:
        g = a + b * (p[0] - xa) - p[1]
        if added:
            bisect.insort(gaps, g)
            continue
        i = bisect.bisect_left(gaps, g)
        if i == len(gaps) or gaps[i] != g:
            return False
        del gaps[i]
    return True


def hull_scatter(hull: list[tuple[int, int]], pts: deque[tuple[int, int]], xy: Any) -> float:
    """The median distance of the points below their hull (not below one line: a bent
    envelope does not inflate it). ``xy``: the points as an (n, 2) int64 array, or None."""
    n = len(pts)
    if xy is None:  # few points, or past int64: floats (256 ns apart at today's epoch ns)
        xy = np.fromiter(itertools.chain.from_iterable(pts), np.float64, 2 * n).reshape(n, 2)
    x0 = hull[0][0]
    # x relative to the hull's start, subtracted before any float: exact to the ns
    hx = np.array([p[0] - x0 for p in hull], dtype=np.float64)
    hy = np.array([p[1] for p in hull], dtype=np.float64)
    g = np.interp(xy[:, 0] - x0, hx, hy) - xy[:, 1]
    return float(np.partition(g, n // 2)[n // 2])


# (fewest points, div, k) of the bend checks (see pipelines.refine.clock): ``k`` set so
# that sources of steady drift and Exp(1-5 ms) delays keep their bounds (the p99 over 60 of
# them, 300 batches each, unchanged)
BENDS = ((32, 4, 8.0), (96, 8, 16.0))
SCATTER_EVERY = 8


def slope_at(hull: list[tuple[int, int]], x: float) -> float | None:
    """The slope of the hull's first edge spanning ``x`` (None when none does)."""
    return slopes_at(hull, [x])[0]


def slopes_at(hull: list[tuple[int, int]], xs: list[Any]) -> list[float | None]:
    """:func:`slope_at` of each of ``xs`` (in increasing order), in one walk: an edge that
    ends left of ``x`` (or is vertical) spans no later ``x`` either."""
    out: list[float | None] = []
    edges = itertools.pairwise(hull)
    edge = next(edges, None)
    for x in xs:
        while edge is not None and (edge[1][0] < x or edge[1][0] == edge[0][0]):
            edge = next(edges, None)
        if edge is None or edge[0][0] > x:
            out.append(None)
        else:
            (px, py), (qx, qy) = edge
            out.append((qy - py) / (qx - px))
    return out


def upper_hull(pts: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Upper convex hull (left to right) of points sorted by x; exact integer arithmetic."""
    hull: list[tuple[int, int]] = []
    for p in pts:
        hull_push(hull, p)
    return hull


# a run of the points at one x: (how many, its first point, its last, its last highest)
Run = tuple[int, tuple[int, int], tuple[int, int], tuple[int, int]]


def runs_of(pts: deque[tuple[int, int]]) -> deque[Run]:
    """The runs of points sorted by x (see :func:`run_push`)."""
    runs: deque[Run] = deque()
    for p in pts:
        run_push(runs, p)
    return runs


def run_push(runs: deque[Run], p: tuple[int, int]) -> None:
    """``p`` (at or right of the last run's x) joins the runs."""
    if runs and runs[-1][2][0] == p[0]:
        n, first, _, top = runs[-1]
        runs[-1] = (n + 1, first, p, p if p[1] >= top[1] else top)
    else:
        runs.append((1, p, p, p))


def run_drop_first(runs: deque[Run], gone: tuple[int, int], points: deque[tuple[int, int]]) -> bool:
    """The first point ``gone`` left (``points``: the points now, without it); False when it
    was not the first run's first (the runs are then to be taken anew). When ``gone`` was
    the first run's last highest point, the run's rest is read again for its highest."""
    n, first, last, top = runs[0]
    if first is not gone:
        return False
    if n == 1:
        runs.popleft()
        return True
    if top is gone:
        top = points[0]
        for p in itertools.islice(points, 1, n - 1):
            if p[1] >= top[1]:
                top = p
    runs[0] = (n - 1, points[0], last, top)
    return True


def run_points(runs: deque[Run]) -> list[tuple[int, int]]:
    """The points whose :func:`upper_hull` is that of all the points of ``runs``, vertex
    for vertex (the same tuples): each run's last highest point (:func:`hull_push` leaves
    no other point of a run on the hull). A burst of one-metric messages (many points at one
    send time) is one point here."""
    return [r[3] for r in runs]


def hull_without_first(
    hull: list[tuple[int, int]], pts: deque[tuple[int, int]]
) -> list[tuple[int, int]]:
    """:func:`upper_hull` of ``pts``, given ``hull``: that of ``pts`` with one more point
    before them (the hull's first vertex; vertices are the points' own tuples). The chain is
    run again from the left only until its stack is known to agree with the old run from
    then on: at a vertex ``h`` of the old hull that it holds on top, when the point below it
    keeps ``h`` from being popped by every later point that the old run's vertex below ``h``
    kept it from (see :func:`_kept_alike`); the old vertices after ``h`` follow unchanged.
    Of a burst sent at one time only its last highest point is a vertex (:func:`hull_push`)."""
    alone = len(pts) < 2 or pts[1][0] != pts[0][0]  # else a later point at its x is the vertex
    if len(hull) > 1 and alone and _on_first_edge(pts[0], hull[0], hull[1]):
        return [pts[0], *hull[1:]]
    left: list[tuple[int, int]] = []
    j = 1
    hj = hull[j] if len(hull) > 1 else None
    for p in pts:
        hull_push(left, p)
        if p is hj:
            if _kept_alike(left, hull[j - 1], hull[j + 1] if j + 1 < len(hull) else None):
                return left + hull[j + 1 :]
            j += 1
            hj = hull[j] if j < len(hull) else None
    return left


def _on_first_edge(p: tuple[int, int], h0: tuple[int, int], h1: tuple[int, int]) -> bool:
    """Whether the new first point ``p`` lies on the old first edge ``h0→h1``, left of
    ``h1`` (a point sent at the time of the one that left, with its delay: a burst; or
    further on the line): the points up to ``h1`` lay on or below that edge, so they lie
    on or below ``p→h1`` and the chain from ``p`` meets ``h1`` as the old one did."""
    return p[0] < h1[0] and (h1[0] - h0[0]) * (p[1] - h0[1]) == (h1[1] - h0[1]) * (p[0] - h0[0])


def _kept_alike(
    left: list[tuple[int, int]], o: tuple[int, int], nxt: tuple[int, int] | None
) -> bool:
    """Whether every later point that the old run tried against ``h = left[-1]`` (from
    above ``o``; ``h`` stayed to the end, followed by ``nxt``) leaves it from above
    ``left[-2]`` too."""
    if len(left) < 2:
        return True  # h is the bottom: never popped
    h, q = left[-1], left[-2]
    if (
        q[0] < h[0]
        and nxt is not None
        and nxt[0] > h[0]
        and (h[0] - q[0]) * (nxt[1] - q[1]) - (h[1] - q[1]) * (nxt[0] - q[0]) < 0
    ):
        # the points tried against h lie under h at its x or on or below the edge h→nxt:
        # strictly below the line q→h when nxt is
        return True
    if o[0] < h[0]:
        # later points lie right of h, below the line o→h (or under h at h's x): also below
        # the line q→h when q lies left of h, on or below the line o→h
        return q[0] < h[0] and (h[0] - o[0]) * (q[1] - o[1]) - (h[1] - o[1]) * (q[0] - o[0]) <= 0
    # o under h at one x (the hull's start): later points lie right of h; q at h's x too
    return q[0] == h[0] and q[1] < h[1]


def hull_push(hull: list[tuple[int, int]], p: tuple[int, int]) -> None:
    """One step of the monotone chain: ``p`` (at or right of the hull's last x) joins it.

    Of points at one x only the highest can be a vertex of the upper hull (the last of the
    highest: a later one at or above the last vertex replaces it; one below it is left out).
    The cross product of points at one x is 0, so the plain chain kept the first and the last
    of a burst at its bottom, whatever their heights: a burst at the window's left end whose
    highest point came neither first nor last left the hull below that point (issue #42)."""
    if hull and hull[-1][0] == p[0]:
        if p[1] < hull[-1][1]:
            return
        hull.pop()
    while len(hull) >= 2:
        o, a = hull[-2], hull[-1]
        if (a[0] - o[0]) * (p[1] - o[1]) - (a[1] - o[1]) * (p[0] - o[0]) >= 0:
            hull.pop()
        else:
            break
    hull.append(p)
