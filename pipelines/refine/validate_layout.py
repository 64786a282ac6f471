"""What validation derives from a batch's metric and device columns alone: each row's
catalog entry and its attributes, the unknown-metric and bad-device masks
(:class:`LayoutCache`, kept per source, and :class:`SharedLayouts`, offered across sources),
and the kinds' codes. See :mod:`pipelines.refine.validate`."""

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

from pipelines._arrow import Array, any_true, take, true_mask
from schemas.catalog import Catalog, Kind, Metric, Overflow

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


@dataclass(frozen=True)
class ValidateLimits:
    """Bounds for sample checks. Times are ns; the window is relative to ``now_ns``."""

    past_ns: int = 7 * DAY_NS
    future_ns: int = 1 * DAY_NS
    max_device_len: int = 128


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
    canonical name is the caller's: see :func:`layout`)."""

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


def layout(
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


def joined_layout(
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
        lays.append(layout(m, d, catalog, limits, cache, shared))
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
