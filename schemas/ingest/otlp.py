"""OTLP metrics, as the OpenTelemetry Collector's Kafka exporter writes them: ``otlp_proto``
(its default: a serialized ``MetricsData``/``ExportMetricsServiceRequest``) or ``otlp_json``.

A series is the metric name with the resource's and the point's attributes as labels
(``host.name`` names the node). Gauges and non-monotonic sums are gauges; monotonic
cumulative sums are counters whose start time, when the points give one, is the boot id
(a new start time is a counter reset); monotonic delta sums become rates (value / (time -
start)), never counters; histograms and summaries give ``<name>.count`` and ``<name>.sum``
as cumulative counters (delta ones as rates). Exponential histograms are not read.
"""

from __future__ import annotations

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


def _attrs(kvs: Any) -> list[tuple[str, str]]:
    out = []
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        if which in ("string_value", "int_value", "bool_value", "double_value"):
            out.append((kv.key, str(getattr(v, which))))
    return out


_REG = SeriesRegistry()


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


def _number(c: _Collect, name: str, res: list[tuple[str, str]], points: Any, kind: str) -> None:
    """Gauge or sum points; ``kind``: gauge, counter, rate."""
    for p in points:
        labels = tuple(sorted(res + _attrs(p.attributes)))
        is_int = p.WhichOneof("value") == "as_int"
        v = float(p.as_int) if is_int else p.as_double
        if kind == "rate":
            span = (p.time_unix_nano - p.start_time_unix_nano) / 1e9
            c.add((name, labels, "rate"), p.time_unix_nano, v / span if span > 0 else np.nan)
            continue
        if kind == "counter" and p.start_time_unix_nano:
            c.starts.append(p.start_time_unix_nano)
        ex = p.as_int if is_int and kind == "counter" and p.as_int >= 0 else -1
        c.add((name, labels, ""), p.time_unix_nano, v, ex)


def _summed(c: _Collect, name: str, res: list[tuple[str, str]], points: Any, delta: bool) -> None:
    for p in points:
        labels = tuple(sorted(res + _attrs(p.attributes)))
        span = (p.time_unix_nano - p.start_time_unix_nano) / 1e9
        for suffix, v in ((".count", float(p.count)), (".sum", p.sum)):
            if delta:
                c.add((name + suffix, labels, "rate"), p.time_unix_nano, v / span if span > 0
                      else np.nan)  # fmt: skip
            else:
                if p.start_time_unix_nano:
                    c.starts.append(p.start_time_unix_nano)
                c.add((name + suffix, labels, ""), p.time_unix_nano, v,
                      int(p.count) if suffix == ".count" else -1)  # fmt: skip


def _metric(c: _Collect, m: Any, res: list[tuple[str, str]]) -> None:
    which = m.WhichOneof("data")
    if which == "gauge":
        _number(c, m.name, res, m.gauge.data_points, "gauge")
    elif which == "sum":
        s = m.sum
        kind = "gauge" if not s.is_monotonic else "rate" if s.aggregation_temporality == DELTA \
            else "counter"  # fmt: skip
        _number(c, m.name, res, s.data_points, kind)
    elif which == "histogram":
        h = m.histogram
        _summed(c, m.name, res, h.data_points, h.aggregation_temporality == DELTA)
    elif which == "summary":
        _summed(c, m.name, res, m.summary.data_points, False)


def _parse(body: bytes, as_json: bool) -> Any:
    data = metrics_pb2.MetricsData()
    try:
        if as_json:
            json_format.Parse(body, data, ignore_unknown_fields=True)
        else:
            data.ParseFromString(body)
    except (DecodeError, json_format.ParseError, ValueError, RecursionError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not OTLP metrics: {e}"[:300]) from e
    return data


def decode_otlp(body: bytes, as_json: bool | None = None) -> Points:
    """Every number point of every metric; ``as_json`` None: told by the first byte."""
    if as_json is None:  # a serialized MetricsData starts with field 1's tag, 0x0a ("\n")
        as_json = body[:1] in (b"{", b" ", b"\t", b"\r")
    data = _parse(body, as_json)
    _REG.begin()
    c = _Collect()
    for rm in data.resource_metrics:
        res = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                _metric(c, m, res)
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
