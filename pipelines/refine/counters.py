"""Counters → deltas and per-second rates; bitmask/enum readings → names.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, take, true_mask, where
from pipelines.refine.validate import BITMASK, COUNTER, ENUM, lookup
from schemas.catalog import Catalog, Kind, Metric
from schemas.reasons import NullReason

STATE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),  # metric|device
        pa.field("raw", pa.uint64()),  # last accepted raw reading
        pa.field("ts", pa.int64()),  # its aligned ts
        pa.field("boot", pa.string()),  # boot_id it was read under
        pa.field("src", pa.int64()),  # its ts on the source's own clock
    ]
)

# a computed row's null reason as a code into this array (NULL: none)
_REASONS = pa.array(
    [NullReason.RESET.value, NullReason.SATURATED.value, NullReason.FIRST_SAMPLE.value]
)


_NO_STATE = STATE_SCHEMA.empty_table()  # shared: building one costs ~20 µs a time


@dataclass
class CounterState:
    """Last accepted reading per counter series of one source stream."""

    table: pa.Table = field(default_factory=lambda: _NO_STATE)  # tables are immutable

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def to_dict(self) -> dict[str, list[Any]]:
        """Plain lists, for a Faust table's JSON serializer."""
        return {name: self.table.column(name).to_pylist() for name in STATE_SCHEMA.names}

    @classmethod
    def from_dict(cls, doc: dict[str, list[Any]]) -> CounterState:
        return cls(pa.table(doc, schema=STATE_SCHEMA))


@dataclass(frozen=True)
class CounterColumns:
    """Per-row results aligned with the input rows (non-counter rows: NULL/False)."""

    delta: Array  # float64, in the catalog unit
    rate: Array  # float64, unit per second
    reset: Array  # bool
    late: Array  # bool: out of order within its series
    null_reason: Array  # string: input null_reason, or first_sample/reset/saturated


@dataclass
class CounterLayout:
    """What one source stream's last batch looked like to :func:`derive_rates_group` (a cache,
    not state): exporters send the same series in the same order every batch, and then the
    series of each row, their order by (series, source ts) and their rows in the state are
    those of last time, found by comparing arrays instead of joining and hashing key strings
    and sorting."""

    metric: Array = None  # the batch's metric and device columns (all its rows)
    device: Array = None
    counters: Array = None  # which of its rows were counter readings
    names: Array = None  # the stream's state keys after that batch, in state order
    pos: Any = None  # numpy: its counter rows (in the batch), in (series, source ts) order
    codes: Any = None  # numpy: the series of each, as an index into ``names``
    hits: int = 0  # batches that used it
    # the validation layout generation (:attr:`pipelines.refine.validate.LayoutCache.gen`) of the
    # batch it was made from, when that batch's rows were all kept: a later batch of the same
    # generation whose rows were all kept has the same metric and device columns
    known: int | None = None

    def matches(
        self, view: Callable[[], tuple[Array, Array]], counters: Array, state: CounterState,
        known: int | None = None,
    ) -> bool:  # fmt: skip
        """Whether a batch fits: ``view`` gives its metric and device columns (not called
        when ``known`` vouches for them), ``counters`` its counter-row mask."""
        if self.names is None or not self.counters.equals(counters):
            return False
        if known is None or known != self.known:
            metric, device = view()
            if not (self.metric.equals(metric) and self.device.equals(device)):
                return False
            if known is not None:  # its columns are this generation's too
                self.known = known
        return bool(self.names.equals(column(state.table, "key")))


@dataclass(frozen=True)
class CounterPart:
    """One source stream's consecutive rows in a :func:`derive_rates_group` table, and the
    stream's :class:`CounterLayout` cache if the caller keeps one (it is updated in place)."""

    rows: int
    boot_id: str
    state: CounterState
    layout: CounterLayout | None = None
    known: int | None = None  # see CounterLayout.known: the batch's, when all its rows were kept


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


_SID = 1 << 32  # series id = stream index * _SID + code of "metric|device" in the batch


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
    front = _front_from_layouts(table, ts, parts, starts, st_counts, st_sid) if all(fits) else None
    if front is None:
        s, names, st_g, sidx = _front(table, ts, cmask, k, counts, st, st_sid)
    else:
        s, names, st_g, sidx = front
    boots = pa.array([p.boot_id for p in parts], pa.string())
    # the boot comparison once per state series (a row of the batch takes its series' answer)
    st_same = true_mask(pc.equal(column(st, "boot"), take(boots, pa.array(st_sid))))
    sorted_rows = s  # before the late rows leave: what a layout remembers
    r = _derive_sorted(s, st, sidx, st_same)
    late_pos = r.late_pos
    s = r.rows
    gu = r.g
    # new states: each stream's untouched series, then its updated ones (merge_keyed order)
    is_last = np.ones(len(gu), dtype=bool)
    is_last[:-1] = gu[:-1] != gu[1:]
    last = s.filter(pa.array(is_last))
    upd_sid = column(last, "sid")
    # the key strings of the updated series from the batch's dictionary: the rows moved
    # integer codes through the sort, not strings
    codes_np = column(last, "g").to_numpy() % _SID
    # from layouts, a series' code is its state row, and the codes ascend: every state row
    # updated (the usual batch) when there are as many codes as rows
    every = front is not None and len(codes_np) == st.num_rows
    upd = pa.table(
        {
            # every row updated, in order: the state's own keys and, where no boot changed,
            # its boots (no string taken again)
            "key": column(st, "key") if every else take(names, pa.array(codes_np)),
            "raw": column(last, "raw"),
            "ts": column(last, "ts"),
            "boot": column(st, "boot") if every and not st_same.false_count else
                    take(boots, upd_sid),
            "src": column(last, "src"),
            "sid": upd_sid,
        }
    )  # fmt: skip
    if every:  # nothing kept: the updated rows are the new states, already in stream order
        merged = upd
    else:
        if front is not None:  # the updated state rows by index
            keep_np = np.ones(st.num_rows, dtype=bool)
            keep_np[codes_np] = False
            kept = pa.array(keep_np)
        else:
            kept = pc.invert(true_mask(pc.is_in(st_g, value_set=column(last, "g"))))
        old = st.append_column("sid", pa.array(st_sid)).filter(kept)
        merged = pa.concat_tables([old, upd.select(old.column_names)])
        merged = merged.take(pc.sort_indices(column(merged, "sid")))  # stable: keeps the order
    per = np.bincount(column(merged, "sid").to_numpy(), minlength=k)
    at = np.concatenate([[0], np.cumsum(per)])
    body = merged.select(STATE_SCHEMA.names)
    states = [CounterState(body.slice(int(at[j]), int(per[j]))) for j in range(k)]
    if front is None:
        # each stream's rows of the sorted table (sorted by series, so by stream first)
        bounds = np.searchsorted(column(sorted_rows, "sid").to_numpy(), np.arange(k + 1))
        for j, p in enumerate(parts):
            if p.layout is not None and not fits[j]:
                mine = sorted_rows.slice(int(bounds[j]), int(bounds[j + 1] - bounds[j]))
                _remember(p.layout, *view(j), masks[j], mine, names, int(starts[j]), states[j])
                p.layout.known = p.known if p.layout.names is not None else None

    # scatter back to row order; rows not computed (late, not counters) get the fills
    at_rows = column(s, "pos").to_numpy()
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
    late_rows[late_pos] = True
    if r.reason is None:  # no reset, saturation or first sample
        reason_out = null_reason
    else:  # codes moved to row order as integers, then named: one string pass
        code = np.full(n, -1, dtype=np.int8)
        code[at_rows] = r.reason
        named = take(_REASONS, pa.array(code, mask=code < 0))
        no_sentinel = null_reason.null_count == len(null_reason)
        reason_out = named if no_sentinel else pc.coalesce(null_reason, named)
    cols = CounterColumns(
        delta=pa.array(delta, mask=~valid),
        rate=pa.array(rate, mask=~valid | np.isnan(rate)),
        reset=pa.array(reset),
        late=pa.array(late_rows),
        null_reason=reason_out,
    )
    return cols, states


@dataclass
class _Derived:
    """:func:`_derive_sorted`'s result: per computed row (the sorted rows less the late
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


def _derive_sorted(s: pa.Table, st: pa.Table, sidx: Array, st_same: Array) -> _Derived:
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
        # codes into _REASONS (reset, saturated, first sample); -1: none
        reason = np.where(reset, 0, np.where(saturated, 1, np.where(has_prev, -1, 2)))
        reason = reason.astype(np.int8)
    return _Derived(s, g, delta, rate, valid, reset, reason, late_pos)


def _front(
    table: pa.Table, ts: Array, cmask: Array, k: int, counts: Any, st: pa.Table, st_sid: Any
) -> tuple[pa.Table, Array, Array, Array]:
    """The counter rows sorted by (series, source ts), the series names, the state rows'
    series ids and each sorted row's state row: by joining and hashing ``metric|device``."""
    ci = where(cmask)
    sid = np.repeat(np.arange(k, dtype=np.int64), counts)[ci.to_numpy()]
    key = pc.binary_join_element_wise(
        pc.take(column(table, "metric"), ci), pc.take(column(table, "device"), ci), "|"
    )
    enc = key.dictionary_encode()
    names = enc.dictionary
    g = sid * _SID + enc.indices.to_numpy().astype(np.int64)
    sub = _rows(table, ts, ci, g, sid)
    s = sub.take(pc.sort_indices(sub, sort_keys=[("g", "ascending"), ("src", "ascending")]))
    # the streams' states keyed the same way (a state series not in this batch: NULL)
    st_code = pc.cast(pc.index_in(column(st, "key"), value_set=names), pa.int64())
    st_g = pc.add(pa.array(st_sid * _SID), st_code)
    return s, names, st_g, pc.index_in(column(s, "g"), value_set=st_g)


def _front_from_layouts(
    table: pa.Table,
    ts: Array,
    parts: list[CounterPart],
    starts: Any,
    st_counts: Any,
    st_sid: Any,
) -> tuple[pa.Table, Array, Array, Array] | None:
    """What :func:`_front` returns, from every stream's :class:`CounterLayout` (each matched
    its batch and its state): the series names are the states' keys, so a row's series is
    its state row. None when this batch's source timestamps do not keep last time's order
    (then :func:`_front` sorts)."""
    offsets = np.concatenate([[0], np.cumsum(st_counts)])
    lays = [p.layout for p in parts if p.layout is not None]
    assert len(lays) == len(parts)
    pos = np.concatenate([x.pos + a for x, a in zip(lays, starts[:-1], strict=True)])
    code = np.concatenate([x.codes + o for x, o in zip(lays, offsets[:-1], strict=True)])
    sid = np.repeat(np.arange(len(parts), dtype=np.int64), [len(x.pos) for x in lays])
    src = column(table, "ts_ns").to_numpy()[pos]
    same = code[1:] == code[:-1]
    back = (src[1:] < src[:-1]) | ((src[1:] == src[:-1]) & (pos[1:] < pos[:-1]))
    if (same & back).any():
        return None
    names = pa.concat_arrays([x.names for x in lays]) if len(lays) > 1 else lays[0].names
    st_g = pa.array(st_sid * _SID + np.arange(int(offsets[-1]), dtype=np.int64))
    s = _rows(table, ts, pa.array(pos), sid * _SID + code, sid)
    for x in lays:
        x.hits += 1
    return s, names, st_g, pa.array(code)


def _rows(table: pa.Table, ts: Array, pos: Array, g: Any, sid: Any) -> pa.Table:
    """The counter rows at ``pos`` with their series ``g`` and stream ``sid``."""
    return pa.table(
        {
            "pos": pos,
            "g": pa.array(g),
            "sid": pa.array(sid),
            "ts": take(ts, pos),  # pos: rows of this table
            "src": take(column(table, "ts_ns"), pos),
            "raw": take(column(table, "raw"), pos),
            "max": take(column(table, "max_raw"), pos),
            "sat": take(column(table, "saturate"), pos),
            "scale": take(column(table, "scale"), pos),
        }
    )


def _remember(
    layout: CounterLayout,
    metric: Array,
    device: Array,
    counters: Array,
    mine: pa.Table,
    names: Array,
    start: int,
    state: CounterState,
) -> None:
    """Fill ``layout`` from a stream's rows of a sorted :func:`_front` result (``mine``) and
    its new state, when a later batch of the same layout can use it: its series are in the
    state in the order they first appear in its rows, the order :func:`_front` would give."""
    layout.names = None
    keys = pc.take(names, pa.array(column(mine, "g").to_numpy() % _SID))
    state_keys = column(state.table, "key")
    code = pc.index_in(keys, value_set=state_keys)
    if code.null_count:
        return
    # the series of the batch, by first appearance in its rows
    in_rows = pc.unique(pc.take(keys, pc.sort_indices(column(mine, "pos"))))
    in_state = state_keys.filter(pc.is_in(state_keys, value_set=in_rows))
    codes = code.to_numpy().astype(np.int64)
    if not in_state.equals(in_rows) or (codes[1:] < codes[:-1]).any():
        return
    # copies of the slices: a view would keep its whole wave's buffers alive with the cache
    layout.metric, layout.device, layout.counters, layout.names = (
        pa.concat_arrays([a]) for a in (metric, device, counters, state_keys)
    )
    layout.pos = column(mine, "pos").to_numpy() - start
    layout.codes = codes


class StateDecoder:
    """Bitmask/enum readings → comma-joined names, decoded once per distinct (metric, value)
    and memoized (bounded)."""

    def __init__(self, catalog: Catalog, max_entries: int = 65_536) -> None:
        self._catalog = catalog
        self._memo: dict[str, str | None] = {}
        self._max = max_entries

    def decode(self, table: pa.Table) -> Array:
        """The ``decoded`` column for ``table`` (ACCEPTED_SCHEMA columns): names for bitmask
        and enum rows with a reading, NULL elsewhere. A bitmask of 0 decodes to ``none``;
        unnamed bits to ``bitN``; an unknown enum value to ``unknown(N)``."""
        n = table.num_rows
        kind = column(table, "kind")
        mask = pc.or_(pc.equal(kind, BITMASK), pc.equal(kind, ENUM))
        raw = column(table, "raw")
        value = column(table, "value")
        as_int = pc.coalesce(raw, pc.cast(value, pa.uint64(), safe=False))
        mask = pc.and_(mask, pc.is_valid(as_int))
        if not any_true(mask):
            return pa.nulls(n, pa.string())
        pos = where(mask)
        key = pc.binary_join_element_wise(
            pc.take(column(table, "metric"), pos),
            pc.cast(pc.take(as_int, pos), pa.string()),
            "|",
        )
        enc = key.dictionary_encode()
        names = pa.array([self._name(k) for k in enc.dictionary.to_pylist()], pa.string())
        decoded = pc.take(names, enc.indices)
        if len(pos) == n:
            return decoded
        # scatter back: rows in ``mask`` take their name in order, the others NULL
        slot = pc.subtract(pc.cumulative_sum(pc.cast(mask, pa.int64())), 1)
        return pc.take(decoded, pc.if_else(mask, slot, pa.scalar(None, pa.int64())))

    def _name(self, key: str) -> str | None:
        hit = self._memo.get(key)
        if hit is not None or key in self._memo:
            return hit
        metric_name, _, num = key.rpartition("|")
        m = lookup(self._catalog, metric_name)
        out = None if m is None else _decode_one(m, int(num))
        if len(self._memo) < self._max:
            self._memo[key] = out
        return out


def _decode_one(m: Metric, v: int) -> str:
    if m.kind is Kind.ENUM:
        return m.values.get(v, f"unknown({v})")
    if v == 0:
        return "none"
    names = []
    bit = 0
    while v >> bit:
        if v >> bit & 1:
            names.append(m.bits.get(bit, f"bit{bit}"))
        bit += 1
    return ",".join(names)
