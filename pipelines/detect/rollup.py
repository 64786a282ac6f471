"""Tumbling-window rollups (10 s and 1 min by default) per node, device and metric.

Each refined batch is reduced with one ``group_by`` per window size into partial aggregates
``(window_start, node, device, metric) → min, max, sum, count, last, last_ts``; these are
merged into the open windows with a second ``group_by`` when a window is due to close or
they outgrow the merged state (partials combine exactly: min of mins, sum of sums, the
``last`` of the greatest ``last_ts``). A window is emitted once
``watermark = max aligned ts - allowed_lateness`` passes its end; emitted rows follow
:data:`schemas.records.ROLLUP_SCHEMA` (``mean = sum / count``). Samples whose window was
already emitted are counted in ``late_dropped`` rather than re-opening it (the lake keeps
them; rollups are a derived view).

State: the open windows x series, as one merged Arrow table per window size plus the
partials not merged yet, keyed by a series code (:class:`SeriesIds`): the names of each
node, device and metric are kept once, not per open window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column, take
from schemas.records import ROLLUP_SCHEMA

_KEY = ["window_start", "node", "device", "metric"]
PARTIAL_SCHEMA = pa.schema(
    [
        pa.field("window_start", pa.int64()),
        pa.field("node", pa.string()),
        pa.field("device", pa.string()),
        pa.field("metric", pa.string()),
        pa.field("min", pa.float64()),
        pa.field("max", pa.float64()),
        pa.field("sum", pa.float64()),
        pa.field("count", pa.int64()),
        pa.field("last", pa.float64()),
        pa.field("last_ts", pa.int64()),
    ]
)


@dataclass(frozen=True)
class RollupSettings:
    windows_s: tuple[int, ...] = (10, 60)
    allowed_lateness_ns: int = 5_000_000_000


# bits of each name's id in a series code: metric, device, node from the high bits down.
# Arrow's hash grouping on int64 keys slowed tenfold when the ids that vary most (the
# nodes') sat in the high bits (a merge of 500 k rows: 230 ms against 28 ms).
_BITS = 21
_MASK = (1 << _BITS) - 1
_SERIES = ["node", "device", "metric"]
CODED = ["window_start", "_series", "min", "max", "sum", "count", "last", "last_ts"]


class SeriesIds:
    """The series (node, device, metric) of refined rows as one int64 code each, the same
    from batch to batch: each name has an id for good (a name of each column is hashed once
    per batch, in its dictionary, then looked up among the few names a cluster has), and a
    code packs the three ids. Grouping and sorting on the code moves eight bytes a row where
    the names move three strings, and state kept by code holds no names: :meth:`names` maps
    codes back. Grows with the distinct names ever seen (nodes, devices, metrics); raises
    ValueError past 2**21 of one column."""

    def __init__(self) -> None:
        self._ids: list[dict[Any, int]] = [{}, {}, {}]
        self._names: list[list[Any]] = [[], [], []]
        self._arrays: list[Any] = [None, None, None]  # _names as Arrow, built when read

    def codes(self, t: pa.Table, encoded: Callable[[str], Any] | None = None) -> Any:
        """The series code of every row of ``t`` (NULL where a name is); ``encoded(name)``:
        ``t``'s column dictionary-encoded, when the caller has it."""
        code = None
        for k in (2, 1, 0):  # the node's id in the low bits: see _BITS
            name = _SERIES[k]
            enc = encoded(name) if encoded else pc.dictionary_encode(column(t, name))
            ids = pa.array([self._id(k, n) for n in enc.dictionary.to_pylist()], pa.int64())
            part = take(ids, enc.indices)
            code = part if code is None else pc.add(pc.shift_left(code, _BITS), part)
        return code

    def _id(self, k: int, name: Any) -> int:
        ids = self._ids[k]
        i = ids.get(name)
        if i is None:
            i = ids[name] = len(self._names[k])
            if i > _MASK:
                raise ValueError(f"rollup: more than {_MASK + 1} distinct {_SERIES[k]} names")
            self._names[k].append(name)
            self._arrays[k] = None
        return i

    def names(self, codes: Any) -> list[Any]:
        """node, device and metric arrays of ``codes``."""
        out = []
        for k in range(3):
            arr = self._arrays[k]
            if arr is None:
                arr = self._arrays[k] = pa.array(self._names[k], pa.string())
            ids = pc.bit_wise_and(pc.shift_right(codes, _BITS * k), _MASK)
            out.append(take(arr, ids))
        return out


def _by_key(t: pa.Table, aggs: list[tuple[str, str]], value: str, ts: str) -> pa.Table:
    """One :data:`CODED` row per (``window_start``, ``_series``) group of ``t``, which is in
    ``ts`` order (stable): the four ``aggs`` (min, max, sum, count in that order), ``last``
    (``value`` at the greatest ``ts``; ties: the later row) and ``last_ts``. One
    single-threaded hash aggregation, whose ``last`` follows the table's order. The rows'
    order is the grouping's, which nothing depends on: keys are unique in a partial table,
    merges combine each key's rows in batch order, and closed windows are emitted sorted."""
    lo, hi = pc.min_max(t["window_start"]).values()
    one = lo.as_py() == hi.as_py()  # one window (a merge): grouped on the series alone
    keys = ["_series"] if one else ["window_start", "_series"]
    agg = t.group_by(keys, use_threads=False).aggregate([*aggs, (value, "last"), (ts, "max")])
    names = [f"{col}_{fn}" for col, fn in aggs] + [f"{value}_last", f"{ts}_max"]
    start = pa.repeat(lo, agg.num_rows) if one else agg["window_start"]
    cols = [start, agg["_series"], *(agg[n] for n in names)]
    return pa.table(cols, names=CODED)


def samples(
    refined: pa.Table, ids: SeriesIds | None = None, encoded: Callable[[str], Any] | None = None
) -> tuple[pa.Table, SeriesIds]:
    """The rows partials are made of: ``_series`` (the code of node, device and metric in
    ``ids``, a fresh one by default; ``encoded``: see :meth:`SeriesIds.codes`), ts, value,
    of the rows with a value, in ts order (stable); and ``ids``. Built once per batch for
    every window size."""
    ids = ids or SeriesIds()
    v = column(refined, "value")
    codes = ids.codes(refined, encoded)
    t = pa.table({"_series": codes, "ts": column(refined, "ts"), "value": v})
    t = t.filter(pc.is_valid(v))
    return t.take(pc.sort_indices(t["ts"])), ids


def coded_partials(rows: tuple[pa.Table, SeriesIds], window_s: int) -> pa.Table:
    """:data:`CODED` rows for one window size of a batch's :func:`samples`."""
    t = rows[0]
    if t.num_rows == 0:
        return _empty_coded()
    w = window_s * 1_000_000_000
    start = pc.multiply(pc.divide(t["ts"], w), w)  # int division floors for ts >= 0
    t = t.append_column("window_start", start)
    aggs = [("value", "min"), ("value", "max"), ("value", "sum"), ("value", "count")]
    return _by_key(t, aggs, "value", "ts")


def merge_coded(t: pa.Table) -> pa.Table:
    """Combine :data:`CODED` rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    aggs = [("min", "min"), ("max", "max"), ("sum", "sum"), ("count", "sum")]
    return _by_key(t.take(pc.sort_indices(t["last_ts"])), aggs, "last", "last_ts")


def named(t: pa.Table, ids: SeriesIds) -> pa.Table:
    """:data:`CODED` rows as PARTIAL_SCHEMA (the series' names in place of the code)."""
    cols = [t["window_start"], *ids.names(column(t, "_series")), *t.columns[2:]]
    return pa.table(cols, names=PARTIAL_SCHEMA.names).cast(PARTIAL_SCHEMA)


def coded(t: pa.Table, ids: SeriesIds) -> pa.Table:
    """PARTIAL_SCHEMA rows as :data:`CODED` (codes in ``ids``)."""
    rest = [t[c] for c in CODED[2:]]
    return pa.table([t["window_start"], ids.codes(t), *rest], names=CODED)


def partials(rows: tuple[pa.Table, SeriesIds], window_s: int) -> pa.Table:
    """PARTIAL_SCHEMA rows for one window size of a batch's :func:`samples`."""
    return named(coded_partials(rows, window_s), rows[1])


def merge_partials(t: pa.Table) -> pa.Table:
    """Combine PARTIAL_SCHEMA rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    ids = SeriesIds()
    return named(merge_coded(coded(t, ids)), ids)


def _empty_coded() -> pa.Table:
    i64, f64 = pa.int64(), pa.float64()
    types = [i64, i64, f64, f64, f64, i64, f64, i64]
    return pa.schema(list(zip(CODED, types, strict=True))).empty_table()


class Rollup:
    """Open windows per size; :meth:`update` returns closed windows as ROLLUP_SCHEMA.

    A batch's partials are kept as they come and merged only when a window closes, or when
    they outgrow the merged state (so memory stays within about twice the open windows x
    series): merging the whole state on every batch cost O(state) per batch. State is kept
    per window (its start): a merge combines one window's rows at a time, and a closing
    window is taken whole, so no temporary spans every open window."""

    def __init__(self, settings: RollupSettings | None = None, merge_rows: int = 65_536) -> None:
        self.settings = settings or RollupSettings()
        self.merge_rows = merge_rows  # fresh partial rows merged early past this (or the state)
        sizes = self.settings.windows_s
        # per window size, per window start: merged rows by series code (names in ids) and
        # the partials not merged yet
        self.ids = SeriesIds()
        self.open: dict[int, dict[int, pa.Table]] = {w: {} for w in sizes}
        self._fresh: dict[int, dict[int, list[pa.Table]]] = {w: {} for w in sizes}
        self._open_rows: dict[int, int] = dict.fromkeys(sizes, 0)
        self._fresh_rows: dict[int, int] = dict.fromkeys(sizes, 0)
        self._first: dict[int, int | None] = dict.fromkeys(sizes, None)
        self.emitted_until: dict[int, int] = dict.fromkeys(sizes, 0)
        self.watermark = 0
        self.late_dropped = 0

    def update(self, refined: pa.Table, encoded: Callable[[str], Any] | None = None) -> pa.Table:
        """Fold a refined batch in; return every window closed by the new watermark.
        ``encoded(name)``: ``refined``'s column dictionary-encoded, when the caller has it."""
        if refined.num_rows:
            self.watermark = max(
                self.watermark,
                int(pc.max(column(refined, "ts")).as_py()) - self.settings.allowed_lateness_ns,
            )
        out = []
        rows = samples(refined, self.ids, encoded) if refined.num_rows else None
        for w in self.settings.windows_s:
            if rows is not None:
                p = coded_partials(rows, w)
                ok = pc.greater_equal(p["window_start"], self.emitted_until[w])
                kept, late = p.filter(ok), p.filter(pc.invert(ok))
                if late.num_rows:
                    self.late_dropped += int(pc.sum(late["count"]).as_py())
                if kept.num_rows:
                    self._keep(w, kept)
                if self._fresh_rows[w] > max(self._open_rows[w], self.merge_rows):
                    self._merge(w)
            out.append(self._close(w, self.watermark))
        return pa.concat_tables(out)

    def _keep(self, w: int, kept: pa.Table) -> None:
        """Hold a batch's partials of window size ``w`` until the next merge, by window."""
        fresh = self._fresh[w]
        starts = pc.unique(kept["window_start"]).to_pylist()
        for ws in starts:
            part = kept if len(starts) == 1 else kept.filter(pc.equal(kept["window_start"], ws))
            fresh.setdefault(ws, []).append(part)
        self._fresh_rows[w] += kept.num_rows
        old = self._first[w]
        self._first[w] = min(starts) if old is None else min(old, *starts)

    def flush(self) -> pa.Table:
        """Close every open window (shutdown or end of a replay)."""
        return pa.concat_tables([self._close(w, 2**62) for w in self.settings.windows_s])

    def _merge(self, w: int) -> None:
        """Merge every window's partials into its rows, one window at a time (a key's rows
        combine as they did in one merge of all windows: keys hold their window)."""
        opened, fresh = self.open[w], self._fresh[w]
        for ws in sorted(fresh):
            before = opened.get(ws)
            parts = fresh.pop(ws) if before is None else [before, *fresh.pop(ws)]
            opened[ws] = merge_coded(pa.concat_tables(parts))
            self._open_rows[w] += opened[ws].num_rows - (0 if before is None else before.num_rows)
        self._fresh_rows[w] = 0

    def _close(self, w: int, watermark: int) -> pa.Table:
        wn = w * 1_000_000_000
        first = self._first[w]
        if first is None or first + wn > watermark:
            return _to_rollup(PARTIAL_SCHEMA.empty_table(), w)
        self._merge(w)
        opened = self.open[w]
        done = [opened.pop(ws) for ws in sorted(opened) if ws + wn <= watermark]
        self._open_rows[w] -= sum(t.num_rows for t in done)
        self._first[w] = min(opened, default=None)
        if not done:
            return _to_rollup(PARTIAL_SCHEMA.empty_table(), w)
        closed = pa.concat_tables(done)
        end = int(pc.max(closed["window_start"]).as_py()) + wn
        self.emitted_until[w] = max(self.emitted_until[w], end)
        return _to_rollup(named(closed, self.ids), w)

    def to_dict(self) -> dict[str, Any]:
        for w in self.settings.windows_s:
            self._merge(w)
        return {
            "open": {
                str(w): [r for ws in sorted(t) for r in named(t[ws], self.ids).to_pylist()]
                for w, t in self.open.items()
            },
            "emitted_until": {str(w): v for w, v in self.emitted_until.items()},
            "watermark": self.watermark,
            "late_dropped": self.late_dropped,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], settings: RollupSettings | None = None) -> Rollup:
        r = cls(settings)
        for w in r.settings.windows_s:
            rows = d.get("open", {}).get(str(w), [])
            t = coded(pa.Table.from_pylist(rows, PARTIAL_SCHEMA), r.ids)
            for ws in pc.unique(t["window_start"]).to_pylist():
                r.open[w][ws] = t.filter(pc.equal(t["window_start"], ws))
            r._open_rows[w] = t.num_rows
            r._first[w] = min(r.open[w], default=None)
            r.emitted_until[w] = int(d.get("emitted_until", {}).get(str(w), 0))
        r.watermark = int(d.get("watermark", 0))
        r.late_dropped = int(d.get("late_dropped", 0))
        return r


def _to_rollup(p: pa.Table, w: int) -> pa.Table:
    if p.num_rows == 0:
        return ROLLUP_SCHEMA.empty_table()
    p = p.sort_by(
        [
            ("window_start", "ascending"),
            ("node", "ascending"),
            ("device", "ascending"),
            ("metric", "ascending"),
        ]
    )
    return pa.table(
        {
            "window_s": pa.repeat(pa.scalar(w, pa.int32()), p.num_rows),
            "window_start": p["window_start"],
            "node": p["node"],
            "device": p["device"],
            "metric": p["metric"],
            "min": p["min"],
            "max": p["max"],
            "mean": pc.divide(p["sum"], pc.cast(p["count"], pa.float64())),
            "last": p["last"],
            "count": p["count"],
        },
        schema=ROLLUP_SCHEMA,
    )
