"""Validate and clean the samples of one decoded batch against the metric catalog.

:func:`validate_samples` splits a batch's rows into accepted rows and rejected row groups,
one :class:`~schemas.reasons.Reason` per group. Every row ends in exactly one of the two.
A row failing several checks gets the first reason in this order:

1. ``unknown_metric``  metric is neither a catalog name nor an alias
2. ``bad_device``      device is empty or longer than ``max_device_len`` characters
3. ``timestamp_out_of_window``  ``ts_ns`` outside ``[now - past, now + future]`` (defaults
   7 days / 1 day: wide, because a source clock may be off by an hour or more and late data
   is landed, not dropped)
4. ``wrong_kind``      a counter without ``raw`` (and no sentinel), a negative counter, or any
   other kind without a numeric reading (and no sentinel)
5. ``non_finite``      NaN or infinite value
6. ``out_of_range``    scaled value outside the catalog's ``[valid_min, valid_max]``, or a
   counter's raw reading above ``2**width - 1``

Sentinels (catalog ``sentinels`` compared with the reading as received, or ``sentinel_texts``
compared with ``text``) are not rejected: their value becomes NULL with ``null_reason``
``sentinel``. Metric aliases become catalog names; values are scaled into the catalog unit.

Pure and vectorized: per batch the Python work is proportional to the number of *distinct*
metrics in it, never to the number of rows.

Example::

    >>> from schemas.catalog import Catalog, Metric, Origin
    >>> cat = Catalog([Metric(name="gpu.temp", unit="C", kind="gauge", description="GPU temp",
    ...                       origin=Origin(nvml="temp"), valid_min=-40, valid_max=150)])
    >>> t = pa.table({"ts_ns": [10, 10], "metric": ["gpu.temp", "nope"],
    ...               "device": ["gpu0", "gpu0"], "value": [55.0, 1.0]})
    >>> v = validate_samples(t, cat, now_ns=10)
    >>> (v.accepted.num_rows, [(r.reason.value, r.count) for r in v.rejected])
    (1, [('unknown_metric', 1)])
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, take, true_mask, where
from schemas.catalog import Catalog, Kind, Metric, Overflow
from schemas.reasons import NullReason, Reason

DAY_NS = 86_400 * 1_000_000_000

KIND_CODES: dict[Kind, int] = {
    Kind.GAUGE: 0,
    Kind.COUNTER: 1,
    Kind.BITMASK: 2,
    Kind.ENUM: 3,
    Kind.EVENT: 4,
}
COUNTER = KIND_CODES[Kind.COUNTER]
BITMASK = KIND_CODES[Kind.BITMASK]
ENUM = KIND_CODES[Kind.ENUM]

# Reasons in priority order; the index is the code used internally.
REASON_ORDER: tuple[Reason, ...] = (
    Reason.UNKNOWN_METRIC,
    Reason.BAD_DEVICE,
    Reason.TIMESTAMP_OUT_OF_WINDOW,
    Reason.WRONG_KIND,
    Reason.NON_FINITE,
    Reason.OUT_OF_RANGE,
)

ACCEPTED_SCHEMA = pa.schema(
    [
        pa.field("row", pa.int64()),  # index of the row in the input batch
        pa.field("ts_ns", pa.int64()),
        pa.field("metric", pa.string()),  # canonical catalog name
        pa.field("device", pa.string()),
        pa.field("value", pa.float64()),  # in the catalog unit; NULL for sentinels
        pa.field("raw", pa.uint64()),
        pa.field("text", pa.string()),
        pa.field("null_reason", pa.string()),
        pa.field("unit", pa.string()),
        pa.field("kind", pa.int8()),
        pa.field("scale", pa.float64()),
        pa.field("max_raw", pa.uint64()),  # counters: 2**width - 1
        pa.field("saturate", pa.bool_()),  # counters: overflow == saturate
    ]
)


@dataclass(frozen=True)
class ValidateLimits:
    """Bounds for sample checks. Times are ns; the window is relative to ``now_ns``."""

    past_ns: int = 7 * DAY_NS
    future_ns: int = 1 * DAY_NS
    max_device_len: int = 128


@dataclass(frozen=True)
class RejectedRows:
    """Rows of the input batch rejected for one reason."""

    reason: Reason
    detail: str
    rows: list[int]

    @property
    def count(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Validated:
    """Accepted rows (:data:`ACCEPTED_SCHEMA`) and rejected groups; together they cover every
    input row exactly once."""

    accepted: pa.Table
    rejected: list[RejectedRows]

    @property
    def quarantined(self) -> int:
        return sum(r.count for r in self.rejected)


class _CatalogMemo:
    """Per-catalog memo of name/alias → metric (a catalog is immutable once loaded)."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._by_name: dict[str, Metric | None] = {}

    def get(self, name: str) -> Metric | None:
        try:
            return self._by_name[name]
        except KeyError:
            m: Metric | None = None
            if name in self._catalog:
                m = self._catalog[name]
            if len(self._by_name) < 100_000:  # hostile input must not grow it without bound
                self._by_name[name] = m
            return m


_MEMOS: weakref.WeakKeyDictionary[Catalog, _CatalogMemo] = weakref.WeakKeyDictionary()


def lookup(catalog: Catalog, name: str) -> Metric | None:
    """The catalog entry for a name or alias, or None (memoized per catalog)."""
    memo = _MEMOS.get(catalog)
    if memo is None:
        memo = _MEMOS[catalog] = _CatalogMemo(catalog)
    return memo.get(name)


def _per_metric(metrics: list[Metric | None], idx: Array) -> dict[str, Array]:
    """Catalog attributes per distinct metric, broadcast to rows with one ``take`` each (the
    canonical name is the caller's: see :func:`_layout`)."""

    def bcast(values: list[Any], typ: pa.DataType) -> Array:
        return take(pa.array(values, typ), idx)  # idx: codes of the metrics' dictionary

    return {
        "known": bcast([m is not None for m in metrics], pa.bool_()),
        "unit": bcast([m.unit if m else None for m in metrics], pa.string()),
        "kind": bcast([KIND_CODES[m.kind] if m else None for m in metrics], pa.int8()),
        "scale": bcast([m.scale if m else None for m in metrics], pa.float64()),
        "vmin": bcast([m.valid_min if m else None for m in metrics], pa.float64()),
        "vmax": bcast([m.valid_max if m else None for m in metrics], pa.float64()),
        "max_raw": bcast([m.max_raw if m else None for m in metrics], pa.uint64()),
        "saturate": bcast(
            [bool(m and m.overflow is Overflow.SATURATE) for m in metrics], pa.bool_()
        ),
    }


def _sentinel_mask(
    metrics: list[Metric | None], idx: Array, reading: Array, text: Array
) -> Array | None:
    """Rows whose reading or text is one of their metric's sentinels (None if no row can
    be: no metric in the batch has any, or no row holds any of their values).

    One pass over the rows finds candidates, rows holding a sentinel of *any* metric of the
    batch; sentinels are rare values, so only those few rows are checked against their own
    metric's list."""
    nums = {v for m in metrics if m is not None for v in m.sentinels}
    texts = {t for m in metrics if m is not None for t in m.sentinel_texts}
    cand = None
    if nums:
        cand = pc.is_in(reading, value_set=pa.array(sorted(nums), pa.float64()))
    if texts:
        hit = pc.is_in(text, value_set=pa.array(sorted(texts), pa.string()))
        cand = hit if cand is None else pc.or_(cand, hit)
    if cand is None or not any_true(cand):
        return None
    rows = where(cand)
    sub_idx = pc.take(idx, rows)
    sub_reading, sub_text = pc.take(reading, rows), pc.take(text, rows)
    mask = None
    for j in pc.unique(sub_idx).to_pylist():
        m = metrics[j]
        if m is None or not (m.sentinels or m.sentinel_texts):
            continue
        hits = []
        if m.sentinels:
            hits.append(pc.is_in(sub_reading, value_set=pa.array(m.sentinels, pa.float64())))
        if m.sentinel_texts:
            hits.append(pc.is_in(sub_text, value_set=pa.array(m.sentinel_texts, pa.string())))
        hit = hits[0] if len(hits) == 1 else pc.or_(hits[0], hits[1])
        this = pc.and_(pc.equal(sub_idx, j), hit)
        mask = this if mask is None else pc.or_(mask, this)
    if mask is None or not any_true(mask):
        return None
    out = np.zeros(len(idx), dtype=bool)
    out[rows.filter(true_mask(mask)).to_numpy()] = True
    return pa.array(out)


@dataclass
class LayoutCache:
    """What validation derives from a batch's metric/device columns alone (one per source)."""

    metric: Array = None
    device: Array = None
    catalog: Catalog | None = None
    limits: ValidateLimits | None = None
    idx: Array = None
    metrics: list[Metric | None] = field(default_factory=list)
    attr: dict[str, Array] = field(default_factory=dict)
    is_counter: Array = None
    unknown: Array = None
    bad_device: Array = None
    row_index: Array = None
    # which metric/device columns it was derived from: a number no other fill of any cache
    # had, so two batches that found the same ``gen`` have equal columns without comparing
    # them again (the counter layouts, :class:`pipelines.refine.counters.CounterLayout`, use it)
    gen: int = 0


_GENS = itertools.count(1)


class SharedLayouts:
    """Layouts found for one source, offered to the others (a cache, not state): the sources
    of a cluster's nodes mostly send the same series in the same order (the same exporter on
    the same hardware), so a source seen for the first time, after a start or a rebalance,
    takes the layout of another instead of deriving its own. Found by a digest of the metric
    and device columns, confirmed by comparing them; at most ``size`` layouts, the oldest
    dropped first."""

    def __init__(self, size: int = 256) -> None:
        self._items: dict[tuple[int, bytes], LayoutCache] = {}
        self._size = size
        self.hits = 0

    @staticmethod
    def key(metric: Array, device: Array) -> tuple[int, bytes]:
        """A digest of two unsliced arrays' buffers (padding bytes may make equal columns
        differ here: a miss, never a wrong layout, since a hit is compared)."""
        h = hashlib.blake2b(digest_size=16)
        for arr in (metric, device):
            for buf in arr.buffers():
                h.update(b"-" if buf is None else buf)
        return len(metric), h.digest()

    def find(
        self, key: tuple[int, bytes], metric: Array, device: Array, catalog: Catalog,
        limits: ValidateLimits,
    ) -> LayoutCache | None:  # fmt: skip
        lay = self._items.get(key)
        if (
            lay is None
            or lay.catalog is not catalog
            or lay.limits != limits
            or not lay.metric.equals(metric)
            or not lay.device.equals(device)
        ):
            return None
        self.hits += 1
        return lay

    def put(self, key: tuple[int, bytes], lay: LayoutCache) -> None:
        if len(self._items) >= self._size:
            del self._items[next(iter(self._items))]
        self._items[key] = lay


def _layout(
    metric: Array,
    device: Array,
    catalog: Catalog,
    limits: ValidateLimits,
    cache: LayoutCache | None,
    shared: SharedLayouts | None = None,
) -> LayoutCache:
    if (
        cache is not None
        and cache.catalog is catalog
        and cache.limits == limits
        and cache.metric is not None
        and cache.metric.equals(metric)
        and cache.device.equals(device)
    ):
        return cache
    lay = cache if cache is not None else LayoutCache()
    key = None
    if cache is not None:  # kept: a copy, not a view that would keep a whole wave alive
        metric, device = pa.concat_arrays([metric]), pa.concat_arrays([device])
        if shared is not None:
            key = shared.key(metric, device)
            found = shared.find(key, metric, device, catalog, limits)
            if found is not None:  # its arrays are never changed: the fields are shared
                lay.__dict__.update(found.__dict__)
                lay.gen = next(_GENS)
                return lay
    enc = metric.dictionary_encode()
    lay.metric, lay.device, lay.catalog, lay.limits = metric, device, catalog, limits
    lay.gen = next(_GENS)
    lay.idx = enc.indices
    names = enc.dictionary.to_pylist()
    lay.metrics = [lookup(catalog, s) for s in names]
    lay.attr = _per_metric(lay.metrics, lay.idx)
    if all(m is None or m.name == s for m, s in zip(lay.metrics, names, strict=True)):
        # no alias: the canonical names are the column itself (a row of an unknown metric
        # keeps its name here, and is rejected)
        lay.attr["metric"] = metric
    else:
        canonical = pa.array([m.name if m else None for m in lay.metrics], pa.string())
        lay.attr["metric"] = take(canonical, lay.idx)
    lay.is_counter = true_mask(pc.equal(lay.attr["kind"], COUNTER))
    lay.unknown = pc.invert(lay.attr["known"])
    # characters never outnumber bytes: only a device of more bytes than the limit needs
    # its characters counted
    dev_len = pc.binary_length(device)
    if any_true(pc.greater(dev_len, limits.max_device_len)):
        dev_len = pc.utf8_length(device)
    lay.bad_device = pc.or_(pc.equal(dev_len, 0), pc.greater(dev_len, limits.max_device_len))
    lay.row_index = pa.array(np.arange(len(metric), dtype=np.int64))
    if key is not None and shared is not None:
        shared.put(key, copy.copy(lay))
    return lay


def _joined_layout(
    metric: Array,
    device: Array,
    catalog: Catalog,
    limits: ValidateLimits,
    parts: list[tuple[int, LayoutCache]],
    shared: SharedLayouts | None = None,
) -> LayoutCache:
    """The layout of a table of several batches from the layouts of each (``parts``: row
    count and cache, in table order), each found in or put into its own cache."""
    lays = []
    at = 0
    for rows, cache in parts:
        m, d = metric.slice(at, rows), device.slice(at, rows)
        lays.append(_layout(m, d, catalog, limits, cache, shared))
        at += rows
    if len(lays) == 1:
        return lays[0]
    out = LayoutCache(catalog=catalog, limits=limits)
    base = np.cumsum([0] + [len(x.metrics) for x in lays[:-1]])
    out.metrics = [m for x in lays for m in x.metrics]
    out.idx = pa.array(
        np.concatenate([x.idx.to_numpy() + int(b) for x, b in zip(lays, base, strict=True)])
    )
    out.attr = {k: pa.concat_arrays([x.attr[k] for x in lays]) for k in lays[0].attr}
    out.is_counter = pa.concat_arrays([x.is_counter for x in lays])
    out.unknown = pa.concat_arrays([x.unknown for x in lays])
    out.bad_device = pa.concat_arrays([x.bad_device for x in lays])
    out.row_index = pa.array(np.arange(at, dtype=np.int64))
    return out


def validate_samples(
    table: pa.Table,
    catalog: Catalog,
    now_ns: int,
    limits: ValidateLimits = ValidateLimits(),
    parts: list[tuple[int, LayoutCache]] | None = None,
    shared: SharedLayouts | None = None,
) -> Validated:
    """Check every row of a samples table (:data:`schemas.wire.SAMPLES_SCHEMA`).

    ``parts`` (optional): the table's batches in order, each as its row count and its
    source's :class:`LayoutCache`, which remembers what depends only on the batch's
    ``metric``/``device`` columns; exporters send the same series in the same order every
    scrape, so the next batch with equal columns skips that work, and the table's layout is
    its batches' put end to end. ``shared`` (optional, with ``parts``): layouts another
    source found, for a batch whose own cache has none that fits.

    Does not block or raise on any content of the table; returns accepted rows and the
    rejected row groups.
    """
    n = table.num_rows
    if n == 0:
        return Validated(ACCEPTED_SCHEMA.empty_table(), [])
    metric_col = column(table, "metric")
    device = column(table, "device")
    if parts is not None:
        lay = _joined_layout(metric_col, device, catalog, limits, parts, shared)
    else:
        lay = _layout(metric_col, device, catalog, limits, None)
    idx, metrics, attr = lay.idx, lay.metrics, lay.attr

    ts = column(table, "ts_ns")
    value = _optional(table, "value", pa.float64())
    raw = _optional(table, "raw", pa.uint64())
    text = _optional(table, "text", pa.string())
    kind = attr["kind"]
    is_counter = lay.is_counter
    raw_f = pc.cast(raw, pa.float64(), safe=False)
    reading = pc.if_else(is_counter, pc.coalesce(raw_f, value), pc.coalesce(value, raw_f))

    sentinel = _sentinel_mask(metrics, idx, reading, text)
    not_sentinel = pc.invert(true_mask(sentinel)) if sentinel is not None else None

    checks: list[Array] = [
        lay.unknown,
        lay.bad_device,
        pc.or_(pc.less(ts, now_ns - limits.past_ns), pc.greater(ts, now_ns + limits.future_ns)),
    ]
    no_reading = pc.is_null(reading)
    negative = pc.less(pc.coalesce(value, 0.0), 0.0)
    wrong = pc.or_(pc.and_(is_counter, pc.or_(pc.is_null(raw), negative)), no_reading)
    if not_sentinel is not None:
        wrong = pc.and_(pc.or_(pc.and_(is_counter, negative), wrong), not_sentinel)
    checks.append(wrong)
    non_finite = pc.invert(pc.fill_null(pc.is_finite(reading), True))
    checks.append(non_finite)
    scaled = pc.multiply(reading, attr["scale"])
    out_of_range = pc.or_(
        pc.or_(
            true_mask(pc.less(scaled, attr["vmin"])), true_mask(pc.greater(scaled, attr["vmax"]))
        ),
        true_mask(pc.greater(raw, attr["max_raw"])),
    )
    if not_sentinel is not None:
        out_of_range = pc.and_(out_of_range, not_sentinel)
    checks.append(out_of_range)

    checks = [true_mask(c) for c in checks]
    any_bad = checks[0]
    for c in checks[1:]:
        any_bad = pc.or_(any_bad, c)
    rejected: list[RejectedRows] = []
    nbad = pc.sum(any_bad).as_py() or 0
    if nbad:
        code = pa.nulls(n, pa.int8())
        for c in range(len(checks) - 1, -1, -1):  # lowest priority first: the first one wins
            code = pc.if_else(checks[c], pa.scalar(c, pa.int8()), code)
        present = pc.unique(pc.drop_null(code)).to_pylist()
        for c in sorted(present):
            rows = where(pc.equal(code, c))
            reason = REASON_ORDER[c]
            rejected.append(
                RejectedRows(
                    reason, reject_detail(reason, table, rows, limits, now_ns), rows.to_pylist()
                )
            )
    value_out = (
        pc.if_else(true_mask(sentinel), pa.scalar(None, pa.float64()), scaled)
        if sentinel is not None
        else scaled
    )
    null_reason = (
        pc.if_else(true_mask(sentinel), NullReason.SENTINEL.value, pa.scalar(None, pa.string()))
        if sentinel is not None
        else pa.nulls(n, pa.string())
    )
    acc = pa.Table.from_arrays(
        [
            lay.row_index,
            ts,
            attr["metric"],
            device,
            value_out,
            raw,
            text,
            null_reason,
            attr["unit"],
            kind,
            attr["scale"],
            attr["max_raw"],
            attr["saturate"],
        ],
        schema=ACCEPTED_SCHEMA,
    )
    if nbad:
        acc = acc.filter(pc.invert(any_bad))
    return Validated(acc, rejected)


def _optional(table: pa.Table, name: str, typ: pa.DataType) -> Array:
    if name in table.column_names:
        return column(table, name)
    return pa.nulls(table.num_rows, typ)


def reject_detail(
    reason: Reason, table: pa.Table, rows: Array, lim: ValidateLimits, now: int
) -> str:
    """A short human-readable detail for the ``rows`` of ``table`` rejected for ``reason``
    (bounded length)."""
    if reason is Reason.UNKNOWN_METRIC:
        names = pc.unique(pc.take(column(table, "metric"), rows)).to_pylist()[:5]
        return f"metrics not in the catalog: {', '.join(repr(s)[:64] for s in names)}"[:1024]
    if reason is Reason.BAD_DEVICE:
        return f"device empty or longer than {lim.max_device_len} characters"
    if reason is Reason.TIMESTAMP_OUT_OF_WINDOW:
        return f"ts_ns outside [{now - lim.past_ns}, {now + lim.future_ns}]"
    if reason is Reason.WRONG_KIND:
        names = pc.unique(pc.take(column(table, "metric"), rows)).to_pylist()[:5]
        return f"no usable reading for the metric kind (negative counter or no raw): {names}"[:1024]
    if reason is Reason.NON_FINITE:
        return "value is NaN or infinite"
    return "value outside the catalog's valid range or counter width"
