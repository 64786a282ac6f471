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
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

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
        "load_vs_max",
        "pipeline_max_samples_per_s",
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
        "pipeline_max_samples_per_s",
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
    assert "| worker_throughput | worker_to_ceiling_ratio " in p.stdout
    # on a cluster it does not own, the run deletes the topics it created (Faust's included)
    raw = benches["worker_throughput"]["details"]["publish"]["topics"]["raw"]
    prefix = raw.removesuffix("telemetry.raw")
    assert prefix.startswith("bench") and prefix != raw
    assert "bench: deleted this run's" in p.stderr
    left = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30).topics
    assert not [t for t in left if t.startswith(prefix)]
