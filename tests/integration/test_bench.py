"""`refinery bench --smoke --json FILE` against the session broker: every benchmark runs at
tiny sizes and every named figure and ratio is there and numeric, with versions and machine
facts. No thresholds: it measures (the figures of record come from `refinery bench`). SASL is
left to tests/integration/test_sasl_bench.py, which runs it on its own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer
from confluent_kafka.admin import AdminClient

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import Topics, publish
from lab.simulate.truth import load_truth
from pipelines.clock_bounds import exchanges_of, hard_interval
from schemas.codec import content_type_of, decode
from schemas.errors import RejectedInput
from services.settings import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
INGEST_ADAPTERS = ("prometheus", "influx", "influx_one_line", "collectd_one_value_list",
                   "otlp_proto", "otlp_json")  # fmt: skip

FIGURES = {
    "worker_throughput": [
        "simulator_publish_samples_per_s",
        "ceiling_samples_per_s",
        "ceiling_cpu_s_per_million",
        "worker_samples_per_s",
        "worker_cpu_s_per_million",
        "worker_to_ceiling_ratio",
        "worker_records_accounted_share",
        "worker_rows_clock_exchange_share",
        "worker_steady_samples_per_s",
        "worker_steady_to_ceiling_ratio",
        "decode_only_samples_per_cpu_s",
        "refiner_samples_per_cpu_s",
        "bench_refine_samples_per_s",
        "worker_cpu_to_refiner_cpu_ratio",
        "refiner_cpu_to_ceiling_ratio",
        "worker_main_thread_busy",
        "machine_idle_cores",
    ],
    "refine_memory": [
        "refine_peak_rss_gib",
        "refine_bytes_per_series",
        "refine_rss_gib_projected_1m_series",
    ],
    "clock": [
        "clock_p99_abs_error_ms",
        "clock_within_bound_share",
        "clock_growing_delays_within_bound_share",
        "clock_flag_batches_max",
    ],
    "freshness": [
        "refined_p99_s",
        "refined_newest_p99_s",
        "refined_warm_p99_s",
        "duckdb_p99_s",
        "load_vs_worker_max",
        "worker_alone_refined_p99_s",
        "worker_alone_spread_refined_p99_s",  # (0.5 s spread: not smoke)
        "worker_alone_spread_refined_warm_p99_s",
        "worker_alone_worker_p99_s",  # raw append → accounting append: what the worker adds
        "worker_alone_spread_worker_p99_s",
        "worker_alone_200ms_max_samples_per_s",  # the worker's maximum at 0.2 s records
        "worker_alone_200ms_refined_p99_s",  # at half that maximum
    ],
    "lake": [
        "landing_to_write_table_ratio",
        "bytes_per_sample_compacted",
        "queries_compacted_to_single_file_ratio",
        "small_file_penalty",
        "query_slowest_compacted_s",
    ],
    "exporter": ["exporter_cpu_ms_per_scrape", "exporter_core_share_at_1s_pct"],
    "alert_latency": [
        "alert_p50_s",
        "alert_p99_s",
        "straggler_with_cause_p99_s",
        "incidents",
        "incidents_without_alert",
        "half_load_alert_p99_s",  # the freshness run's, next to the floor run's
    ],
    "alert_accuracy": ["precision", "recall"],
    # every adapter's decode rate (goal >= 0.5 M samples per CPU-second) and its refine rate
    # in-process; the end-to-end worker rates (ingest_worker) are quick and full runs only
    "ingest": [
        f"ingest_{a}_{what}_samples_per_cpu_s"
        for a in INGEST_ADAPTERS
        for what in ("decode", "refine")
    ],
    "alert_accuracy_loaded": [
        "within_bound_share",
        "clock_err_p99_ms",
        "clock_bound_p99_ms",
        "precision",
        "incident_recall",
        "lost",
        "duplicated",
    ],
}


def test_bench_smoke_reports_every_figure(kafka_bootstrap: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {
        **os.environ,
        "REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REFINERY_HOME": str(tmp_path / "home"),
    }
    args = ["bench", "--smoke", "--json", str(out), "--only", ",".join(FIGURES)]
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=REPO,
    )
    assert out.exists(), p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"python", "pyarrow", "duckdb", "faust-streaming", "aiokafka"} <= set(doc["versions"])
    assert {"confluent-kafka", "librdkafka", "kafka_broker"} <= set(doc["versions"])
    assert {"cpu_model", "cores", "ram_gib"} <= set(doc["machine"])
    benches = doc["benchmarks"]
    for bench, names in FIGURES.items():
        b = benches[bench]
        assert b["error"] is None, (bench, b["error"], p.stderr[-3000:])
        for name in names:
            v = b["figures"][name]["value"]
            assert isinstance(v, int | float) and math.isfinite(v), (bench, name, v)
        # each progress line names the benchmark as it starts and ends
        assert f"bench: {bench}" in p.stderr
    # the results table is on stdout, one row per figure
    assert "| worker_throughput | worker_to_ceiling_ratio |" in p.stdout
    # on a cluster it does not own, the run deletes the topics it created (Faust's included)
    raw = benches["worker_throughput"]["details"]["publish"]["topics"]["raw"]
    prefix = raw.removesuffix("telemetry.raw")
    assert prefix.startswith("bench") and prefix != raw
    assert "bench: deleted this run's" in p.stderr
    left = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30).topics
    assert not [t for t in left if t.startswith(prefix)]


def test_backlog_preload_carries_the_exchanges_of_its_timeline(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """The throughput benchmark's preload (speed 0, CreateTime stamped with the simulated
    arrival): every batch carries exchanges on its own record's partition, and the bound they
    give holds its node's true clock offset, clock steps and late batches included."""
    create_time = {"message.timestamp.type": "CreateTime", "max.message.bytes": "16777216"}
    topics = Topics(
        raw=unique_topic("raw", partitions=3, config=create_time),
        events=unique_topic("events", partitions=2, config=create_time),
        collectives=unique_topic("coll", partitions=2, config=create_time),
        topology=unique_topic("topology"),
        jobs=unique_topic("jobs"),
    )
    sim = Simulation(
        Cluster.build(6, seed=5),
        "clock,late:rate=0.05,delay=2",
        seed=5,
        start_ns=time.time_ns() - 20 * 1_000_000_000,
        duration_ns=12 * 1_000_000_000,
    )
    truth_path = tmp_path / "truth.parquet"
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    rep = publish(sim, kafka, topics, truth_path, speed=0, progress_cb=None, stamp_due=True)
    assert rep.unacked == 0
    sends = {(s["partition"], s["offset"]): s for s in load_truth(truth_path).sends.to_pylist()
             if s["topic"] == topics.raw}  # fmt: skip
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": unique_group,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})  # fmt: skip
    c.subscribe([topics.raw])
    seen, deadline = 0, time.monotonic() + 60
    batches = late = cleared = 0
    clocks = sim.clocks

    def stepped(i: int, t: int) -> bool:  # node i's clock stepped within 2 s before t
        steps = zip(clocks.step_node, clocks.step_at, strict=True)
        return any(n == i and t - 2 * 10**9 <= at <= t for n, at in steps)

    try:
        while seen < len(sends) and time.monotonic() < deadline:
            for m in c.consume(500, 1.0):
                if m.error() is not None:
                    continue
                seen += 1
                s = sends[(m.partition(), m.offset())]
                assert m.timestamp() == (TIMESTAMP_CREATE_TIME, s["due_true_ns"] // 1_000_000)
                try:
                    env = decode(m.value(), content_type_of(m.headers())).envelope
                except RejectedInput:
                    continue
                if s["kind"] not in ("batch", "late"):
                    continue
                batches += 1
                late += s["kind"] == "late"
                assert env.clock is not None
                i = sim.cluster.node_names.index(s["node"])
                if not env.clock.exchanges:  # its clock stepped: the exchanges before are void
                    assert stepped(i, s["sent_true_ns"]), s
                    cleared += 1
                    continue
                ex = exchanges_of(env.clock.exchanges)
                assert max(ex, key=lambda e: e.sent_ns).partition == m.partition()
                bound = hard_interval(ex, env.sent_ns)
                assert bound is not None
                true_offset = int(sim.clocks.offsets(s["sent_true_ns"])[i])
                assert bound[0] <= true_offset <= bound[1], (s, bound, true_offset)
    finally:
        c.close()
    assert seen == len(sends) and batches > 60 and late > 0 and cleared < batches / 20
    assert len(sim.clocks.step_node) > 0  # the run stepped clocks
