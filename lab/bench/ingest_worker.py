"""End-to-end worker rate of each ingest format: a backlog on the format's ingest topic, one
worker (a subprocess, as deployed), its CPU seconds per refined sample.

    REFINERY_BOOTSTRAP_SERVERS=host:port python -m lab.bench.ingest_worker [--warm] [ADAPTER ...]

Topics are created under a fresh prefix. The worker's CPU (utime + stime from /proc) is
counted from its first accounting record on, so start-up is left out; with ``--warm``, from
the first after every host's first burst (one-line messages: 300 hosts x 64 lines), so
what is timed is a worker that knows its sources' series and state, as one running for
hours does, not the first sight of each. Adapters are those of
:mod:`lab.bench.ingest`, sent by 100 hosts (one-line messages by 300), as a site's
agents would send them: one-metric messages in each host's burst of its series (Telegraf's
flush, a line per CPU; collectd's value list per interface), keyed by host.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, Producer

from lab.bench.faust_floor import floor
from lab.bench.figures import BenchResult
from lab.bench.ingest import SECOND, Adapter, adapters, on_host, refine_rate
from services.topics import apply_topics, load_topic_specs

TOPICS = {"prometheus": "telemetry.ingest.prom", "influx": "telemetry.ingest.influx",
          "otlp": "telemetry.ingest.otlp", "collectd": "telemetry.ingest.collectd",
          "collectd_counters": "telemetry.ingest.collectd"}  # fmt: skip
# collectd_counters values go to the collectd topic, declared StoreRates true: read as rates


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _backlog(bootstrap: str, topic: str, a: Adapter, n: int, hosts: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    start = time.time_ns() - (n // hosts + 5) * SECOND
    bodies: dict[int, bytes] = {}  # each host's message j is message j renamed: made once
    for i in range(n):
        host, j, second = a.sent(i, hosts)
        body = bodies.get(j)
        if body is None:
            body = bodies[j] = a.message(j, start + second * SECOND)
        while True:
            try:
                p.produce(topic, on_host(body, host), key=b"b%03d" % host)
                break
            except BufferError:  # the producer's queue is full: let it drain
                p.poll(0.1)
        p.poll(0)
    p.flush(120)


ONE_LINE_GOAL = 300e3  # samples per worker CPU-second, one-metric messages (issue #43)
BATCHED_GOAL = 500e3  # and batched formats
FLOOR_RECORDS = 60_000  # records the Faust floor is measured over (~7 CPU-s here)
MIN_CPU_S = 2.0  # worker CPU a figure rests on: ticks of 10 ms and start-up effects vanish
MAX_BACKLOG_BYTES = 256 << 20


def sized(a: Adapter, least: int, hosts: int) -> int:
    """Messages of ``a`` for about ``MIN_CPU_S`` * 1.25 of worker CPU or more (at least
    ``least``), from its in-process refine rate, within ``MAX_BACKLOG_BYTES`` of backlog.
    The worker's rate is lower (Kafka I/O, accounting records): 0.6-0.75 of it for large
    messages, 0.3-0.5 for one-metric ones, which therefore need only half as many."""
    one_line = a.samples <= 64
    probe = 10 * hosts if one_line else 2 * hosts
    rate = refine_rate(a, probe, hosts) / (2 if one_line else 1)
    want = math.ceil(MIN_CPU_S * 1.25 * rate / a.samples)
    return max(least, min(want, _cap(a)))


def _cap(a: Adapter) -> int:
    """The most messages of ``a`` within ``MAX_BACKLOG_BYTES``."""
    return MAX_BACKLOG_BYTES // max(1, len(a.message(0, time.time_ns())))


@dataclass(frozen=True)
class Timed:
    """What the worker did from its first accounting record on."""

    records: int
    cpu_s: float
    refined_samples: int
    outcomes: dict[str | None, int]


def one_line_backlog(bootstrap: str, n: int, prefix: str | None = None) -> str:
    """``n`` one-line messages (Telegraf's shape, from 300 hosts) on the line-protocol topic
    under ``prefix`` (None: topics created under a fresh one); returns the topic."""
    if prefix is None:
        prefix = f"b{uuid.uuid4().hex[:8]}."
        apply_topics({"bootstrap.servers": bootstrap}, load_topic_specs(prefix=prefix))
    a = next(x for x in adapters() if x.name == "influx_one_line")
    topic = prefix + TOPICS[a.format]
    _backlog(bootstrap, topic, a, n, 300)
    return topic


def worker_rate(
    bootstrap: str, a: Adapter, n: int, hosts: int, prefix: str | None = None, warm: int = 0
) -> Timed:
    """The worker's records, CPU seconds and refined samples from its first accounting
    record on (``warm`` > 0: from the first after ``warm`` records, when every host has
    sent its first burst and its series, streams and state are known), of ``n`` messages
    of ``a``, on the topics under ``prefix`` (None: created here under a fresh one)."""
    if prefix is None:
        prefix = f"b{uuid.uuid4().hex[:8]}."
        apply_topics({"bootstrap.servers": bootstrap}, load_topic_specs(prefix=prefix))
    _backlog(bootstrap, prefix + TOPICS[a.format], a, n, hosts)
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "services.cli", "worker", "--topic-prefix", prefix,
               "--app-id", prefix + "worker", "--web-port", "0", "--data-dir", tmp]  # fmt: skip
        w = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": prefix + "count",
                      "auto.offset.reset": "earliest"})  # fmt: skip
        c.subscribe([prefix + "telemetry.accounting"])
        got, first, cpu0, refined = 0, 0, None, 0
        outcomes: Counter[str | None] = Counter()
        deadline = time.monotonic() + 600
        try:
            while got < n and time.monotonic() < deadline:
                # one at a time until the first: the CPU is counted from it on
                got_now = c.consume(1000 if cpu0 is not None or got + 1000 < warm else 1, 0.5)
                docs = [json.loads(m.value() or b"{}") for m in got_now if m.error() is None]
                if cpu0 is not None:
                    outcomes.update(d.get("outcome") or d.get("reason") for d in docs)
                    refined += sum(int(d.get("refined_samples") or 0) for d in docs)
                got += len(docs)
                if cpu0 is None and got and got >= warm:
                    cpu0, first = _cpu_s(w.pid), got
            cpu = _cpu_s(w.pid) - (cpu0 or 0.0)
        finally:
            c.close()
            w.terminate()
            w.wait(60)
    return Timed(got - first, cpu, refined, dict(outcomes))


def _start(bootstrap: str, prefix: str, tmp: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap}
    cmd = [sys.executable, "-m", "services.cli", "worker", "--topic-prefix", prefix,
           "--app-id", prefix + "worker", "--web-port", "0", "--data-dir", tmp]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def freshness(bootstrap: str, a: Adapter, rate: float, seconds: float, hosts: int) -> list[int]:
    """The worker's latency (ms: its accounting record's time minus the raw record's append
    time) of each of ``rate`` messages a second of ``a`` sent for ``seconds`` by ``hosts``
    hosts in turn, each stamped when sent, once the worker has refined a first one."""
    prefix = f"b{uuid.uuid4().hex[:8]}."
    apply_topics({"bootstrap.servers": bootstrap}, load_topic_specs(prefix=prefix))
    topic = prefix + TOPICS[a.format]
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": prefix + "count",
                  "auto.offset.reset": "earliest"})  # fmt: skip
    c.subscribe([prefix + "telemetry.accounting"])
    with tempfile.TemporaryDirectory() as tmp:
        w = _start(bootstrap, prefix, tmp)
        try:
            p.produce(topic, on_host(a.message(0, time.time_ns()), 0), key=b"b000")
            p.flush(30)
            while not any(m.error() is None for m in c.consume(10, 0.5)):
                pass  # the worker is up and has refined its first record
            n, t0 = int(rate * seconds), time.monotonic()
            for k in range(n):
                time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
                host, j, _ = a.sent(k, hosts)
                body = a.message(a.burst + j, time.time_ns())
                p.produce(topic, on_host(body, host), key=b"b%03d" % host)
                p.poll(0)
            p.flush(30)
            lat: list[int] = []
            deadline = time.monotonic() + 120
            while len(lat) < n and time.monotonic() < deadline:
                for m in c.consume(1000, 0.5):
                    value = m.value()
                    if m.error() is None and value is not None:
                        append_ms = json.loads(value)["append_ms"]
                        lat.append(m.timestamp()[1] - int(append_ms))
            return lat
        finally:
            c.close()
            w.terminate()
            w.wait(60)


def bench_ingest_worker(k: Any, messages: int) -> BenchResult:
    """``refinery bench``'s end-to-end figure of each adapter: the worker's samples per
    CPU-second on a backlog from 100 hosts (one-line messages: from 300) sized for about
    ``MIN_CPU_S`` of worker CPU (:func:`sized`; at least ``messages`` messages, one-line
    ones ten times as many), each adapter on topics of its own. A run that measures under
    3/4 of ``MIN_CPU_S`` is run once more, its backlog scaled up; one that still does
    reports no figure (N/A) and says why."""
    r = BenchResult("ingest_worker")
    if messages <= 0:
        r.skipped = "quick and full runs only: a smaller backlog is refined before it is timed"
        return r
    for a in adapters():
        one_line = a.samples <= 64
        least, hosts = (messages * 10, 300) if one_line else (messages, 100)
        n, cap = sized(a, least, hosts), _cap(a)
        w = worker_rate(k.kafka.bootstrap_servers, a, n, hosts, k.fresh_topics())
        if w.cpu_s < MIN_CPU_S * 0.75 and n < cap:  # the estimate was high: once more, larger
            n = min(cap, math.ceil(n * MIN_CPU_S * 1.25 / max(w.cpu_s, 0.05)))
            w = worker_rate(k.kafka.bootstrap_servers, a, n, hosts, k.fresh_topics())
        records, cpu = w.records, w.cpu_s
        if records < n // 2 or cpu <= 0 or w.refined_samples < records * a.samples // 2:
            raise RuntimeError(f"{a.name}: {records} of {n} records timed ({cpu:.2f} CPU-s), "
                               f"{w.refined_samples} samples refined: {w.outcomes}")  # fmt: skip
        as_rates = " (read as rates, as the topic declares)" * (a.format == "collectd_counters")
        rate, why = w.refined_samples / cpu, ""
        if cpu < MIN_CPU_S * 0.75:  # too little work to time: no figure, and why
            rate = float("nan")
            capped = f", the backlog capped at {MAX_BACKLOG_BYTES >> 20} MiB" * (n >= cap)
            why = (f"; N/A: {cpu:.2f} CPU-s is too little to time (under "
                   f"{MIN_CPU_S * 0.75:.1f}){capped}")  # fmt: skip
        goal = ONE_LINE_GOAL if one_line else BATCHED_GOAL
        r.add(f"ingest_{a.name}_worker_samples_per_cpu_s", rate, "samples/CPU-s", ">=", goal,
              note=f"refined samples of a worker subprocess, {records} of {n} records after "
              f"its first, {cpu:.1f} CPU-s{as_rates}{why}")  # fmt: skip
        r.details[a.name] = {"messages": n, "hosts": hosts, "records": records, "cpu_s": cpu,
                             "refined": w.refined_samples, "outcomes": w.outcomes}  # fmt: skip
    f = floor(k.kafka.bootstrap_servers, one_line_backlog(k.kafka.bootstrap_servers,
              FLOOR_RECORDS, k.fresh_topics()), FLOOR_RECORDS)  # fmt: skip
    r.add("ingest_faust_floor_us_per_record", f.us_per_record, "µs/record",
          note=f"CPU of a process whose Faust agent only takes and acks one-line records in "
          f"the worker's groups ({f.records} records, {f.cpu_s:.1f} CPU-s; "
          f"lab.bench.faust_floor): the least a worker on Faust's stream spends")  # fmt: skip
    for a in adapters():
        if a.samples <= 64 and a.format in TOPICS:
            r.add(f"ingest_{a.name}_faust_ceiling_samples_per_cpu_s",
                  a.samples / f.us_per_record * 1e6, "samples/CPU-s",
                  note=f"{a.samples} samples a record over the floor above: the most any "
                  "refining on Faust's stream reaches with this shape")  # fmt: skip
    r.details["faust_floor"] = {"records": f.records, "cpu_s": f.cpu_s}
    return r


def main(argv: list[str] | None = None) -> int:
    bootstrap = os.environ.get("REFINERY_BOOTSTRAP_SERVERS")
    if not bootstrap:
        print("ingest_worker: set REFINERY_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 2
    names = argv if argv is not None else sys.argv[1:]
    if names and names[0] == "--freshness":  # --freshness ADAPTER RATE [SECONDS]
        a = next(x for x in adapters() if x.name == names[1])
        seconds = float(names[3]) if len(names) > 3 else 20.0
        lat = sorted(freshness(bootstrap, a, float(names[2]), seconds, 300))
        q = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else -1
        print(
            f"{a.name} at {names[2]} records/s: {len(lat)} records, worker latency p50 "
            f"{lat[len(lat) // 2] if lat else -1} ms, p99 {q} ms, max {lat[-1] if lat else -1} ms"
        )
        return 0
    warm = "--warm" in names  # time each host's later bursts only (its state known)
    names = [x for x in names if x != "--warm"]
    for a in adapters():
        if (names and a.name not in names) or a.format not in TOPICS:
            continue
        one_line = a.samples <= 64
        hosts = 300 if one_line else 100
        n, first = (6000 if one_line else 600), 0
        if warm:  # a first interval of every host, then two timed
            first = hosts * a.burst
            n = max(n, 3 * first)
        w = worker_rate(bootstrap, a, n, hosts, warm=first)
        records, cpu = w.records, w.cpu_s
        rate = w.refined_samples / cpu if cpu else float("nan")
        per_s = records / cpu if cpu else float("nan")
        print(f"{a.name:<20} {records} records, worker {cpu:.1f} CPU-s: {rate / 1e6:.3f} M "
              f"samples per worker CPU-s, {per_s:.0f} records per CPU-s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
