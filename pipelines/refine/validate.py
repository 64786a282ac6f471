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

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, true_mask, where
from pipelines.refine.validate_layout import (
    BITMASK,
    COUNTER,
    DAY_NS,
    ENUM,
    KIND_CODES,
    LayoutCache,
    SharedLayouts,
    ValidateLimits,
    joined_layout,
    layout,
    lookup,
)
from schemas.catalog import Catalog, Metric
from schemas.reasons import NullReason, Reason

# the layouts, limits and kind codes live in validate_layout; importers may take them here
__all__ = [
    "ACCEPTED_SCHEMA",
    "BITMASK",
    "COUNTER",
    "DAY_NS",
    "ENUM",
    "KIND_CODES",
    "REASON_ORDER",
    "LayoutCache",
    "RejectedRows",
    "SharedLayouts",
    "ValidateLimits",
    "Validated",
    "lookup",
    "reject_detail",
    "validate_samples",
]

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
        lay = joined_layout(metric_col, device, catalog, limits, parts, shared)
    else:
        lay = layout(metric_col, device, catalog, limits, None)

    ts = column(table, "ts_ns")
    value = _optional(table, "value", pa.float64())
    raw = _optional(table, "raw", pa.uint64())
    text = _optional(table, "text", pa.string())
    raw_f = pc.cast(raw, pa.float64(), safe=False)
    reading = pc.if_else(lay.is_counter, pc.coalesce(raw_f, value), pc.coalesce(value, raw_f))
    sentinel = _sentinel_mask(lay.metrics, lay.idx, reading, text)
    scaled = pc.multiply(reading, lay.attr["scale"])
    window = pc.or_(pc.less(ts, now_ns - limits.past_ns), pc.greater(ts, now_ns + limits.future_ns))
    checks = _checks(lay, window, value, raw, reading, scaled, sentinel)
    any_bad, rejected = _rejected(table, checks, limits, now_ns)
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
    attr = lay.attr
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
            attr["kind"],
            attr["scale"],
            attr["max_raw"],
            attr["saturate"],
        ],
        schema=ACCEPTED_SCHEMA,
    )
    if rejected:
        acc = acc.filter(pc.invert(any_bad))
    return Validated(acc, rejected)


def _checks(
    lay: LayoutCache,
    window: Array,
    value: Array,
    raw: Array,
    reading: Array,
    scaled: Array,
    sentinel: Array | None,
) -> list[Array]:
    """One mask per reason of :data:`REASON_ORDER`, in that order (``window``: rows whose
    ``ts_ns`` is outside the time window; a sentinel row is neither of the wrong kind nor out
    of range)."""
    is_counter, attr = lay.is_counter, lay.attr
    not_sentinel = pc.invert(true_mask(sentinel)) if sentinel is not None else None
    no_reading = pc.is_null(reading)
    negative = pc.less(pc.coalesce(value, 0.0), 0.0)
    wrong = pc.or_(pc.and_(is_counter, pc.or_(pc.is_null(raw), negative)), no_reading)
    if not_sentinel is not None:
        wrong = pc.and_(pc.or_(pc.and_(is_counter, negative), wrong), not_sentinel)
    non_finite = pc.invert(pc.fill_null(pc.is_finite(reading), True))
    out_of_range = pc.or_(
        pc.or_(
            true_mask(pc.less(scaled, attr["vmin"])), true_mask(pc.greater(scaled, attr["vmax"]))
        ),
        true_mask(pc.greater(raw, attr["max_raw"])),
    )
    if not_sentinel is not None:
        out_of_range = pc.and_(out_of_range, not_sentinel)
    checks = [lay.unknown, lay.bad_device, window, wrong, non_finite, out_of_range]
    return [true_mask(c) for c in checks]


def _rejected(
    table: pa.Table, checks: list[Array], limits: ValidateLimits, now_ns: int
) -> tuple[Array, list[RejectedRows]]:
    """Which rows fail any check, and the rejected groups: each row under the first reason
    it fails."""
    any_bad = checks[0]
    for c in checks[1:]:
        any_bad = pc.or_(any_bad, c)
    rejected: list[RejectedRows] = []
    nbad = pc.sum(any_bad).as_py() or 0
    if nbad:
        code = pa.nulls(table.num_rows, pa.int8())
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
    return any_bad, rejected


DETAIL_MAX = 1024  # a dead letter's detail (schemas.records.DeadLetter)


def named_within(prefix: str, names: list[str], limit: int = DETAIL_MAX) -> str:
    """``prefix`` and every one of ``names``, or as many as fit within ``limit`` characters
    followed by how many more there are: never a silent cut.

    >>> named_within("m: ", ["alpha", "beta", "gamma"], limit=20)
    'm: alpha and 2 more'
    """
    out = prefix + ", ".join(names)
    if len(out) <= limit:
        return out
    shown: list[str] = []
    for i, name in enumerate(names):
        tail = f" and {len(names) - i - 1} more"
        if len(prefix) + len(", ".join([*shown, name])) + len(tail) > limit:
            break
        shown.append(name)
    return f"{prefix}{', '.join(shown)} and {len(names) - len(shown)} more"


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
        names = sorted(pc.unique(pc.take(column(table, "metric"), rows)).to_pylist())
        return named_within("metrics not in the catalog: ", [repr(s)[:64] for s in names])
    if reason is Reason.BAD_DEVICE:
        return f"device empty or longer than {lim.max_device_len} characters"
    if reason is Reason.TIMESTAMP_OUT_OF_WINDOW:
        return f"ts_ns outside [{now - lim.past_ns}, {now + lim.future_ns}]"
    if reason is Reason.WRONG_KIND:
        names = sorted(pc.unique(pc.take(column(table, "metric"), rows)).to_pylist())
        prefix = "no usable reading for the metric kind (negative counter or no raw): "
        return named_within(prefix, [repr(s)[:64] for s in names])
    if reason is Reason.NON_FINITE:
        return "value is NaN or infinite"
    return "value outside the catalog's valid range or counter width"
