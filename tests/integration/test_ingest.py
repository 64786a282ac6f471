"""Foreign formats through the real broker and worker: each ingest topic's records are
refined like native ones (counters, lineage, accounting), unmapped metrics are
dead-lettered by name, and undecodable records too."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
from confluent_kafka import Producer
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from schemas.records import refined_lineage
from tests.integration.worker_helpers import accounting, fresh_topics, read_all, running_worker


def _influx(now: int) -> list[tuple[bytes | None, bytes]]:
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(3):
        ts = now - (3 - i) * 1_000_000_000
        line = f"cpu,cpu=cpu0,host=h-lp time_user={100 + i}.5,time_weird=1 {ts}\n"
        out.append((b"h-lp", line.encode()))  # Telegraf: routing_tag = "host"
    out.append((b"h-lp", b"cpu,host=h-lp this is not line protocol\n"))
    return out


def _prom(now: int) -> list[tuple[bytes | None, bytes]]:
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(3):
        ms = (now - (3 - i) * 1_000_000_000) // 1_000_000
        text = (
            "# TYPE node_cpu_seconds_total counter\n"
            f'node_cpu_seconds_total{{cpu="0",mode="user"}} {444.9 + i} {ms}\n'
            f"node_load1 0.5 {ms}\n"
        )
        out.append((b"h-prom", text.encode()))
    return out


def _collectd(now: int) -> list[tuple[bytes | None, bytes]]:
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(2):
        vl = {"values": [1000 * (i + 1), 10], "dstypes": ["derive", "derive"],
              "dsnames": ["rx", "tx"], "time": (now - (2 - i) * 10**9) / 1e9, "interval": 1.0,
              "host": "h-cd", "plugin": "interface", "plugin_instance": "eth0",
              "type": "if_octets", "type_instance": ""}  # fmt: skip
        out.append((b"h-cd", json.dumps([vl]).encode()))  # write_kafka: Key "h-cd"
    return out


def _otlp() -> list[tuple[bytes | None, bytes]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        resource=Resource.create({"host.name": "h-otel"}), metric_readers=[reader]
    )
    counter = provider.get_meter("t").create_counter("system.network.io", unit="By")
    out: list[tuple[bytes | None, bytes]] = []
    for _ in range(2):
        counter.add(5000, {"device": "eth0", "direction": "receive"})
        data = reader.get_metrics_data()
        assert data is not None
        # the Collector's Kafka exporter: partition_metrics_by_resource_attributes
        out.append((b"h-otel", encode_metrics(data).SerializeToString()))
        time.sleep(0.2)
    provider.shutdown()
    return out


def _produce(bootstrap: str, topic: str, items: list[tuple[bytes | None, bytes]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for key, value in items:  # no headers: the topic says the format
        p.produce(topic, value, key=key)
    assert p.flush(30) == 0


def test_every_ingest_format_is_refined_accounted_and_traced(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    now = time.time_ns()
    sent = {
        "telemetry.ingest.influx": _influx(now),
        "telemetry.ingest.prom": _prom(now),
        "telemetry.ingest.collectd": _collectd(now),
        "telemetry.ingest.otlp": _otlp(),
    }
    total = sum(len(v) for v in sent.values())
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        for topic, items in sent.items():
            _produce(kafka_bootstrap, prefix + topic, items)
        acc = accounting(kafka_bootstrap, prefix, expect=total)
        assert len(acc) == total, w.tail()
        for a in acc:  # input = refined + deduplicated + quarantined, per record
            assert a["input_samples"] == sum(
                int(a[k])  # type: ignore[call-overload]
                for k in ("refined_samples", "duplicate_samples", "quarantined_samples")
            )
        by_topic: dict[str, list[str]] = {}
        for a in acc:
            by_topic.setdefault(str(a["raw_topic"])[len(prefix) :], []).append(str(a["outcome"]))
        assert sorted(by_topic["telemetry.ingest.influx"]) == ["deadletter"] + ["refined"] * 3
        assert by_topic["telemetry.ingest.prom"] == ["refined"] * 3
        assert by_topic["telemetry.ingest.collectd"] == ["refined"] * 2
        assert by_topic["telemetry.ingest.otlp"] == ["refined"] * 2
        refined = read_all(kafka_bootstrap, prefix + "telemetry.refined", idle=4)
        rows = pa.concat_tables([pa.ipc.open_stream(v).read_all() for _, v, _ in refined])
        got = rows.select(["node", "metric", "device", "delta", "exporter"]).to_pylist()
        lineage = {e["raw_topic"] for _, _, hs in refined for e in refined_lineage(hs)}
        assert {prefix + t for t in sent} <= lineage
        deltas = {(r["node"], r["metric"]): r["delta"] for r in got if r["delta"] is not None}
        # USER_HZ ticks: a second of user time per interval, in seconds, exact
        assert deltas[("h-lp", "cpu.user_seconds")] == 1.0
        assert deltas[("h-prom", "cpu.user_seconds")] == 1.0
        assert deltas[("h-otel", "net.rx_bytes")] == 5000.0
        rates = [r for r in got if r["metric"] == "net.rx_bytes_rate" and r["node"] == "h-cd"]
        assert len(rates) == 2 and all(r["delta"] is None for r in rates)  # never a counter
        assert {r["exporter"] for r in got} == {"telegraf", "prometheus", "collectd", "otlp"}
        dl_topic = prefix + "telemetry.deadletter"
        dls = [json.loads(v) for _, v, _ in read_all(kafka_bootstrap, dl_topic, idle=3)]
        unknown = [d for d in dls if d["reason"] == "unknown_metric"]
        assert any("cpu.time_weird" in d["detail"] for d in unknown)
        assert any(d["reason"] == "undecodable" for d in dls)
