"""OTLP protobuf's wire reader (schemas/ingest/otlp_wire.py) gives the same points as the
generic path through upb's objects: on requests the OpenTelemetry SDK's own encoder wrote,
and on points laid out otherwise (no start time, flags, exemplars, unknown fields), which
take the field-by-field or the generic path."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2

from schemas import ingest
from schemas.ingest import IngestDecoder, Position
from schemas.ingest.otlp import decode_otlp
from schemas.ingest.otlp_wire import scan

NOW = time.time_ns()


def _sdk(delta: bool, rounds: int = 3) -> list[bytes]:
    """Collections of the SDK's instruments (int and float counters, up-down counters,
    gauges, histograms), encoded by its own OTLP encoder."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    t = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    reader = InMemoryMetricReader(
        preferred_temporality={Counter: t, Histogram: t, UpDownCounter: t}
    )
    res = Resource.create({"host.name": "g7", "host.cpus": 64, "k8s.ok": True})
    provider = MeterProvider(resource=res, metric_readers=[reader])
    meter = provider.get_meter("t")
    cpu = meter.create_counter("system.cpu.time", unit="s")
    net = meter.create_counter("system.network.io", unit="By")
    queue = meter.create_up_down_counter("system.queue")
    util = meter.create_gauge("hw.gpu.utilization", unit="1")
    lat = meter.create_histogram("rpc.duration", unit="ms")
    out = []
    for i in range(rounds):
        for c in range(4):
            for state in ("user", "system", "idle"):
                cpu.add(0.5 + c, {"cpu": f"cpu{c}", "state": state, "weight": 1.5})
        net.add(2**40 + i, {"device": "ib0", "direction": "transmit", "n": 3})
        queue.add(-2 * i, {"q": "a"})
        util.set(0.25 * (i + 1), {"hw.id": "gpu3"})
        util.set(0.0, {"hw.id": "gpu4"})
        lat.record(5.0 + i)
        data = reader.get_metrics_data()
        assert data is not None
        out.append(encode_metrics(data).SerializeToString())
    provider.shutdown()
    return out


def _same(body: bytes) -> None:
    fast, slow = decode_otlp(body, False, wire=True), decode_otlp(body, False, wire=False)
    keys = fast.series.keys
    assert [keys[i] for i in fast.gid] == [keys[i] for i in slow.gid]
    for col in ("ts", "value", "exact", "exact_ok"):
        a, b = getattr(fast, col), getattr(slow, col)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), col
    assert fast.boot_id == slow.boot_id
    assert len(fast.gid) > 0


def test_sdk_requests_decode_the_same_on_the_wire_and_through_upb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for delta in (False, True):
        for body in _sdk(delta):
            _same(body)
    # and as a whole record: the same refined table
    dec = IngestDecoder({"otlp": "otlp"})
    body = _sdk(False)[2]
    a = dec.decode("otlp", body, None, Position(0, 1, NOW, None))
    monkeypatch.setattr(ingest, "decode_otlp", functools.partial(decode_otlp, wire=False))
    b = dec.decode("otlp", body, None, Position(0, 1, NOW, None))
    assert a.table.equals(b.table) and a.envelope == b.envelope


def _kv(key: str, v: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=v))


def _request(
    points: list[metrics_pb2.NumberDataPoint], monotonic: bool = True, delta: bool = False
) -> bytes:
    t = (
        metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
        if delta
        else metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
    )
    s = metrics_pb2.Sum(is_monotonic=monotonic, aggregation_temporality=t)
    s.data_points.extend(points)
    data = metrics_pb2.MetricsData()
    rm = data.resource_metrics.add()
    rm.resource.attributes.append(_kv("host.name", "n1"))
    rm.scope_metrics.add().metrics.append(metrics_pb2.Metric(name="system.cpu.time", sum=s))
    out: bytes = data.SerializeToString()
    return out


def _p(**kw: Any) -> metrics_pb2.NumberDataPoint:
    p = metrics_pb2.NumberDataPoint(time_unix_nano=NOW, start_time_unix_nano=NOW - 10**9, **kw)
    p.attributes.extend([_kv("cpu", "cpu0"), _kv("state", "user")])
    return p


def test_points_laid_out_otherwise_take_the_slower_paths_with_the_same_result() -> None:
    flags = _p(as_double=2.5, flags=1)  # flags follow the attributes
    no_start = metrics_pb2.NumberDataPoint(time_unix_nano=NOW, as_int=7)
    no_start.attributes.append(_kv("cpu", "cpu1"))
    bare = metrics_pb2.NumberDataPoint(time_unix_nano=NOW)  # no value, no attributes
    ex = _p(as_int=-3)
    ex.exemplars.add(as_double=1.0, time_unix_nano=NOW)
    zero_span = metrics_pb2.NumberDataPoint(time_unix_nano=NOW, start_time_unix_nano=NOW)
    zero_span.as_double = 3.0
    zero_span.attributes.append(_kv("cpu", "cpu2"))
    cases = [
        [_p(as_double=0.0), _p(as_int=2**62), _p(as_int=-3), _p(as_double=float("nan"))],
        [flags],
        [no_start, bare],
        [ex],
        [zero_span],
    ]
    for points in cases:
        for monotonic, delta in ((True, False), (True, True), (False, False)):
            _same(_request(points, monotonic, delta))
    # an unknown field in a point (a newer schema): kept by upb, never read as attributes
    one = _p(as_double=4.0).SerializeToString() + b"\x78\x05"  # field 15, varint 5
    body = _request([metrics_pb2.NumberDataPoint.FromString(one)])
    _same(body)


def test_scan_reads_the_sdk_layout_in_bulk_and_the_rest_field_by_field() -> None:
    raw = metrics_pb2.Sum(data_points=[_p(as_double=1.0), _p(as_int=5)]).SerializeToString()
    got = scan(raw)
    assert got is not None
    attrs, offs, is_int = got
    assert len(attrs) == 2 and attrs[0] == attrs[1] and list(is_int) == [False, True]
    slow = scan(raw, uniform=False)
    assert slow is not None and slow[0] == attrs and np.array_equal(slow[1], offs)
    ex = _p(as_double=1.0)
    ex.exemplars.add(as_double=1.0)
    raw = metrics_pb2.Sum(data_points=[ex]).SerializeToString()
    # in bulk, what follows the value is taken for attributes (the caller checks it holds
    # only them, see the test above); field by field, the exemplar sends it to upb's path
    bulk = scan(raw)
    assert bulk is not None and bulk[0][0][:1] == b"\x2a"  # exemplars' tag
    assert scan(raw, uniform=False) is None
