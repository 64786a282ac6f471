"""Decode and refine rates of each ingest adapter, in-process, per CPU-second.

    python -m lab.bench.ingest [--seconds 2] [--wave 300] [--hosts 100]

For each foreign format a representative message (a node's worth of CPU and network
series; dcgm-like exposition; one line or one collectd value list per message, as Telegraf
and write_kafka send them) is sent by ``--hosts`` hosts in turn. ``decode``: waves of
``--wave`` such messages decoded as the worker decodes the records of an ingest topic
partition it refines together (:meth:`schemas.ingest.IngestDecoder.decode_many`: line
protocol and collectd in one pass for the wave, the others message by message), over and
over after a first wave that warms the caches. ``refine``: a stream of such messages, each
host's a second apart, through :class:`Refiner` as the worker runs it (decode, validate,
dedupe, counters, clock, enrich, outputs) in groups of ``GROUP`` records (the first half
warms the state). Rates are samples per CPU-second of this process (``process_time``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from lab.bench.figures import BenchResult
from lab.bench.instructions import GROUP
from pipelines.refine.clock_model import DeclaredTiming
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import RefineSettings
from schemas.catalog import default_catalog
from schemas.ingest import IngestDecoder, Message, Position
from schemas.topics import TOPICS
from services.worker.clock_flags import SEND_DELAY_S
from services.worker.refiner import RawRecord, Refiner

SECOND = 1_000_000_000
CPUS, STATES = 64, ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
NETS = 8
HOST = b"b000"  # every message's host; the refine rate renames it per message (same length)


def on_host(body: bytes, k: int) -> bytes:
    """``body`` as host ``b<k>`` sent it (protobuf included: the name keeps its length)."""
    return body.replace(HOST, b"b%03d" % (k % 1000))


@dataclass(frozen=True)
class Adapter:
    name: str
    format: str
    samples: int  # per message
    message: Callable[[int, int], bytes]  # (index, ts_ns) -> body
    # messages a host sends at once, each interval: one-metric messages come as a host's
    # whole set of series (Telegraf's flush, collectd's write_kafka per read), keyed by host
    burst: int = 1

    def sent(self, i: int, hosts: int, burst: int | None = None) -> tuple[int, int, int]:
        """(host, the host's message index, its interval) of the ``i``-th message sent by
        ``hosts`` hosts in turn, each ``burst`` (default: the adapter's) messages at once."""
        b = self.burst if burst is None else burst
        host = (i // b) % hosts
        j = (i // (b * hosts)) * b + i % b
        return host, j, j // b


def _prom(i: int, ts: int) -> bytes:
    ms = ts // 1_000_000
    lines = [f'node_cpu_seconds_total{{cpu="{c}",mode="{m}"}} {1000 + i + c / 100:.2f} {ms}'
             for c in range(CPUS) for m in STATES]  # fmt: skip
    lines += [f'node_network_receive_bytes_total{{device="eth{d}"}} {10**9 + i * 4096} {ms}'
              for d in range(NETS)]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def _influx(i: int, ts: int) -> bytes:
    fields = ",".join(f"time_{m}={1000 + i}.25" for m in STATES)
    lines = [f"cpu,cpu=cpu{c},host=b000 {fields} {ts}" for c in range(CPUS)]
    lines += [f"net,interface=eth{d},host=b000 bytes_recv={10**9 + i * 4096}i,"
              f"bytes_sent={10**9 + i * 2048}i {ts}" for d in range(NETS)]  # fmt: skip
    return "\n".join(lines).encode()


def _influx_one(i: int, ts: int) -> bytes:
    fields = ",".join(f"time_{m}={1000 + i}.25" for m in STATES)
    return f"cpu,cpu=cpu{i % CPUS},host=b000 {fields} {ts}".encode()


def _collectd_one(i: int, ts: int) -> bytes:
    vl = {"values": [10**9 + i * 4096, 10**9 + i * 2048], "dstypes": ["derive", "derive"],
          "dsnames": ["rx", "tx"], "time": ts / 1e9, "interval": 1.0, "host": "b000",
          "plugin": "interface", "plugin_instance": f"eth{i % NETS}", "type": "if_octets",
          "type_instance": ""}  # fmt: skip
    return json.dumps([vl]).encode()


def _otlp_template() -> metrics_pb2.MetricsData:
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        resource=Resource.create({"host.name": "b000"}), metric_readers=[reader]
    )
    cpu = provider.get_meter("bench").create_counter("system.cpu.time", unit="s")
    otel = {"iowait": "wait", "irq": "interrupt"}  # OTel's names of the states
    for c in range(CPUS):
        for m in STATES:
            cpu.add(1.5, {"cpu": f"cpu{c}", "state": otel.get(m, m)})
    data = reader.get_metrics_data()
    assert data is not None
    provider.shutdown()
    out: metrics_pb2.MetricsData = metrics_pb2.MetricsData.FromString(
        encode_metrics(data).SerializeToString()
    )
    return out


def _otlp(template: metrics_pb2.MetricsData) -> Callable[[int, int], bytes]:
    def message(i: int, ts: int) -> bytes:
        data = metrics_pb2.MetricsData()
        data.CopyFrom(template)
        for p in data.resource_metrics[0].scope_metrics[0].metrics[0].sum.data_points:
            p.time_unix_nano = ts
            p.as_double = p.as_double + i
        body: bytes = data.SerializeToString()
        return body

    return message


def _otlp_json(proto: Callable[[int, int], bytes]) -> Callable[[int, int], bytes]:
    """The same request in the Collector's ``otlp_json`` spelling (lowerCamelCase, 64-bit
    integers as strings)."""

    def message(i: int, ts: int) -> bytes:
        data = metrics_pb2.MetricsData.FromString(proto(i, ts))
        text: str = json_format.MessageToJson(data, indent=None)
        return text.encode()

    return message


def adapters() -> list[Adapter]:
    otlp = _otlp(_otlp_template())
    return [
        Adapter("prometheus", "prometheus", CPUS * len(STATES) + NETS, _prom),
        Adapter("influx", "influx", CPUS * len(STATES) + 2 * NETS, _influx),
        Adapter("influx_one_line", "influx", len(STATES), _influx_one, burst=CPUS),
        Adapter("collectd_one_value_list", "collectd_counters", 2, _collectd_one, burst=NETS),
        Adapter("otlp_proto", "otlp", CPUS * len(STATES), otlp),
        Adapter("otlp_json", "otlp", CPUS * len(STATES), _otlp_json(otlp)),
    ]


def decode_rate(
    a: Adapter, seconds: float, wave: int = GROUP, hosts: int = 100, burst: int | None = None
) -> float:
    """Samples per CPU-second of :meth:`IngestDecoder.decode_many` on waves of ``wave``
    messages of ``a`` from ``hosts`` hosts, as the worker decodes the records of one
    partition it refines together."""
    dec = IngestDecoder({"t": a.format})
    now = time.time_ns()
    msgs: list[Message] = []
    for k in range(wave):
        host, j, _ = a.sent(k, hosts, burst)
        pos = Position(0, k, now, b"b%03d" % host)
        msgs.append((on_host(a.message(j, now), host), None, pos))
    dec.decode_many("t", msgs)  # first sight of every series: warm
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        got = dec.decode_many("t", msgs)
        assert not got.rejected, got.rejected
        n += wave
    return n * a.samples / (time.process_time() - t0)


def refine_rate(
    a: Adapter, messages: int, hosts: int = 100, burst: int | None = None, declared: bool = True
) -> float:
    """Samples per CPU-second of :class:`Refiner` on ``messages`` of ``a`` from ``hosts``
    hosts, each sending its burst of messages once a second (the first half warms the
    state). ``declared``: the topic declares its format's usual send delay, as the worker's
    ingest topics do (``refinery worker``: the clock's ``declared`` basis, docs/clock.md)."""
    start = time.time_ns() - (messages // hosts + 5) * SECOND
    recs = []
    for i in range(messages):
        host, j, second = a.sent(i, hosts, burst)
        ts = start + second * SECOND
        body = on_host(a.message(j, ts), host)
        recs.append(RawRecord("t", 0, i, b"b%03d" % host, body, [], ts // 1_000_000 + 2))
    topo = TopologyIndex([], [])
    timing = {"t": DeclaredTiming(int(SEND_DELAY_S.get(a.format, 5.0) * 1e9))}
    settings = RefineSettings(seq_window=512, declared=timing if declared else {})
    refiner = Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None,
                      lambda _: None, settings, IngestDecoder({"t": a.format}))  # fmt: skip
    half = messages // 2
    now = time.time_ns()
    for i in range(0, half, GROUP):  # first sight of every series: warm
        refiner.process_group(recs[i : min(i + GROUP, half)], now)
    t0 = time.process_time()
    for i in range(half, messages, GROUP):
        refiner.process_group(recs[i : i + GROUP], now)
    return (messages - half) * a.samples / (time.process_time() - t0)


GOAL = 0.5e6  # samples per CPU-second, decode alone, every adapter


def bench_ingest(seconds: float, messages: int) -> BenchResult:
    """``refinery bench``'s ingest figures: each adapter's decode rate (``seconds`` CPU
    seconds of it) against the goal, and its in-process refine rate on ``messages``
    messages (ten times as many one-line ones) from up to 100 hosts (each sends four bursts
    or more: the first half of a refine run warms the state, the measured half refines
    hosts seen before)."""
    r = BenchResult("ingest")
    for a in adapters():
        d = decode_rate(a, seconds)
        r.add(f"ingest_{a.name}_decode_samples_per_cpu_s", d, "samples/CPU-s", ">=", GOAL,
              note=f"IngestDecoder.decode_many on waves of {GROUP} messages from 100 hosts "
              f"(bursts of {a.burst}), {a.samples} samples a message")  # fmt: skip
        n = messages if a.samples > 64 else messages * 10
        hosts = max(1, min(100, n // (4 * a.burst)))
        r.add(f"ingest_{a.name}_refine_samples_per_cpu_s", refine_rate(a, n, hosts),
              "samples/CPU-s", note="decode, validate, dedupe, counters, clock, enrich, "
              f"outputs in-process (Refiner), {n} messages from {hosts} hosts")  # fmt: skip
        r.details[a.name] = {"samples_per_message": a.samples, "refine_messages": n,
                             "wave": GROUP, "burst": a.burst}  # fmt: skip
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per decode rate")
    p.add_argument("--messages", type=int, default=400, help="messages per refine rate")
    p.add_argument("--hosts", type=int, default=100, help="hosts sending them (100)")
    p.add_argument("--wave", type=int, default=GROUP, help=f"messages decoded at once ({GROUP})")
    p.add_argument("--interleaved", action="store_true",
                   help="hosts send one message each in turn, no bursts (worst case)")  # fmt: skip
    args = p.parse_args(argv)
    burst = 1 if args.interleaved else None
    print(f"decode: waves of {args.wave} messages from {args.hosts} hosts"
          f"{', interleaved' if args.interleaved else ''}")  # fmt: skip
    print(f"{'adapter':<26}{'samples/msg':>12}{'burst':>6}{'decode M/CPU-s':>16}"
          f"{'refine M/CPU-s':>16}")  # fmt: skip
    for a in adapters():
        d = decode_rate(a, args.seconds, args.wave, args.hosts, burst)
        n = args.messages if a.samples > 64 else args.messages * 10
        r = refine_rate(a, n, args.hosts, burst)
        b = 1 if burst else a.burst
        print(f"{a.name:<26}{a.samples:>12}{b:>6}{d / 1e6:>16.3f}{r / 1e6:>16.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
