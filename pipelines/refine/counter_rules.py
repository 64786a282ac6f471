"""The counter rules of :mod:`pipelines.refine.counters` over rows sorted by (series, source
ts), in numpy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, column, true_mask


@dataclass
class Derived:
    """:func:`derive_sorted`'s result: per computed row (the sorted rows less the late
    ones, in that order) its delta, rate, whether they hold a value, reset flag and null
    reason code (None: no row has one)."""

    rows: pa.Table
    g: Any
    delta: Any
    rate: Any
    valid: Any
    reset: Any
    reason: Any
    late_pos: Any


def derive_sorted(s: pa.Table, st: pa.Table, sidx: Array, st_same: Array) -> Derived:
    """The module's rules over the counter rows sorted by (series, source ts) (``s``: pos,
    g, sid, ts, src, raw, max, sat, scale, none NULL), each row's state row ``sidx`` (NULL for
    a new series) and whether each state row's boot is its stream's now (``st_same``): in
    numpy, one array operation per step, uint64 arithmetic wrapping mod 2**64 as Arrow's."""
    attrs = [column(s, c) for c in ("ts", "max", "sat", "scale")]
    if any(a.null_count for a in attrs):  # validated counter rows have none: no reading
        ok = true_mask(pc.and_(pc.and_(*(pc.is_valid(a) for a in attrs[:2])),
                               pc.and_(*(pc.is_valid(a) for a in attrs[2:]))))  # fmt: skip
        s, sidx = s.filter(ok), sidx.filter(ok)
    g, ts, src = (column(s, c).to_numpy() for c in ("g", "ts", "src"))
    cur, mx, scale = (column(s, c).to_numpy() for c in ("raw", "max", "scale"))
    sat = column(s, "sat").to_numpy(zero_copy_only=False)
    m = len(g)
    if sidx.null_count:
        has_st = sidx.is_valid().to_numpy(zero_copy_only=False)
        si = sidx.fill_null(0).to_numpy()
    else:
        has_st = np.ones(m, dtype=bool)
        si = sidx.to_numpy()
    if st.num_rows:
        kept = [column(st, c) for c in ("raw", "ts", "src")]
        if any(a.null_count for a in kept):  # a state row without a reading is no state
            ok = true_mask(
                pc.and_(pc.and_(*(pc.is_valid(a) for a in kept[:2])), pc.is_valid(kept[2]))
            )
            has_st &= ok.to_numpy(zero_copy_only=False)[si]
            kept = [a.fill_null(0) for a in kept]
        st_raw, st_ts, st_src = (a.to_numpy()[si] for a in kept)
        same_boot = has_st & st_same.to_numpy(zero_copy_only=False)[si]
    else:
        st_raw = np.zeros(m, dtype=np.uint64)
        st_ts = st_src = np.zeros(m, dtype=np.int64)
        same_boot = np.zeros(m, dtype=bool)
    same_g = np.zeros(m, dtype=bool)
    same_g[1:] = g[1:] == g[:-1]
    dup_ts = same_g.copy()
    dup_ts[1:] &= src[1:] == src[:-1]
    # out of order: not after the last accepted reading on the source's clock *and* on the
    # common one (either alone moves when a clock is stepped or its estimate is revised)
    late = dup_ts | (same_boot & (src <= st_src) & (ts <= st_ts))
    late_pos = column(s, "pos").to_numpy()[late]
    if late_pos.size:
        good = ~late
        s = s.filter(pa.array(good))
        g, ts, src, cur, mx, scale, sat = (a[good] for a in (g, ts, src, cur, mx, scale, sat))
        st_raw, st_ts, st_src = st_raw[good], st_ts[good], st_src[good]
        has_st, same_boot = has_st[good], same_boot[good]
        m = len(g)
    gstart = np.ones(m, dtype=bool)
    gstart[1:] = g[1:] != g[:-1]

    def before(a: Any, first: Any) -> Any:  # the row before's value, ``first``'s at a start
        out = np.empty_like(a)
        out[1:] = a[:-1]
        return np.where(gstart, first, out)

    has_prev = ~gstart | has_st
    prev_raw, prev_src = before(cur, st_raw), before(src, st_src)
    boot_change = gstart & ~same_boot
    # the interval on the source's own clock (it stamped both readings); none (NaN: the
    # rate NULL) where it went backwards, a step (see the module's docstring)
    d_src = src - prev_src
    elapsed = np.where(d_src > 0, d_src, 0).astype(np.float64)
    elapsed[d_src <= 0] = np.nan
    d = (cur - prev_raw) & mx  # uint64 wraps mod 2**64
    wrap_ok = ~sat & (d <= (mx >> np.uint64(1)))
    reset = has_prev & (boot_change | ((cur < prev_raw) & ~wrap_ok))
    saturated = sat & (cur == mx)
    valid = ~(reset | ~has_prev | saturated)
    with np.errstate(divide="ignore", invalid="ignore"):
        delta = d.astype(np.float64) * scale
        rate = delta / (elapsed / 1e9)
    reason = None
    if reset.any() or saturated.any() or not has_prev.all():
        # codes into REASONS (reset, saturated, first sample); -1: none
        reason = np.where(reset, 0, np.where(saturated, 1, np.where(has_prev, -1, 2)))
        reason = reason.astype(np.int8)
    return Derived(s, g, delta, rate, valid, reset, reason, late_pos)
