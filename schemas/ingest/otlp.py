"""OTLP metrics, as the OpenTelemetry Collector's Kafka exporter writes them: ``otlp_proto``
(its default: a serialized ``MetricsData``/``ExportMetricsServiceRequest``) or ``otlp_json``.

A series is the metric name with the resource's and the point's attributes as labels
(``host.name`` names the node). Gauges and non-monotonic sums are gauges; monotonic
cumulative sums are counters whose start time, when the points give one, is the boot id
(a new start time is a counter reset); monotonic delta sums become rates (value / (time -
start)), never counters; histograms and summaries give ``<name>.count`` and ``<name>.sum``
as cumulative counters (delta ones as rates). Exponential histograms are not read.

JSON in the Collector's own spelling (lowerCamelCase, 64-bit integers as strings) is read
by ``json.loads`` and a walk over the dicts (~10x faster than protobuf's JSON parser, which
reads anything else).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.metrics.v1 import metrics_pb2

from schemas.errors import RejectedInput
from schemas.ingest import otlp_wire
from schemas.ingest.assemble import Points, SeriesRegistry
from schemas.ingest.mapping import SeriesKey
from schemas.reasons import Reason

DELTA = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
_DELTAS = frozenset({DELTA, "AGGREGATION_TEMPORALITY_DELTA"})
_REG = SeriesRegistry()
# (resource attributes, metric name, key suffix) -> point attribute bytes -> series id in _REG
_SIDS: dict[tuple[Any, str, str], dict[bytes, int]] = {}
_SIDS_GEN = [-1]  # the registry generation _SIDS belongs to
# one point, normalized: attributes, time, start, value (or count), exact int (or sum)
Point = tuple[list[tuple[str, str]], int, int, float, Any]
# one metric: resource attributes, name, kind (gauge | counter | rate | hist | hist_rate)
Metric = tuple[list[tuple[str, str]], str, str, list[Point]]


def _attrs(kvs: Any) -> list[tuple[str, str]]:
    out = []
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        if which in ("string_value", "int_value", "bool_value", "double_value"):
            out.append((kv.key, str(getattr(v, which))))
    return out


def _pb_points(points: Any, summed: bool) -> list[Point]:
    if summed:
        return [(_attrs(p.attributes), p.time_unix_nano, p.start_time_unix_nano, float(p.count),
                 p.sum) for p in points]  # fmt: skip
    out: list[Point] = []
    for p in points:
        is_int = p.WhichOneof("value") == "as_int"
        v = float(p.as_int) if is_int else p.as_double
        out.append((_attrs(p.attributes), p.time_unix_nano, p.start_time_unix_nano, v,
                    p.as_int if is_int else None))  # fmt: skip
    return out


def _pb_metric(res: list[tuple[str, str]], m: Any, which: str | None) -> Iterator[Metric]:
    if which == "gauge":
        yield res, m.name, "gauge", _pb_points(m.gauge.data_points, False)
    elif which == "sum":
        kind = _sum_kind(m.sum.is_monotonic, m.sum.aggregation_temporality)
        yield res, m.name, kind, _pb_points(m.sum.data_points, False)
    elif which == "histogram":
        kind = "hist_rate" if m.histogram.aggregation_temporality == DELTA else "hist"
        yield res, m.name, kind, _pb_points(m.histogram.data_points, True)
    elif which == "summary":
        yield res, m.name, "hist", _pb_points(m.summary.data_points, True)


def _pb_metrics(data: Any) -> Iterator[Metric]:
    """The generic path: every point through upb's objects."""
    for rm in data.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                yield from _pb_metric(res, m, m.WhichOneof("data"))


def _bytes_attrs(raw: bytes) -> list[tuple[str, str]] | None:
    """The attributes serialized in ``raw``; None where it holds anything else (other or
    unknown fields: ``raw`` is not what its attributes alone serialize to)."""
    p = metrics_pb2.NumberDataPoint.FromString(raw)
    only = metrics_pb2.NumberDataPoint()
    only.attributes.extend(p.attributes)
    if only.SerializeToString() != raw:
        return None
    return _attrs(p.attributes)


def _pb_fast(data: Any, c: _Collect) -> None:
    """Every metric of ``data`` into ``c``: gauges and sums from the wire where
    :func:`otlp_wire.scan` reads them, the rest as :func:`_pb_metrics` does."""
    for rm in data.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                if which not in ("gauge", "sum"):
                    for metric in _pb_metric(res, m, which):
                        c.metric(*metric)
                    continue
                body = m.gauge if which == "gauge" else m.sum
                kind = "gauge" if which == "gauge" else _sum_kind(
                    body.is_monotonic, body.aggregation_temporality)  # fmt: skip
                raw = body.SerializeToString()
                got = otlp_wire.scan(raw)
                if got is not None and c.bulk(tuple(res), m.name, kind, raw, got):
                    continue
                got = otlp_wire.scan(raw, uniform=False)
                if got is None or not c.bulk(tuple(res), m.name, kind, raw, got):
                    c.metric(res, m.name, kind, _pb_points(body.data_points, False))


def _sum_kind(monotonic: Any, temporality: Any) -> str:
    if not monotonic:
        return "gauge"
    return "rate" if temporality in _DELTAS else "counter"


_JSON_VALUES = ("stringValue", "intValue", "doubleValue", "boolValue")


def _jattrs(kvs: Any) -> list[tuple[str, str]]:
    out = []
    for kv in kvs or ():
        v = kv.get("value") or {}
        for f in _JSON_VALUES:
            if f in v:
                out.append((str(kv["key"]), str(v[f])))
                break
    return out


def _j_points(points: Any, summed: bool) -> list[Point]:
    out: list[Point] = []
    for p in points or ():
        t, s = int(p.get("timeUnixNano", 0)), int(p.get("startTimeUnixNano", 0))
        if summed:
            out.append((_jattrs(p.get("attributes")), t, s, float(p.get("count", 0)),
                        float(p.get("sum", 0.0))))  # fmt: skip
        elif "asInt" in p:
            i = int(p["asInt"])
            out.append((_jattrs(p.get("attributes")), t, s, float(i), i))
        else:
            out.append((_jattrs(p.get("attributes")), t, s, float(p.get("asDouble", 0.0)), None))
    return out


def _json_metrics(doc: Any) -> Iterator[Metric]:
    for rm in doc.get("resourceMetrics") or ():
        res = _jattrs((rm.get("resource") or {}).get("attributes"))
        for sm in rm.get("scopeMetrics") or ():
            for m in sm.get("metrics") or ():
                name = str(m.get("name", ""))
                if "gauge" in m:
                    yield res, name, "gauge", _j_points(m["gauge"].get("dataPoints"), False)
                elif "sum" in m:
                    s = m["sum"]
                    kind = _sum_kind(s.get("isMonotonic"), s.get("aggregationTemporality"))
                    yield res, name, kind, _j_points(s.get("dataPoints"), False)
                elif "histogram" in m:
                    h = m["histogram"]
                    kind = "hist_rate" if h.get("aggregationTemporality") in _DELTAS else "hist"
                    yield res, name, kind, _j_points(h.get("dataPoints"), True)
                elif "summary" in m:
                    yield res, name, "hist", _j_points(m["summary"].get("dataPoints"), True)


class _Collect:
    def __init__(self) -> None:
        self.ids = _REG.ids
        self.sids: list[int] = []
        self.ts: list[int] = []
        self.vals: list[float] = []
        self.exact: list[int] = []
        self.starts: list[int] = []
        # columns so far: sids, ts, values, exact, exact_ok
        self.chunks: list[tuple[np.ndarray, ...]] = []

    def flush(self) -> None:
        """The points added one by one so far, as a chunk of columns."""
        if self.sids:
            ok, exact = _exact(self.exact)
            self.chunks.append((np.array(self.sids, dtype=np.int64),
                                np.array(self.ts, dtype=np.int64),
                                np.array(self.vals, dtype=np.float64), exact, ok))  # fmt: skip
            self.sids, self.ts, self.vals, self.exact = [], [], [], []

    def columns(self) -> list[np.ndarray]:
        self.flush()
        if not self.chunks:
            types = (np.int64, np.int64, np.float64, np.uint64, bool)
            return [np.zeros(0, dtype=t) for t in types]
        return [np.concatenate(col) for col in zip(*self.chunks, strict=True)]

    def add(self, key: SeriesKey, ts: int, v: float, exact: int = -1) -> None:
        j = self.ids.get(key)
        self.sids.append(_REG.id_of(key) if j is None else j)
        self.ts.append(ts)
        self.vals.append(v)
        self.exact.append(exact)

    def bulk(self, res: Any, name: str, kind: str, raw: bytes, got: otlp_wire.Scan) -> bool:
        """A gauge's or sum's points as :func:`otlp_wire.scan` found them in ``raw``; False
        (nothing added) where an attribute span holds more than attributes."""
        attrs, offs, is_int = got
        cols = otlp_wire.columns(raw, offs)
        start, t = cols[:, 0].view(np.int64), cols[:, 1].view(np.int64)
        as_int = cols[:, 2].view(np.int64)
        v = np.where(is_int, as_int.astype(np.float64), cols[:, 2].view(np.float64))
        suffix = "rate" if kind == "rate" else ""
        if _SIDS_GEN[0] != _REG.generation or len(_SIDS) > _REG.limit:
            _SIDS.clear()
            _SIDS_GEN[0] = _REG.generation
        known = _SIDS.setdefault((res, name, suffix), {})
        if len(known) > _REG.limit:  # byte spellings of one attribute set are many
            known.clear()
        sids: list[int | None] = list(map(known.get, attrs))
        if None in sids:
            for k, a in enumerate(attrs):
                if sids[k] is None:
                    point = _bytes_attrs(a)
                    if point is None:
                        return False
                    labels = tuple(sorted(list(res) + point))
                    sids[k] = known[a] = _REG.id_of((name, labels, suffix))
        exact = np.full(len(sids), -1, dtype=np.int64)
        if kind == "counter":
            self.starts.extend(start[start != 0].tolist())
            ok = is_int & (as_int >= 0)
            exact[ok] = as_int[ok]
        elif kind == "rate":
            span = (t - start) / 1e9
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(span > 0, v / span, np.nan)
        self.flush()
        ok = exact >= 0
        self.chunks.append((np.array(sids, dtype=np.int64), t, v,
                            np.maximum(exact, 0).astype(np.uint64), ok))  # fmt: skip
        return True

    def metric(self, res: list[tuple[str, str]], name: str, kind: str, points: list[Point]) -> None:
        for attrs, t, start, v, extra in points:
            labels = tuple(sorted(res + attrs))
            span = (t - start) / 1e9
            if kind == "gauge":
                self.add((name, labels, ""), t, v)
            elif kind == "counter":
                if start:
                    self.starts.append(start)
                ok = extra is not None and extra >= 0
                self.add((name, labels, ""), t, v, extra if ok else -1)
            elif kind == "rate":
                self.add((name, labels, "rate"), t, v / span if span > 0 else np.nan)
            else:  # histogram or summary: count and sum
                cnt, total = v, float(extra)
                if kind == "hist_rate":
                    for suffix, x in ((".count", cnt), (".sum", total)):
                        self.add((name + suffix, labels, "rate"), t, x / span if span > 0
                                 else np.nan)  # fmt: skip
                    continue
                if start:
                    self.starts.append(start)
                self.add((name + ".count", labels, ""), t, cnt, int(cnt))
                self.add((name + ".sum", labels, ""), t, total)


def _metrics(body: bytes, as_json: bool) -> Iterator[Metric] | Any:
    """The JSON document's metrics, or the parsed protobuf ``MetricsData``."""
    try:
        if as_json:
            doc = json.loads(body)
            if isinstance(doc, dict) and "resourceMetrics" in doc:
                return _json_metrics(doc)
            data = metrics_pb2.MetricsData()
            json_format.Parse(body, data, ignore_unknown_fields=True)
        else:
            data = metrics_pb2.MetricsData()
            data.ParseFromString(body)
    except (DecodeError, json_format.ParseError, ValueError, RecursionError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not OTLP metrics: {e}"[:300]) from e
    return data


def _exact(values: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(exact_ok, exact) of the collected exact readings (-1: none)."""
    try:
        e = np.array(values, dtype=np.int64)
        return e >= 0, np.maximum(e, 0).astype(np.uint64)
    except OverflowError:  # a histogram count past 2**63
        ok = np.array([x >= 0 for x in values], dtype=bool)
        return ok, np.array([max(x, 0) for x in values], dtype=np.uint64)


def decode_otlp(body: bytes, as_json: bool | None = None, wire: bool = True) -> Points:
    """Every number point of every metric; ``as_json`` None: told by the first byte.
    ``wire``: protobuf gauges and sums read by :mod:`otlp_wire` (False: every point through
    upb's objects; the same table, ~4x slower)."""
    if as_json is None:  # a serialized MetricsData starts with field 1's tag, 0x0a ("\n")
        as_json = body[:1] in (b"{", b" ", b"\t", b"\r")
    metrics = _metrics(body, as_json)
    _REG.begin()
    c = _Collect()
    try:
        if isinstance(metrics, metrics_pb2.MetricsData) and wire:
            _pb_fast(metrics, c)
        else:
            pb = isinstance(metrics, metrics_pb2.MetricsData)
            iterate = _pb_metrics(metrics) if pb else metrics
            for res, name, kind, points in iterate:
                c.metric(res, name, kind, points)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not OTLP metrics: {e!r}"[:300]) from e
    sids, ts, vals, exact, ok = c.columns()
    boot = f"start-{min(c.starts)}" if c.starts else "ingest"
    return Points(_REG, sids, ts, vals, boot_id=boot, exact=exact, exact_ok=ok)
