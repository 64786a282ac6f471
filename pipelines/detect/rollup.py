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
partials not merged yet.
"""

from __future__ import annotations

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


class _Series:
    """The series (node, device, metric) of a table's rows as one int64 code each, from one
    dictionary encoding per column: grouping and sorting on the code moves eight bytes a row
    where the names move three strings. Codes are local to the table; :meth:`names` maps
    them back."""

    def __init__(self, t: pa.Table) -> None:
        node, device, metric = (pc.dictionary_encode(column(t, c)) for c in _KEY[1:])
        self._dicts = (node.dictionary, device.dictionary, metric.dictionary)
        self._nd, self._nm = len(device.dictionary), len(metric.dictionary)
        i64 = pa.int64()
        # (node, device) pairs numbered again so that the code stays below rows x metrics
        pair = pc.add(pc.multiply(node.indices.cast(i64), self._nd), device.indices.cast(i64))
        pairs = pc.dictionary_encode(pair)
        self._pairs = pairs.dictionary
        self.codes = pc.add(
            pc.multiply(pairs.indices.cast(i64), self._nm), metric.indices.cast(i64)
        )

    def names(self, codes: Any) -> list[Any]:
        """node, device and metric arrays of ``codes``."""
        pair = take(self._pairs, pc.divide(codes, self._nm))
        node = take(self._dicts[0], pc.divide(pair, self._nd))
        device = take(
            self._dicts[1], pc.subtract(pair, pc.multiply(pc.divide(pair, self._nd), self._nd))
        )
        metric = take(
            self._dicts[2], pc.subtract(codes, pc.multiply(pc.divide(codes, self._nm), self._nm))
        )
        return [node, device, metric]


def _by_key(
    t: pa.Table, series: _Series, aggs: list[tuple[str, str]], value: str, ts: str
) -> pa.Table:
    """One PARTIAL_SCHEMA row per ``_KEY`` group of ``t`` (``window_start``, ``ts``,
    ``value`` and its series codes in ``series``), which is in ``ts`` order (stable): the
    four ``aggs`` (min, max, sum, count in that order), ``last`` (``value`` at the greatest
    ``ts``; ties: the later row) and ``last_ts``. One single-threaded hash aggregation over
    (window, series code), whose ``last`` follows the table's order. The rows' order is the
    grouping's, which nothing depends on: keys are unique in a partial table, merges combine
    each key's rows in batch order, and closed windows are emitted sorted."""
    agg = t.group_by(["window_start", "_series"], use_threads=False).aggregate(
        [*aggs, (value, "last"), (ts, "max")]
    )
    names = [f"{col}_{fn}" for col, fn in aggs] + [f"{value}_last", f"{ts}_max"]
    keys = [agg["window_start"], *series.names(column(agg, "_series"))]
    return pa.table(keys + [agg[n] for n in names], names=PARTIAL_SCHEMA.names).cast(PARTIAL_SCHEMA)


def samples(refined: pa.Table) -> tuple[pa.Table, _Series]:
    """The rows partials are made of: ``_series`` (the code of node, device and metric),
    ts, value, of the rows with a value, in ts order (stable); and the codes' names. Built
    once per batch for every window size."""
    series = _Series(refined)
    v = column(refined, "value")
    t = pa.table({"_series": series.codes, "ts": column(refined, "ts"), "value": v})
    t = t.filter(pc.is_valid(v))
    return t.take(pc.sort_indices(t["ts"])), series


def partials(rows: tuple[pa.Table, _Series], window_s: int) -> pa.Table:
    """PARTIAL_SCHEMA rows for one window size of a batch's :func:`samples`."""
    t, series = rows
    if t.num_rows == 0:
        return PARTIAL_SCHEMA.empty_table()
    w = window_s * 1_000_000_000
    start = pc.multiply(pc.divide(t["ts"], w), w)  # int division floors for ts >= 0
    t = t.append_column("window_start", start)
    aggs = [("value", "min"), ("value", "max"), ("value", "sum"), ("value", "count")]
    return _by_key(t, series, aggs, "value", "ts")


def merge_partials(t: pa.Table) -> pa.Table:
    """Combine PARTIAL_SCHEMA rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    series = _Series(t)
    coded = pa.table(
        [
            series.codes,
            *(t[c] for c in ("window_start", "min", "max", "sum", "count", "last", "last_ts")),
        ],
        names=["_series", "window_start", "min", "max", "sum", "count", "last", "last_ts"],
    )
    aggs = [("min", "min"), ("max", "max"), ("sum", "sum"), ("count", "sum")]
    return _by_key(coded.take(pc.sort_indices(coded["last_ts"])), series, aggs, "last", "last_ts")


class Rollup:
    """Open windows per size; :meth:`update` returns closed windows as ROLLUP_SCHEMA.

    A batch's partials are kept as they come and merged only when a window closes, or when
    they outgrow the merged state (so memory stays within about twice the open windows x
    series): merging the whole state on every batch cost O(state) per batch."""

    def __init__(self, settings: RollupSettings | None = None, merge_rows: int = 65_536) -> None:
        self.settings = settings or RollupSettings()
        self.merge_rows = merge_rows  # fresh partial rows merged early past this (or the state)
        self.open: dict[int, pa.Table] = {
            w: PARTIAL_SCHEMA.empty_table() for w in self.settings.windows_s
        }
        self._fresh: dict[int, list[pa.Table]] = {w: [] for w in self.settings.windows_s}
        self._fresh_rows: dict[int, int] = dict.fromkeys(self.settings.windows_s, 0)
        self._first: dict[int, int | None] = dict.fromkeys(self.settings.windows_s, None)
        self.emitted_until: dict[int, int] = dict.fromkeys(self.settings.windows_s, 0)
        self.watermark = 0
        self.late_dropped = 0

    def update(self, refined: pa.Table) -> pa.Table:
        """Fold a refined batch in; return every window closed by the new watermark."""
        if refined.num_rows:
            self.watermark = max(
                self.watermark,
                int(pc.max(column(refined, "ts")).as_py()) - self.settings.allowed_lateness_ns,
            )
        out = []
        rows = samples(refined) if refined.num_rows else None
        for w in self.settings.windows_s:
            if rows is not None:
                p = partials(rows, w)
                ok = pc.greater_equal(p["window_start"], self.emitted_until[w])
                kept, late = p.filter(ok), p.filter(pc.invert(ok))
                if late.num_rows:
                    self.late_dropped += int(pc.sum(late["count"]).as_py())
                if kept.num_rows:
                    self._fresh[w].append(kept)
                    self._fresh_rows[w] += kept.num_rows
                    first = int(pc.min(kept["window_start"]).as_py())
                    old = self._first[w]
                    self._first[w] = first if old is None else min(old, first)
                if self._fresh_rows[w] > max(self.open[w].num_rows, self.merge_rows):
                    self._merge(w)
            out.append(self._close(w, self.watermark))
        return pa.concat_tables(out)

    def flush(self) -> pa.Table:
        """Close every open window (shutdown or end of a replay)."""
        return pa.concat_tables([self._close(w, 2**62) for w in self.settings.windows_s])

    def _merge(self, w: int) -> None:
        if self._fresh[w]:
            self.open[w] = merge_partials(pa.concat_tables([self.open[w], *self._fresh[w]]))
            self._fresh[w], self._fresh_rows[w] = [], 0

    def _close(self, w: int, watermark: int) -> pa.Table:
        wn = w * 1_000_000_000
        first = self._first[w]
        if first is None or first + wn > watermark:
            return _to_rollup(PARTIAL_SCHEMA.empty_table(), w)
        self._merge(w)
        t = self.open[w]
        done = pc.less_equal(pc.add(t["window_start"], wn), watermark)
        closed = t.filter(done)
        self.open[w] = t.filter(pc.invert(done))
        left = self.open[w]
        self._first[w] = int(pc.min(left["window_start"]).as_py()) if left.num_rows else None
        if closed.num_rows:
            end = int(pc.max(closed["window_start"]).as_py()) + wn
            self.emitted_until[w] = max(self.emitted_until[w], end)
        return _to_rollup(closed, w)

    def to_dict(self) -> dict[str, Any]:
        for w in self.settings.windows_s:
            self._merge(w)
        return {
            "open": {str(w): t.to_pylist() for w, t in self.open.items()},
            "emitted_until": {str(w): v for w, v in self.emitted_until.items()},
            "watermark": self.watermark,
            "late_dropped": self.late_dropped,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], settings: RollupSettings | None = None) -> Rollup:
        r = cls(settings)
        for w in r.settings.windows_s:
            rows = d.get("open", {}).get(str(w), [])
            r.open[w] = pa.Table.from_pylist(rows, PARTIAL_SCHEMA)
            if r.open[w].num_rows:
                r._first[w] = int(pc.min(r.open[w]["window_start"]).as_py())
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
