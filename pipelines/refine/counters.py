"""Counters → deltas and per-second rates.

:func:`derive_rates` turns cumulative counter readings into ``delta`` (in the catalog unit)
and ``rate`` (per second of the *source's own clock*, which stamped both readings: a revised
clock-offset estimate between two batches must not stretch or squeeze the interval),
wrap- and reset-aware, with per-series state
held in a :class:`CounterState` (one per source stream ``node|exporter|instance``; its size
grows with the number of series of that source, never with samples).

Rules (``max = 2**width - 1``, ``d = (cur - prev) mod 2**width``):

- first sample of a series: ``delta`` NULL, ``null_reason = first_sample``.
- ``boot_id`` of the series changed since its last sample: ``reset``, ``delta`` NULL.
- ``cur >= prev``: ``delta = cur - prev``.
- ``cur < prev`` on a **wrap** counter: a wrap iff ``d <= max // 2`` (serial-number arithmetic,
  RFC 1982: the forward distance is the plausible one when it is under half the range), then
  ``delta = d``; otherwise a reset.
- ``cur < prev`` on a **saturate** counter: always a reset (they are cleared, never wrap).
- a saturate counter reading exactly ``max``: ``delta`` NULL, ``null_reason = saturated``.
- a reset sets ``reset = True``, ``delta`` NULL, ``null_reason = reset``.
- **out of order**: a sample not after the series' last accepted one (from state or earlier in
  the batch, equal timestamps included) on the source's clock *and* on the aligned clock gets
  ``late = True``, ``delta``/``rate`` NULL, and does not move the state back.
- a **clock step** back: where the source's clock went backwards while aligned time moved on,
  the delta holds but the ``rate`` is NULL. Neither clock gives the interval then: the
  source's was stepped, and the aligned one is only as good as the offsets estimated on both
  sides of the step (the model's first estimates after a step, or a replay faster than real
  time whose aligned clock is the broker's, squeeze it: a rate spike no link had). Rates are
  therefore never negative and never computed over an interval ``<= 0``.
- ``scale`` multiplies the delta (e.g. 4-byte words → bytes); ``value`` is scaled in validate.

Everything is vectorized: one sort of the batch's counter rows by (series, source ts), shifted
arrays for "previous", one ``index_in`` into the state table, one upsert of the state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, take, true_mask
from pipelines.refine.counter_order import SID, front_by_keys, front_from_layouts, remember
from pipelines.refine.counter_rules import Derived, derive_sorted
from pipelines.refine.counter_state import STATE_SCHEMA, CounterLayout, CounterPart, CounterState
from pipelines.refine.validate_layout import COUNTER
from schemas.reasons import NullReason

# the state and layout types live in counter_state; importers may take them from here
__all__ = [
    "STATE_SCHEMA",
    "CounterColumns",
    "CounterLayout",
    "CounterPart",
    "CounterState",
    "derive_rates",
    "derive_rates_group",
]

# a computed row's null reason as a code into this array (NULL: none)
_REASONS = pa.array(
    [NullReason.RESET.value, NullReason.SATURATED.value, NullReason.FIRST_SAMPLE.value]
)


@dataclass(frozen=True)
class CounterColumns:
    """Per-row results aligned with the input rows (non-counter rows: NULL/False)."""

    delta: Array  # float64, in the catalog unit
    rate: Array  # float64, unit per second
    reset: Array  # bool
    late: Array  # bool: out of order within its series
    null_reason: Array  # string: input null_reason, or first_sample/reset/saturated


def derive_rates(
    table: pa.Table, ts: Array, boot_id: str, state: CounterState
) -> tuple[CounterColumns, CounterState]:
    """Deltas and rates for the counter rows of ``table`` (all from one source stream).

    ``table`` has the columns of :data:`pipelines.refine.validate.ACCEPTED_SCHEMA` (``metric``,
    ``device``, ``raw``, ``kind``, ``scale``, ``max_raw``, ``saturate``, ``null_reason``);
    ``ts`` is the aligned time of each row. Returns the per-row columns and the new state;
    ``state`` itself is not modified. Never raises on data."""
    cols, states = derive_rates_group(table, ts, [CounterPart(table.num_rows, boot_id, state)])
    return cols, states[0]


def derive_rates_group(
    table: pa.Table, ts: Array, parts: list[CounterPart]
) -> tuple[CounterColumns, list[CounterState]]:
    """:func:`derive_rates` for several streams at once: ``parts`` give, in order, how many
    consecutive rows of ``table`` belong to each stream, its boot id and its state. One sort
    and two hash lookups for all of them; returns the columns and each stream's new state.
    A stream must appear once (its rows together)."""
    n = table.num_rows
    null_reason = column(table, "null_reason")
    raw_all = column(table, "raw")
    cmask = pc.and_(
        pc.and_(pc.equal(column(table, "kind"), COUNTER), pc.is_valid(raw_all)),
        pc.is_null(null_reason),  # a sentinel reading is no reading
    )
    if n == 0 or not any_true(cmask):
        false = pa.repeat(pa.scalar(False), n) if n else pa.array([], pa.bool_())
        nulls = pa.nulls(n, pa.float64())
        return CounterColumns(nulls, nulls, false, false, null_reason), [p.state for p in parts]

    k = len(parts)
    counts = np.array([p.rows for p in parts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    metric_all, device_all = column(table, "metric"), column(table, "device")
    spans = list(zip(starts[:-1].tolist(), counts.tolist(), strict=True))

    def view(j: int) -> tuple[Array, Array]:
        a, m = spans[j]
        return metric_all.slice(a, m), device_all.slice(a, m)

    masks = [cmask.slice(a, m) for a, m in spans]
    fits = [
        p.layout is not None
        and p.layout.matches(functools.partial(view, j), masks[j], p.state, p.known)
        for j, p in enumerate(parts)
    ]
    st_parts = [p.state.table for p in parts]
    st = pa.concat_tables(st_parts).combine_chunks() if k > 1 else st_parts[0]
    st_counts = np.array([t.num_rows for t in st_parts], dtype=np.int64)
    st_sid = np.repeat(np.arange(k, dtype=np.int64), st_counts)
    front = front_from_layouts(table, ts, parts, starts, st_counts, st_sid) if all(fits) else None
    if front is None:
        s, names, st_g, sidx = front_by_keys(table, ts, cmask, k, counts, st, st_sid)
    else:
        s, names, st_g, sidx = front
    boots = pa.array([p.boot_id for p in parts], pa.string())
    # the boot comparison once per state series (a row of the batch takes its series' answer)
    st_same = true_mask(pc.equal(column(st, "boot"), take(boots, pa.array(st_sid))))
    r = derive_sorted(s, st, sidx, st_same)
    states = _new_states(r, _Stored(st, st_sid, st_g, st_same), names, boots, front is not None)
    if front is None:
        # each stream's rows of the sorted table (sorted by series, so by stream first);
        # ``s``: before the late rows left, what a layout remembers
        bounds = np.searchsorted(column(s, "sid").to_numpy(), np.arange(k + 1))
        for j, p in enumerate(parts):
            if p.layout is not None and not fits[j]:
                mine = s.slice(int(bounds[j]), int(bounds[j + 1] - bounds[j]))
                remember(p.layout, *view(j), masks[j], mine, names, int(starts[j]), states[j])
                p.layout.known = p.known if p.layout.names is not None else None
    return _row_columns(n, r, null_reason), states


@dataclass(frozen=True)
class _Stored:
    """The streams' states concatenated (``table``), each state row's stream (``sid``),
    series id (``g``, NULL for a series not in the batch) and whether its boot is its
    stream's now (``same``)."""

    table: pa.Table
    sid: Any
    g: Array
    same: Array


def _new_states(
    r: Derived, st: _Stored, names: Array, boots: Array, from_layouts: bool
) -> list[CounterState]:
    """Each stream's new state: its untouched series, then its updated ones (merge_keyed
    order). ``from_layouts``: the series codes are state rows (:func:`front_from_layouts`)."""
    gu = r.g
    is_last = np.ones(len(gu), dtype=bool)
    is_last[:-1] = gu[:-1] != gu[1:]
    last = r.rows.filter(pa.array(is_last))
    upd_sid = column(last, "sid")
    # the key strings of the updated series from the batch's dictionary: the rows moved
    # integer codes through the sort, not strings
    codes_np = column(last, "g").to_numpy() % SID
    # from layouts, a series' code is its state row, and the codes ascend: every state row
    # updated (the usual batch) when there are as many codes as rows
    every = from_layouts and len(codes_np) == st.table.num_rows
    upd = pa.table(
        {
            # every row updated, in order: the state's own keys and, where no boot changed,
            # its boots (no string taken again)
            "key": column(st.table, "key") if every else take(names, pa.array(codes_np)),
            "raw": column(last, "raw"),
            "ts": column(last, "ts"),
            "boot": column(st.table, "boot") if every and not st.same.false_count else
                    take(boots, upd_sid),
            "src": column(last, "src"),
            "sid": upd_sid,
        }
    )  # fmt: skip
    if every:  # nothing kept: the updated rows are the new states, already in stream order
        merged = upd
    else:
        if from_layouts:  # the updated state rows by index
            keep_np = np.ones(st.table.num_rows, dtype=bool)
            keep_np[codes_np] = False
            kept = pa.array(keep_np)
        else:
            kept = pc.invert(true_mask(pc.is_in(st.g, value_set=column(last, "g"))))
        old = st.table.append_column("sid", pa.array(st.sid)).filter(kept)
        merged = pa.concat_tables([old, upd.select(old.column_names)])
        merged = merged.take(pc.sort_indices(column(merged, "sid")))  # stable: keeps the order
    k = len(boots)
    per = np.bincount(column(merged, "sid").to_numpy(), minlength=k)
    at = np.concatenate([[0], np.cumsum(per)])
    body = merged.select(STATE_SCHEMA.names)
    return [CounterState(body.slice(int(at[j]), int(per[j]))) for j in range(k)]


def _row_columns(n: int, r: Derived, null_reason: Array) -> CounterColumns:
    """The computed rows' results scattered back to row order; rows not computed (late,
    not counters) get the fills."""
    at_rows = column(r.rows, "pos").to_numpy()
    delta = np.zeros(n, dtype=np.float64)
    rate = np.zeros(n, dtype=np.float64)
    valid = np.zeros(n, dtype=bool)
    reset = np.zeros(n, dtype=bool)
    delta[at_rows], rate[at_rows], valid[at_rows], reset[at_rows] = (
        r.delta,
        r.rate,
        r.valid,
        r.reset,
    )
    late_rows = np.zeros(n, dtype=bool)
    late_rows[r.late_pos] = True
    if r.reason is None:  # no reset, saturation or first sample
        reason_out = null_reason
    else:  # codes moved to row order as integers, then named: one string pass
        code = np.full(n, -1, dtype=np.int8)
        code[at_rows] = r.reason
        named = take(_REASONS, pa.array(code, mask=code < 0))
        no_sentinel = null_reason.null_count == len(null_reason)
        reason_out = named if no_sentinel else pc.coalesce(null_reason, named)
    return CounterColumns(
        delta=pa.array(delta, mask=~valid),
        rate=pa.array(rate, mask=~valid | np.isnan(rate)),
        reset=pa.array(reset),
        late=pa.array(late_rows),
        null_reason=reason_out,
    )
