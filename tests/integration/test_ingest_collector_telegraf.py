"""The OpenTelemetry Collector (contrib v0.160.0: hostmetrics, resourcedetection, batch,
kafka) and Telegraf v1.37.2 (its generated default configuration, jittered flushes), built
from the Go module proxy by ``python -m lab.producers.build`` (.ci/run does, cached), run
against the session broker and the worker as a site runs them.

Checked against this machine's /proc/stat (cpu0's user ticks, polled every 20 ms: each
refined reading lies between the polls taken 0.3 s around its timestamp) and against the
shared clock: producer and broker read this host's clock, so the true offset is 0 and
every row must hold it inside its bound, and no ``clock_offset`` alert may fire. Skipped,
saying how to build them, where the binaries are not in the producers' cache."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from lab.producers.build import OTELCOL, TELEGRAF, Producer, cached, default_root
from tests.integration.test_ingest_real import ProcPoller, _inside_their_bound, _refined, _running
from tests.integration.worker_helpers import accounting, fresh_topics, read_all, running_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CLAIM_NS = 1_000_000_000  # the clock_offset rule's threshold (docs/clock.md)
# which refined CPU time rows a producer gives, and the ProcPoller field they must match:
# cpu0's user ticks, and the host's (Telegraf's cpu-total is device `all`; the Collector's
# points without a `cpu` attribute, its default since v0.160.0, are mapped to `node`)
Cpu = tuple[tuple[str, ...], int]
CPU0: Cpu = (("cpu0",), 1)
TOTAL: Cpu = (("all", "node"), 3)


def _binary(p: Producer) -> Path:
    root = default_root(os.environ)
    exe = cached(p, root)
    if exe is None:
        pytest.skip(
            f"{p.name} {p.version} not built in {root} (REFINERY_PRODUCERS_DIR): "
            f"`python -m lab.producers.build {p.name}` needs Go and the Go module proxy"
        )
    return exe


def _json_records(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [json.loads(v) for _, v, _ in read_all(bootstrap, topic, idle=3) if v is not None]


def _checked(
    bootstrap: str, prefix: str, topic: str, poller: ProcPoller, cpus: tuple[Cpu, ...]
) -> None:
    """What both producers must give: every record accounted for, at most 1 % of the
    samples unmapped, the user seconds of ``cpus`` as /proc/stat had them, every row inside
    its bound, no clock claim."""
    raws = read_all(bootstrap, prefix + topic, idle=3)
    assert raws, "the producer published nothing"
    acc = accounting(bootstrap, prefix, expect=len(raws), timeout=90)
    assert len(acc) == len(raws), (len(acc), len(raws))
    for a in acc:  # input = refined + deduplicated + quarantined, per record
        assert a["input_samples"] == sum(
            int(a[k])  # type: ignore[call-overload]
            for k in ("refined_samples", "duplicate_samples", "quarantined_samples")
        ), a
    total = sum(int(a["input_samples"]) for a in acc)  # type: ignore[call-overload]
    dls = _json_records(bootstrap, prefix + "telemetry.deadletter")
    unknown = [d for d in dls if d["reason"] == "unknown_metric"]
    names = sorted({n for d in unknown for n in re.findall(r"'([^']+)'", d["detail"])})
    share = sum(d["samples"] for d in unknown) / total
    print(f"{topic}: {len(raws)} records, {total} samples, unknown_metric {share:.2%} {names}")
    assert share <= 0.01, (share, [d["detail"] for d in unknown[:3]])
    assert not [d for d in dls if d["reason"] == "bad_envelope"], dls[:3]

    rows = _refined(bootstrap, prefix)
    host = socket.gethostname()
    assert rows and {r["node"] for r in rows} == {host}, {r["node"] for r in rows}
    user = [r for r in rows if r["metric"] == "cpu.user_seconds"]
    for devices, field in cpus:
        cpu = [r for r in user if r["device"] in devices]
        assert len(cpu) >= 6, (devices, len(cpu), {r["device"] for r in user})
        for r in cpu:  # float seconds x100: the USER_HZ ticks /proc/stat had around then
            lo_v, hi_v = poller.bracket(int(r["ts_source"]), field)  # type: ignore[call-overload]
            assert lo_v <= r["raw"] <= hi_v, (r["device"], lo_v, r["raw"], hi_v)  # type: ignore[operator]
        assert all(r["delta"] >= 0 for r in cpu if r["delta"] is not None)  # type: ignore[operator]
    _inside_their_bound(rows)
    # the offset is 0: no row may claim it beyond the threshold, no alert may fire
    claims = [
        (r["clock_basis"], r["clock_offset_ns"], r["clock_error_ns"], r["metric"])
        for r in rows
        if abs(r["clock_offset_ns"]) - r["clock_error_ns"] > CLAIM_NS  # type: ignore[arg-type]
    ]
    assert not claims, (len(claims), claims[:8])
    alerts = _json_records(bootstrap, prefix + "telemetry.alerts")
    assert not [a for a in alerts if a["rule"] == "clock_offset"], alerts[:3]
    bounds = sorted(int(r["clock_error_ns"]) for r in rows)  # type: ignore[call-overload]
    basis = {str(b) for b in (r["clock_basis"] for r in rows)}
    print(f"{topic}: {len(rows)} rows, bound p50 {bounds[len(bounds) // 2] / 1e6:.0f} ms, "
          f"max {bounds[-1] / 1e6:.0f} ms, basis {sorted(basis)}")  # fmt: skip


def _collector_config(bootstrap: str, topic: str, encoding: str, per_cpu: bool) -> str:
    """docs/ingest.md's Collector configuration at a 1 s collection interval; ``per_cpu``
    opts in to the ``cpu`` attribute of ``system.cpu.time`` (else the host's total)."""
    cpu = "{metrics: {system.cpu.time: {attributes: [cpu, state]}}}" if per_cpu else "{}"
    return f"""receivers:
  hostmetrics:
    collection_interval: 1s
    scrapers: {{cpu: {cpu}, disk: {{}}, filesystem: {{}}, load: {{}}, memory: {{}},
               network: {{}}, paging: {{}}, processes: {{}}, system: {{}}}}
processors:
  resourcedetection:
    detectors: [system]
    system:
      hostname_sources: [os]
  batch: {{}}
exporters:
  kafka:
    brokers: ["{bootstrap}"]
    metrics:
      topic: {topic}
      encoding: {encoding}
    partition_metrics_by_resource_attributes: true
service:
  telemetry:
    metrics: {{level: none}}  # no :8888 listener
  pipelines:
    metrics:
      receivers: [hostmetrics]
      processors: [resourcedetection, batch]
      exporters: [kafka]
"""


@pytest.mark.parametrize(
    ("encoding", "per_cpu"),
    [("otlp_proto", False), ("otlp_json", True)],
    ids=["otlp_proto-host_total", "otlp_json-per_cpu"],
)
def test_collector_hostmetrics_against_proc_and_clock(
    kafka_bootstrap: str, tmp_path: Path, encoding: str, per_cpu: bool
) -> None:
    exe = _binary(OTELCOL)
    prefix = fresh_topics(kafka_bootstrap)
    topic = "telemetry.ingest.otlp"
    conf = tmp_path / "otelcol.yaml"
    conf.write_text(_collector_config(kafka_bootstrap, prefix + topic, encoding, per_cpu))
    devices = (CPU0,) if per_cpu else (TOTAL,)
    _run_and_check(kafka_bootstrap, prefix, topic, tmp_path, [str(exe), "--config", str(conf)],
                   10, devices)  # fmt: skip


def _run_and_check(
    bootstrap: str, prefix: str, topic: str, tmp_path: Path, cmd: list[str], seconds: float,
    devices: tuple[Cpu, ...],
) -> None:  # fmt: skip
    """Run the producer ``cmd`` for ``seconds`` into a running worker, then check what the
    worker made of it (:func:`_checked`), printing the producer's and worker's logs if not."""
    log = tmp_path / "producer.log"
    with ProcPoller() as proc, running_worker(bootstrap, prefix, tmp_path) as w:
        time.sleep(0.5)
        with _running(cmd, log) as producer:
            time.sleep(seconds)
            assert producer.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)
        try:
            _checked(bootstrap, prefix, topic, proc, devices)
        except AssertionError:
            print(log.read_text()[-3000:], w.tail(), sep="\n")
            raise


def _telegraf_config(exe: Path, bootstrap: str, topic: str) -> str:
    """Telegraf's generated defaults for the built plugins, pointed at ``topic``: 1 s
    collection, flushes every 5 s jittered by up to 2 s (rows wait up to ~7 s), and the
    cpu plugin's cumulative times on (``collect_cpu_time``) for the /proc check."""
    filters = "cpu:mem:disk:diskio:net:system:kernel:processes:swap"
    text = subprocess.run(
        [str(exe), "--input-filter", filters, "--output-filter", "kafka", "config"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    for old, new in (
        (r'^  interval = "10s"$', '  interval = "1s"'),
        (r'^  flush_interval = "10s"$', '  flush_interval = "5s"'),
        (r'^  flush_jitter = "0s"$', '  flush_jitter = "2s"'),
        (r'^  brokers = \["localhost:9092"\]$', f'  brokers = ["{bootstrap}"]'),
        (r'^  topic = "telegraf"$', f'  topic = "{topic}"'),
        (r'^  # data_format = "influx"$', '  data_format = "influx"'),
        (r"^  collect_cpu_time = false$", "  collect_cpu_time = true"),
    ):
        text, n = re.subn(old, new, text, flags=re.M)
        assert n == 1, (old, n)  # the generated defaults changed: look again
    assert re.search(r'^  routing_tag = "host"$', text, flags=re.M)  # keyed by host
    return text


def test_telegraf_jittered_flushes_against_proc_and_clock(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    exe = _binary(TELEGRAF)
    prefix = fresh_topics(kafka_bootstrap)
    topic = "telemetry.ingest.influx"
    conf = tmp_path / "telegraf.conf"
    conf.write_text(_telegraf_config(exe, kafka_bootstrap, prefix + topic))
    _run_and_check(kafka_bootstrap, prefix, topic, tmp_path, [str(exe), "--config", str(conf)],
                   12, (CPU0, TOTAL))  # fmt: skip
