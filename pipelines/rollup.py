"""Tumbling-window rollups (10 s and 1 min by default) per node, device and metric.

Each refined batch is reduced with one ``group_by`` per window size into partial aggregates
``(window_start, node, device, metric) → min, max, sum, count, last, last_ts`` and merged
into the open windows with a second ``group_by`` (partials combine exactly: min of mins,
sum of sums, the ``last`` of the greatest ``last_ts``). A window is emitted once
``watermark = max aligned ts - allowed_lateness`` passes its end; emitted rows follow
:data:`schemas.records.ROLLUP_SCHEMA` (``mean = sum / count``). Samples whose window was
already emitted are counted in ``late_dropped`` rather than re-opening it (the lake keeps
them; rollups are a derived view).

State: the open windows x series, as one Arrow table per window size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column
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


def _last_per_group(t: pa.Table, value: str, ts: str) -> pa.Table:
    """Per group of ``_KEY``: the ``value`` at the greatest ``ts`` (ties: the last row)."""
    idx = pa.array(range(t.num_rows), pa.int64())
    t2 = t.append_column("_i", idx)
    mx = t2.group_by(_KEY).aggregate([(ts, "max")])
    j = t2.join(mx, _KEY, join_type="inner")
    j = j.filter(pc.equal(j[ts], j[f"{ts}_max"]))
    pick = j.group_by(_KEY).aggregate([("_i", "max")])
    got = t.take(pick["_i_max"])
    return pa.table({**{k: got[k] for k in _KEY}, "last": got[value], "last_ts": got[ts]})


def partials(refined: pa.Table, window_s: int) -> pa.Table:
    """PARTIAL_SCHEMA rows of one batch for one window size (NULL values skipped)."""
    v = column(refined, "value")
    t = pa.table(
        {
            "node": column(refined, "node"),
            "device": column(refined, "device"),
            "metric": column(refined, "metric"),
            "ts": column(refined, "ts"),
            "value": v,
        }
    ).filter(pc.is_valid(v))
    if t.num_rows == 0:
        return PARTIAL_SCHEMA.empty_table()
    w = window_s * 1_000_000_000
    start = pc.multiply(pc.divide(t["ts"], w), w)  # int division floors for ts >= 0
    t = t.append_column("window_start", start)
    agg = t.group_by(_KEY).aggregate(
        [("value", "min"), ("value", "max"), ("value", "sum"), ("value", "count")]
    )
    last = _last_per_group(t, "value", "ts")
    j = agg.join(last, _KEY, join_type="inner")
    j = j.rename_columns(
        [c.removeprefix("value_") if c.startswith("value_") else c for c in j.column_names]
    )
    return j.select(PARTIAL_SCHEMA.names).cast(PARTIAL_SCHEMA)


def merge_partials(t: pa.Table) -> pa.Table:
    """Combine PARTIAL_SCHEMA rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    agg = t.group_by(_KEY).aggregate(
        [("min", "min"), ("max", "max"), ("sum", "sum"), ("count", "sum")]
    )
    agg = agg.rename_columns(
        [
            {"min_min": "min", "max_max": "max", "sum_sum": "sum", "count_sum": "count"}.get(c, c)
            for c in agg.column_names
        ]
    )
    last = _last_per_group(t, "last", "last_ts")
    return agg.join(last, _KEY, join_type="inner").select(PARTIAL_SCHEMA.names).cast(PARTIAL_SCHEMA)


class Rollup:
    """Open windows per size; :meth:`update` returns closed windows as ROLLUP_SCHEMA."""

    def __init__(self, settings: RollupSettings | None = None) -> None:
        self.settings = settings or RollupSettings()
        self.open: dict[int, pa.Table] = {
            w: PARTIAL_SCHEMA.empty_table() for w in self.settings.windows_s
        }
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
        for w in self.settings.windows_s:
            p = partials(refined, w) if refined.num_rows else PARTIAL_SCHEMA.empty_table()
            ok = pc.greater_equal(p["window_start"], self.emitted_until[w])
            self.late_dropped += int(pc.sum(p.filter(pc.invert(ok))["count"]).as_py() or 0)
            self.open[w] = merge_partials(pa.concat_tables([self.open[w], p.filter(ok)]))
            out.append(self._close(w, self.watermark))
        return pa.concat_tables(out)

    def flush(self) -> pa.Table:
        """Close every open window (shutdown or end of a replay)."""
        return pa.concat_tables([self._close(w, 2**62) for w in self.settings.windows_s])

    def _close(self, w: int, watermark: int) -> pa.Table:
        wn = w * 1_000_000_000
        t = self.open[w]
        done = pc.less_equal(pc.add(t["window_start"], wn), watermark)
        closed = t.filter(done)
        self.open[w] = t.filter(pc.invert(done))
        if closed.num_rows:
            end = int(pc.max(closed["window_start"]).as_py()) + wn
            self.emitted_until[w] = max(self.emitted_until[w], end)
        return _to_rollup(closed, w)

    def to_dict(self) -> dict[str, Any]:
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
