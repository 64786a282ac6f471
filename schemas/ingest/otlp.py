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
from schemas.ingest.assemble import Points, SeriesRegistry
from schemas.ingest.mapping import SeriesKey
from schemas.reasons import Reason

DELTA = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
_DELTAS = frozenset({DELTA, "AGGREGATION_TEMPORALITY_DELTA"})
_REG = SeriesRegistry()
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


def _pb_metrics(data: Any) -> Iterator[Metric]:
    for rm in data.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
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

    def add(self, key: SeriesKey, ts: int, v: float, exact: int = -1) -> None:
        j = self.ids.get(key)
        self.sids.append(_REG.id_of(key) if j is None else j)
        self.ts.append(ts)
        self.vals.append(v)
        self.exact.append(exact)

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


def _metrics(body: bytes, as_json: bool) -> Iterator[Metric]:
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
    return _pb_metrics(data)


def decode_otlp(body: bytes, as_json: bool | None = None) -> Points:
    """Every number point of every metric; ``as_json`` None: told by the first byte."""
    if as_json is None:  # a serialized MetricsData starts with field 1's tag, 0x0a ("\n")
        as_json = body[:1] in (b"{", b" ", b"\t", b"\r")
    metrics = _metrics(body, as_json)
    _REG.begin()
    c = _Collect()
    try:
        for res, name, kind, points in metrics:
            c.metric(res, name, kind, points)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not OTLP metrics: {e!r}"[:300]) from e
    ok = np.array([e >= 0 for e in c.exact], dtype=bool)
    exact = np.array([max(e, 0) for e in c.exact], dtype=np.uint64)
    boot = f"start-{min(c.starts)}" if c.starts else "ingest"
    return Points(
        _REG,
        np.array(c.sids, dtype=np.int64),
        np.array(c.ts, dtype=np.int64),
        np.array(c.vals, dtype=np.float64),
        boot_id=boot,
        exact=exact,
        exact_ok=ok,
    )
