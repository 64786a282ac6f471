"""Real third-party producers, installed from Debian as a user would (.ci/run): collectd's
write_kafka, node_exporter scraped by ``refinery export scrape`` and pushed with kcat. The
oracle is this machine's own /proc/stat and /proc/net/dev, polled while they run: every
refined reading lies between two polls taken around its timestamp. Skipped where the
binaries are absent."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.integration.worker_helpers import accounting, fresh_topics, read_all, running_worker

BRACKET_NS = 300_000_000  # a producer reads /proc within this of the time it stamps


class ProcPoller:
    """(time, cpu0 user ticks, lo rx bytes, all CPUs' user ticks) every 20 ms, from /proc
    directly."""

    def __init__(self) -> None:
        self.polls: list[tuple[int, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            stat = Path("/proc/stat").read_text().splitlines()
            cpu0 = next(x for x in stat if x.startswith("cpu0 ")).split()
            cpu = next(x for x in stat if x.startswith("cpu ")).split()
            dev = Path("/proc/net/dev").read_text().splitlines()
            lo = next(x for x in dev if x.strip().startswith("lo:")).split(":", 1)[1].split()
            self.polls.append((time.time_ns(), int(cpu0[1]), int(lo[0]), int(cpu[1])))
            time.sleep(0.02)

    def __enter__(self) -> ProcPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def bracket(self, ts: int, field: int) -> tuple[int, int]:
        """The /proc values polled just before ``ts - BRACKET`` and just after ``ts + BRACKET``."""
        before = [p[field] for p in self.polls if p[0] <= ts - BRACKET_NS]
        after = [p[field] for p in self.polls if p[0] >= ts + BRACKET_NS]
        assert before and after, "the poller did not cover the reading"
        return before[-1], after[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _refined(bootstrap: str, prefix: str) -> list[dict[str, object]]:
    got = read_all(bootstrap, prefix + "telemetry.refined", idle=5)
    tables = [pa.ipc.open_stream(v).read_all() for _, v, _ in got]
    return pa.concat_tables(tables).to_pylist() if tables else []


def _collectd_conf(tmp: Path, name: str, bootstrap: str, topic: str, rates: bool) -> Path:
    conf = tmp / f"{name}.conf"
    conf.write_text(f"""Interval 1
Hostname "{name}"
FQDNLookup false
BaseDir "{tmp}"
PIDFile "{tmp}/{name}.pid"
PluginDir "/usr/lib/collectd"
TypesDB "/usr/share/collectd/types.db"
LoadPlugin cpu
LoadPlugin interface
LoadPlugin write_kafka
<Plugin cpu>
  ReportByCpu true
  ReportByState true
  ValuesPercentage false
</Plugin>
<Plugin interface>
  Interface "lo"
</Plugin>
<Plugin write_kafka>
  Property "metadata.broker.list" "{bootstrap}"
  <Topic "{topic}">
    Format JSON
    StoreRates {"true" if rates else "false"}
    Key "{name}"
  </Topic>
</Plugin>
""")
    return conf


def _inside_their_bound(rows: list[dict[str, object]]) -> None:
    """Every row of a producer on this host (the broker's clock: true offset 0) lies within
    its stated bound: ``|ts - ts_source| <= clock_error_ns``."""
    assert rows
    out = [r for r in rows if abs(r["ts"] - r["ts_source"]) > r["clock_error_ns"]]  # type: ignore[operator]
    why = [(r["clock_basis"], r["ts"] - r["ts_source"], r["clock_error_ns"], r["metric"])  # type: ignore[operator]
           for r in out[:8]]  # fmt: skip
    assert not out, (len(out), len(rows), why)


@contextmanager
def _running(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.mark.skipif(
    shutil.which("collectd") is None or not Path("/usr/lib/collectd/write_kafka.so").exists(),
    reason="collectd-core with write_kafka (and librdkafka1) not installed",
)
def test_collectd_counters_and_rates_against_proc(kafka_bootstrap: str, tmp_path: Path) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    counters_topic = prefix + "telemetry.ingest.collectd_counters"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    new = NewTopic(counters_topic, num_partitions=8, replication_factor=1,
                   config={"message.timestamp.type": "LogAppendTime"})  # fmt: skip
    admin.create_topics([new])[counters_topic].result()
    counters = _collectd_conf(tmp_path, "cd-counters", kafka_bootstrap, counters_topic, False)
    rates = _collectd_conf(
        tmp_path, "cd-rates", kafka_bootstrap, prefix + "telemetry.ingest.collectd", True
    )
    extra = ["--ingest", "telemetry.ingest.collectd_counters=collectd_counters"]
    with ProcPoller() as proc, running_worker(kafka_bootstrap, prefix, tmp_path, extra=extra):
        time.sleep(0.5)
        with _running(["collectd", "-f", "-C", str(rates)], tmp_path / "rates.log"):
            with _running(["collectd", "-f", "-C", str(counters)], tmp_path / "c1.log"):
                time.sleep(4.5)
            # a restart of collectd mid-run: the kernel's counters go on
            with _running(["collectd", "-f", "-C", str(counters)], tmp_path / "c2.log"):
                time.sleep(4.5)
        time.sleep(1.0)
        acc = accounting(kafka_bootstrap, prefix, expect=10_000, timeout=15)
        rows = _refined(kafka_bootstrap, prefix)
    assert acc and all(
        a["input_samples"]
        == a["refined_samples"]
        + a["duplicate_samples"]  # type: ignore[operator]
        + a["quarantined_samples"]
        for a in acc
    )
    cpu = [r for r in rows if r["node"] == "cd-counters" and r["metric"] == "cpu.user_seconds"
           and r["device"] == "cpu0"]  # fmt: skip
    lo = [r for r in rows if r["node"] == "cd-counters" and r["metric"] == "net.rx_bytes"
          and r["device"] == "lo"]  # fmt: skip
    assert len(cpu) >= 6 and len(lo) >= 6, (len(cpu), len(lo))
    for r in cpu:  # USER_HZ ticks, exactly as /proc/stat had them around that time
        lo_v, hi_v = proc.bracket(int(r["ts_source"]), 1)  # type: ignore[call-overload]
        assert lo_v <= r["raw"] <= hi_v  # type: ignore[operator]
    for r in lo:
        lo_v, hi_v = proc.bracket(int(r["ts_source"]), 2)  # type: ignore[call-overload]
        assert lo_v <= r["raw"] <= hi_v  # type: ignore[operator]
    deltas = [r["delta"] for r in cpu + lo if r["delta"] is not None]
    assert deltas and min(deltas) >= 0  # type: ignore[type-var]
    assert not any(r["reset"] for r in cpu + lo)  # the restart reset nothing: never negative
    # collectd and the broker share this host's clock: the true offset is 0, inside every
    # row's bound (declared: collectd sends as it reads; docs/clock.md)
    _inside_their_bound([r for r in rows if r["node"] in ("cd-counters", "cd-rates")])
    # StoreRates true: rates, never taken for counters
    rated = [r for r in rows if r["node"] == "cd-rates"]
    assert {"net.rx_bytes_rate", "cpu.user_percent"} <= {r["metric"] for r in rated}
    assert all(r["delta"] is None and r["raw"] is None for r in rated)
    assert not any(r["metric"] in ("net.rx_bytes", "cpu.user_seconds") for r in rated)


@pytest.mark.skipif(
    shutil.which("prometheus-node-exporter") is None or shutil.which("kcat") is None,
    reason="prometheus-node-exporter and kcat not installed",
)
def test_node_exporter_scraped_and_pushed_against_proc(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    ne = ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}",
          "--collector.disable-defaults", "--collector.cpu", "--collector.netdev"]  # fmt: skip
    raw = prefix + "telemetry.raw"
    scrape = [sys.executable, "-m", "services.cli", "export", "scrape", "--target", url,
              "--node", "ne-scrape", "--interval", "1s", "--topic", raw]  # fmt: skip
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    pushed: list[tuple[int, int]] = []  # the window of each pushed exposition's fetch
    with ProcPoller() as proc, running_worker(kafka_bootstrap, prefix, tmp_path):
        with _running(ne, tmp_path / "ne.log"):
            time.sleep(1.0)
            scraper = subprocess.Popen(scrape, env=env, stderr=subprocess.DEVNULL)
            try:
                for i in range(3):
                    start = time.time_ns()
                    body = urllib.request.urlopen(url, timeout=5).read()
                    pushed.append((start, time.time_ns()))
                    f = tmp_path / f"exposition-{i}.txt"
                    f.write_bytes(body)  # kcat sends each file as one message
                    topic = prefix + "telemetry.ingest.prom"
                    subprocess.run(["kcat", "-P", "-b", kafka_bootstrap, "-t", topic,
                                    "-k", "ne-kcat", str(f)], check=True, timeout=30)  # fmt: skip
                    time.sleep(1.0)
                # the scraper's greeting (a batch without rows) and its first three scrapes
                read_all(kafka_bootstrap, raw, until=4, timeout=90)
            finally:
                scraper.send_signal(signal.SIGTERM)
                scraper.wait(30)
        time.sleep(1.0)
        rows = _refined(kafka_bootstrap, prefix)
    scraped = [r for r in rows if r["node"] == "ne-scrape" and r["metric"] == "cpu.user_seconds"
               and r["device"] == "cpu0"]  # fmt: skip
    assert len(scraped) >= 3
    for r in scraped:  # node_exporter's float seconds x100: the ticks /proc/stat had
        lo_v, hi_v = proc.bracket(int(r["ts_source"]), 1)  # type: ignore[call-overload]
        assert lo_v <= r["raw"] <= hi_v  # type: ignore[operator]
    assert all(r["delta"] >= 0 for r in scraped if r["delta"] is not None)  # type: ignore[operator]
    assert all(r["exporter"] == "scrape" and r["clock_error_ns"] >= 0 for r in scraped)  # type: ignore[operator]
    _inside_their_bound([r for r in rows if r["node"] in ("ne-scrape", "ne-kcat")])
    kcat = [r for r in rows if r["node"] == "ne-kcat" and r["metric"] == "cpu.user_seconds"
            and r["device"] == "cpu0"]  # fmt: skip
    assert len(kcat) == 3
    for r, (start, end) in zip(sorted(kcat, key=lambda r: r["raw"]), pushed, strict=True):  # type: ignore[arg-type, return-value]
        lo_v = proc.bracket(start, 1)[0]
        hi_v = proc.bracket(end, 1)[1]
        assert lo_v <= r["raw"] <= hi_v  # type: ignore[operator]
    rx = [r for r in rows if r["node"] == "ne-kcat" and r["metric"] == "net.rx_bytes"]
    assert rx and all(r["delta"] >= 0 for r in rx if r["delta"] is not None)  # type: ignore[operator]
