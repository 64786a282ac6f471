"""Tumbling-window rollups (10 s and 1 min by default) per node, device and metric.

Each refined batch is reduced into partial aggregates ``(window_start, node, device, metric)
→ min, max, sum, count, last, last_ts`` for every window size; these are merged into the
open windows when a window is due to close or they outgrow the merged state (partials
combine exactly: min of mins, sum of sums, the ``last`` of the greatest ``last_ts``). A
window is emitted once ``watermark = max aligned ts - allowed_lateness`` passes its end;
emitted rows follow :data:`schemas.records.ROLLUP_SCHEMA` (``mean = sum / count``). Samples
whose window was already emitted are counted in ``late_dropped`` rather than re-opening it
(the lake keeps them; rollups are a derived view).

The reductions run in numpy over rows sorted by series, then ts (stable): every group of
every window size is a run of consecutive rows, reduced with one ``reduceat`` or ``bincount``
per aggregate, and a window size that is a multiple of a smaller one (60 s of 10 s) is folded
from the smaller one's groups, each of its groups a run of those. A batch of refined rows (a
few thousand) costs a few dozen numpy calls of microseconds each, where an Arrow hash
aggregation costs more in its fixed cost (its plan) than in such rows. A merge sorts one
window's rows by series (its parts come sorted: runs to merge) and folds each key's rows in
``last_ts`` order. The results are a single-threaded hash aggregation's to the bit: sums add
a group's values one by one in that order (``acc = value + acc`` from 0.0), min and max skip
NaN (all NaN: the last) and keep the first of equal zeros, ``last`` is the value of the last
row at the greatest ts. Rows without a ts fall in no window.

State: the open windows x series, as merged partials per window size and window start plus
the partials not merged yet, keyed by a series code (:class:`SeriesIds`): the names of each
node, device and metric are kept once, not per open window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column, take
from schemas.records import ROLLUP_SCHEMA

Arr = npt.NDArray[Any]

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
_NULL = -1  # the series code, in numpy, of a row with a NULL name (codes are >= 0)
_S = 1_000_000_000


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
        code = self.array(t, encoded)
        return pa.array(code, pa.int64(), mask=code == _NULL)

    def array(self, t: pa.Table, encoded: Callable[[str], Any] | None = None) -> Arr:
        """:meth:`codes` as numpy, ``-1`` where a name is NULL."""
        return self.encode(t, encoded)[0]

    def encode(
        self, t: pa.Table, encoded: Callable[[str], Any] | None = None
    ) -> tuple[Arr, Arr | None]:
        """:meth:`array`, and a uint16 key per row that sorts as its code does (the ranks of
        the ids among the table's names, packed) when the table's names make at most 2**16
        combinations and none is NULL, else None: a stable sort on 16 bits is a radix sort."""
        code: Arr | None = None
        key: Arr | None = None
        null: Arr | None = None
        span = 1  # the combinations of the names so far
        for k in (2, 1, 0):  # the node's id in the low bits: see _BITS
            name = _SERIES[k]
            enc = encoded(name) if encoded else pc.dictionary_encode(column(t, name))
            names = enc.dictionary.to_pylist()
            known = list(map(self._ids[k].get, names))
            if None in known:
                known = [self._id(k, n) for n in names]
            ids = np.array(known, np.int64)
            idx = enc.indices
            if idx.null_count:
                miss = pc.is_null(idx).to_numpy(zero_copy_only=False)
                null = miss if null is None else null | miss
                idx = pc.fill_null(idx, 0)
            at = idx.to_numpy()
            part = ids.take(at) if len(ids) else np.zeros(len(at), np.int64)
            code = part if code is None else (code << _BITS) + part
            span *= max(len(ids), 1)
            if span <= 1 << 16 and null is None:
                rank = np.empty(len(ids), np.int64)
                rank[np.argsort(ids)] = np.arange(len(ids))
                part = rank.take(at) if len(ids) else part
                key = part if key is None else key * len(ids) + part
            else:
                key = None
        assert code is not None
        if null is not None:
            code[null] = _NULL
        return code, None if key is None or null is not None else key.astype(np.uint16)

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


@dataclass(frozen=True, slots=True)
class Coded:
    """:data:`CODED` rows as numpy columns (``series``: ``-1`` for NULL names)."""

    window_start: Arr
    series: Arr
    min: Arr
    max: Arr
    sum: Arr
    count: Arr
    last: Arr
    last_ts: Arr

    @property
    def rows(self) -> int:
        return len(self.series)

    def columns(self) -> list[Arr]:
        return [getattr(self, f) for f in _FIELDS]

    def select(self, which: Arr) -> Coded:
        return Coded(*(c[which] for c in self.columns()))

    @staticmethod
    def concat(parts: list[Coded]) -> Coded:
        if len(parts) == 1:
            return parts[0]
        columns = zip(*(p.columns() for p in parts), strict=True)
        return Coded(*(np.concatenate(cols) for cols in columns))

    def table(self) -> pa.Table:
        cols = [pa.array(c) for c in self.columns()]
        s = self.series
        if (s == _NULL).any():
            cols[1] = pa.array(s, pa.int64(), mask=s == _NULL)
        return pa.table(cols, names=CODED)

    @staticmethod
    def of(t: pa.Table) -> Coded:
        """The columns of a :data:`CODED` table (one without NULLs but in ``_series``)."""
        series = column(t, "_series")
        if series.null_count:
            series = pc.fill_null(series, _NULL)
        rest = [column(t, c).to_numpy() for c in CODED[2:]]
        return Coded(column(t, "window_start").to_numpy(), series.to_numpy(), *rest)


_FIELDS = ["window_start", "series", "min", "max", "sum", "count", "last", "last_ts"]


def _empty() -> Coded:
    i64, f64 = np.empty(0, np.int64), np.empty(0, np.float64)
    return Coded(i64, i64, f64, f64, f64, i64, f64, i64)


def _window(ts: Arr, wn: int) -> Arr:
    """The start of ``ts``'s window of ``wn`` ns (ts truncated toward zero, as Arrow's
    integer division does: the floor for ts >= 0)."""
    q = ts // wn
    if len(ts) and ts.min() < 0:
        q += (ts < 0) & (q * wn != ts)
    return q * wn


def _runs(*keys: Arr) -> Arr:
    """True where a run of equal ``keys`` (on every one) starts."""
    n = len(keys[0])
    b = np.empty(n, np.bool_)
    if n:
        b[0] = True
        np.not_equal(keys[0][1:], keys[0][:-1], out=b[1:])
        for k in keys[1:]:
            b[1:] |= k[1:] != k[:-1]
    return b


def _extreme(fn: Any, x: Arr, starts: Arr, ends: Arr, gid: Arr, zeros: bool) -> Arr:
    """``fn`` (np.fmin or np.fmax) of each run ``starts[i]..ends[i]`` of ``x`` (``gid``: each
    element's run) as a fold in order gives it: NaN skipped unless all are (then the last
    NaN), and of equal zeros the first (numpy's reduction may pick either sign; a fold
    keeps the one it holds). ``zeros``: whether ``x`` may hold a negative zero (then each
    zero result's sign is looked up)."""
    out: Arr = fn.reduceat(x, starts)
    nan = np.isnan(out)
    if nan.any():
        out[nan] = x[ends[nan]]
    if zeros:
        pos = np.flatnonzero(x == 0)
        g = gid[pos]
        first = _runs(g)
        g, pos = g[first], pos[first]
        fix = out[g] == 0
        out[g[fix]] = x[pos[fix]]
    return out


def _sum(values: Arr, gid: Arr, groups: int) -> Arr:
    """Each group's ``values`` added one by one in their order (``gid``: each one's group,
    ascending): ``acc = value + acc`` from 0.0, as Arrow's hash sum adds. A NaN result takes
    the bits of the group's last NaN value, as that fold gives them (adding two NaNs keeps
    the left one's)."""
    total: Arr = np.bincount(gid, weights=values, minlength=groups)
    nan = np.isnan(values)
    if nan.any():
        pos = np.flatnonzero(nan)
        g = gid[pos]
        last = np.empty(len(g), np.bool_)
        last[-1] = True
        np.not_equal(g[1:], g[:-1], out=last[:-1])
        total[g[last]] = values[pos[last]]
    return total


def _negative_zero(x: Arr) -> bool:
    return bool((np.signbit(x) & (x == 0)).any())


def _fold(
    b: Arr,
    rows: Coded,
    zeros: bool,
    unit: bool = False,
    sums: tuple[Arr, Arr] | None = None,
    order: Arr | None = None,
) -> tuple[Coded, Arr]:
    """One row per run of ``rows`` (``b``: True where one starts), each run's rows folded in
    their order, and the run of each row. ``zeros``: whether min or max may hold a negative
    zero; ``unit``: each row counts one (``rows.count`` unread); ``sums``: the values added
    up in place of ``rows.sum``, one by one in their order, and each one's row in ``rows``;
    ``order``: the rows are ``rows`` taken at ``order`` (a column is taken whole only where
    every row of it is read)."""
    starts = np.flatnonzero(b)
    n, g = len(b), len(starts)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:] - 1
    ends[-1:] = n - 1
    gid = np.cumsum(b) - 1
    first, last = (starts, ends) if order is None else (order.take(starts), order.take(ends))

    def whole(c: Arr) -> Arr:
        return c if order is None else c.take(order)

    total = _sum(whole(rows.sum), gid, g) if sums is None else _sum(sums[0], gid.take(sums[1]), g)
    if unit:
        count = np.diff(starts, append=n)
    else:
        count = np.add.reduceat(whole(rows.count), starts) if g else rows.count[:0]
    lo = _extreme(np.fmin, whole(rows.min), starts, ends, gid, zeros) if g else rows.min[:0]
    hi = _extreme(np.fmax, whole(rows.max), starts, ends, gid, zeros) if g else rows.max[:0]
    folded = Coded(
        rows.window_start.take(first),
        rows.series.take(first),
        lo,
        hi,
        total,
        count,
        rows.last.take(last),
        rows.last_ts.take(last),
    )
    return folded, gid


@dataclass(frozen=True)
class Samples:
    """A batch's rows with a value and a ts, ordered by series code, then ts, then row
    (stable): ``series`` (``-1``: a NULL name), ``ts``, ``value``; ``ts_max``: the newest
    ts of the batch's rows (with a value or not); ``ids``: the codes' names."""

    series: Arr
    ts: Arr
    value: Arr
    ts_max: int | None
    ids: SeriesIds


def samples(
    refined: pa.Table, ids: SeriesIds | None = None, encoded: Callable[[str], Any] | None = None
) -> Samples:
    """The rows partials are made of (``ids``: the series codes' names, a fresh one by
    default; ``encoded``: see :meth:`SeriesIds.codes`). Built once per batch for every
    window size."""
    ids = ids or SeriesIds()
    series, key = ids.encode(refined, encoded)
    tsc, vc = refined.column("ts"), refined.column("value")
    keep = pc.is_valid(vc).to_numpy() if vc.null_count else None
    if tsc.null_count:  # rows without a ts fall in no window
        valid = pc.is_valid(tsc).to_numpy()
        keep = valid if keep is None else keep & valid
        ts_max = pc.max(tsc).as_py()  # None: no row has a ts
        ts = pc.fill_null(tsc, 0).to_numpy()
    else:
        ts = tsc.to_numpy()
        ts_max = int(ts.max()) if len(ts) else None
    value = vc.to_numpy()
    pick = None if keep is None else np.flatnonzero(keep)
    at = ts if pick is None else ts.take(pick)
    if key is not None:  # by ts, then (stable, radix) by series
        order = np.argsort(at, kind="stable")
        order = order.take(
            np.argsort((key if pick is None else key.take(pick)).take(order), kind="stable")
        )
    else:
        order = np.lexsort((at, series if pick is None else series.take(pick)))
    if pick is not None:
        order = pick.take(order)
    return Samples(series.take(order), ts.take(order), value.take(order), ts_max, ids)


def _partials(rows: Samples, windows_s: Iterable[int]) -> dict[int, Coded]:
    """:class:`Coded` partials of ``rows`` per window size, in series then window order. A
    size that is a multiple of a smaller one is folded from that one's partials (its groups
    are runs of them), its sums still from the rows; where no two of them share a larger
    window (a batch within one window of the smaller size, most are), they are its partials
    as they are."""
    out: dict[int, Coded] = {}
    if len(rows.ts) == 0:
        return {w: _empty() for w in windows_s}
    v = rows.value
    zeros = _negative_zero(v)
    gids: dict[int, Arr] = {}  # per size: each row's group
    for w in sorted(set(windows_s)):
        wn = w * _S
        fine = next((f for f in sorted(out, reverse=True) if w % f == 0), None)
        if fine is None:
            start = _window(rows.ts, wn)
            base = Coded(start, rows.series, v, v, v, v, v, rows.ts)
            out[w], gids[w] = _fold(_runs(rows.series, start), base, zeros, unit=True)
        else:
            f = out[fine]
            start = _window(f.window_start, wn)
            b = _runs(f.series, start)
            f = dataclasses.replace(f, window_start=start)
            if b.all():
                out[w], gids[w] = f, gids[fine]
            else:
                out[w], gid = _fold(b, f, zeros, sums=(v, gids[fine]))
                gids[w] = gid.take(gids[fine])
    return out


def coded_partials(rows: Samples, window_s: int) -> pa.Table:
    """:data:`CODED` rows for one window size of a batch's :func:`samples`."""
    return _partials(rows, [window_s])[window_s].table()


def _merge(t: Coded) -> Coded:
    """Combine the rows sharing a key (window start, series) into one each: a key's rows
    fold in ``last_ts`` order, rows of equal ``last_ts`` in table order."""
    if t.rows == 0:
        return t
    ws = t.window_start
    if ws.min() == ws.max():  # one window (a merge of the open state): keyed on the series
        order = np.argsort(t.series, kind="stable")  # parts sorted by series: runs merged
        s, lt = t.series.take(order), t.last_ts.take(order)
        if not ((s[1:] != s[:-1]) | (lt[1:] >= lt[:-1])).all():
            order = np.lexsort((t.last_ts, t.series))
            s = t.series.take(order)
        b = _runs(s)
    else:
        order = np.lexsort((t.last_ts, t.series, ws))
        b = _runs(t.series.take(order), ws.take(order))
    zeros = _negative_zero(t.min) or _negative_zero(t.max)
    return _fold(b, t, zeros, order=order)[0]


def merge_coded(t: pa.Table) -> pa.Table:
    """Combine :data:`CODED` rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    return _merge(Coded.of(t)).table()


def named(t: pa.Table, ids: SeriesIds) -> pa.Table:
    """:data:`CODED` rows as PARTIAL_SCHEMA (the series' names in place of the code)."""
    cols = [t["window_start"], *ids.names(column(t, "_series")), *t.columns[2:]]
    return pa.table(cols, names=PARTIAL_SCHEMA.names).cast(PARTIAL_SCHEMA)


def coded(t: pa.Table, ids: SeriesIds) -> pa.Table:
    """PARTIAL_SCHEMA rows as :data:`CODED` (codes in ``ids``)."""
    rest = [t[c] for c in CODED[2:]]
    return pa.table([t["window_start"], ids.codes(t), *rest], names=CODED)


def partials(rows: Samples, window_s: int) -> pa.Table:
    """PARTIAL_SCHEMA rows for one window size of a batch's :func:`samples`."""
    return named(coded_partials(rows, window_s), rows.ids)


def merge_partials(t: pa.Table) -> pa.Table:
    """Combine PARTIAL_SCHEMA rows sharing a key into one row each."""
    if t.num_rows == 0:
        return t
    ids = SeriesIds()
    return named(merge_coded(coded(t, ids)), ids)


_NONE = ROLLUP_SCHEMA.empty_table()


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
        self.open: dict[int, dict[int, Coded]] = {w: {} for w in sizes}
        self._fresh: dict[int, dict[int, list[Coded]]] = {w: {} for w in sizes}
        self._open_rows: dict[int, int] = dict.fromkeys(sizes, 0)
        self._fresh_rows: dict[int, int] = dict.fromkeys(sizes, 0)
        self._first: dict[int, int | None] = dict.fromkeys(sizes, None)
        self.emitted_until: dict[int, int] = dict.fromkeys(sizes, 0)
        self.watermark = 0
        self.late_dropped = 0

    def update(self, refined: pa.Table, encoded: Callable[[str], Any] | None = None) -> pa.Table:
        """Fold a refined batch in; return every window closed by the new watermark.
        ``encoded(name)``: ``refined``'s column dictionary-encoded, when the caller has it."""
        parts: dict[int, Coded] = {}
        if refined.num_rows:
            rows = samples(refined, self.ids, encoded)
            if rows.ts_max is not None:
                lateness = self.settings.allowed_lateness_ns
                self.watermark = max(self.watermark, rows.ts_max - lateness)
            parts = _partials(rows, self.settings.windows_s)
        out = []
        for w in self.settings.windows_s:
            p = parts.get(w)
            if p is not None and p.rows:
                late = p.window_start < self.emitted_until[w]
                if late.any():
                    self.late_dropped += int(p.count[late].sum())
                    p = p.select(~late)
                if p.rows:
                    self._keep(w, p)
                if self._fresh_rows[w] > max(self._open_rows[w], self.merge_rows):
                    self._merge(w)
            closed = self._close(w, self.watermark)
            if closed is not None:
                out.append(closed)
        return _NONE if not out else out[0] if len(out) == 1 else pa.concat_tables(out)

    def _keep(self, w: int, kept: Coded) -> None:
        """Hold a batch's partials of window size ``w`` until the next merge, by window."""
        fresh = self._fresh[w]
        ws = kept.window_start
        lo, hi = int(ws.min()), int(ws.max())
        starts = [lo] if lo == hi else [int(x) for x in np.unique(ws)]
        for s in starts:
            part = kept if lo == hi else kept.select(ws == s)
            fresh.setdefault(s, []).append(part)
        self._fresh_rows[w] += kept.rows
        old = self._first[w]
        self._first[w] = lo if old is None else min(old, lo)

    def flush(self) -> pa.Table:
        """Close every open window (shutdown or end of a replay)."""
        out = [c for w in self.settings.windows_s if (c := self._close(w, 2**62)) is not None]
        return pa.concat_tables(out) if out else _NONE

    def _merge(self, w: int) -> None:
        """Merge every window's partials into its rows, one window at a time (a key's rows
        combine as they did in one merge of all windows: keys hold their window)."""
        opened, fresh = self.open[w], self._fresh[w]
        for ws in sorted(fresh):
            before = opened.get(ws)
            parts = fresh.pop(ws) if before is None else [before, *fresh.pop(ws)]
            opened[ws] = _merge(Coded.concat(parts))
            self._open_rows[w] += opened[ws].rows - (0 if before is None else before.rows)
        self._fresh_rows[w] = 0

    def _close(self, w: int, watermark: int) -> pa.Table | None:
        """The windows of size ``w`` that ``watermark`` closes, as ROLLUP_SCHEMA; None when
        none does."""
        wn = w * _S
        first = self._first[w]
        if first is None or first + wn > watermark:
            return None
        self._merge(w)
        opened = self.open[w]
        done = [opened.pop(ws) for ws in sorted(opened) if ws + wn <= watermark]
        self._open_rows[w] -= sum(t.rows for t in done)
        self._first[w] = min(opened, default=None)
        if not done:
            return None
        closed = Coded.concat(done)
        end = int(closed.window_start.max()) + wn
        self.emitted_until[w] = max(self.emitted_until[w], end)
        return _to_rollup(named(closed.table(), self.ids), w)

    def to_dict(self) -> dict[str, Any]:
        for w in self.settings.windows_s:
            self._merge(w)
        return {
            "open": {
                str(w): [r for ws in sorted(t) for r in named(t[ws].table(), self.ids).to_pylist()]
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
            t = Coded.of(coded(pa.Table.from_pylist(rows, PARTIAL_SCHEMA), r.ids))
            for ws in np.unique(t.window_start).tolist():
                r.open[w][ws] = t.select(t.window_start == ws)
            r._open_rows[w] = t.rows
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
