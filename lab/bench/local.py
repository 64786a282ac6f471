"""Benchmarks that need no Kafka: refiner memory, clock alignment, the lake, the node
exporter, and (when its module exists) SASL_SSL against plaintext."""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from lab.bench.figures import BenchResult
from lab.bench.harness import percentile
from lab.bench.machine import REPO
from lab.ttar import extract

GIB = 2**30
S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S
SYSFS_PROCFS = REPO / "tests" / "fixtures" / "real-data" / "sysfs-procfs"


def bench_refine_memory(sources: int, series_per_source: int = 1000) -> BenchResult:
    """Peak RSS of a subprocess holding ``sources x series_per_source`` live counter series."""
    r = BenchResult("refine_memory")
    out = subprocess.run(
        [sys.executable, "-m", "lab.bench.memory_child", str(sources), str(series_per_source)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
        check=True,
    )
    d: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    series = int(d["series"])
    per_series = (d["rss_bytes"] - d["baseline_rss_bytes"]) / series
    r.add(
        "refine_peak_rss_gib",
        d["peak_rss_bytes"] / GIB,
        "GiB",
        "<=",
        1.5,
        note=f"{series:,} live series",
    )
    r.add(
        "refine_bytes_per_series",
        per_series,
        "B/series",
        note="RSS growth over the baseline / series",
    )
    r.add(
        "refine_rss_gib_projected_1m_series",
        (d["baseline_rss_bytes"] + per_series * 1e6) / GIB,
        "GiB",
        "<=",
        1.5,
        note="baseline + 1,000,000 x bytes/series",
    )
    r.details.update(d)
    return r


class _Source:
    """A source clock: offset + drift, one batch per second, delay = base + Exp(mu)
    (the model of tests/unit/test_clock.py); from batch ``onset`` on, ``rate`` seconds more
    per second (a host or link loaded more and more)."""

    def __init__(
        self,
        rng: random.Random,
        off0: float,
        ppm: float,
        base: float,
        mu: float,
        onset: int = 0,
        rate: float = 0.0,
    ):
        self.rng, self.off0, self.drift, self.base, self.mu = rng, off0, ppm * 1e-6, base, mu
        self.onset, self.rate = onset, rate
        self.i = 0

    def offset(self, t_true: float) -> float:
        return self.off0 + self.drift * (t_true - T0)

    def next_pair(self) -> tuple[int, int, int]:
        t = T0 + self.i * S + self.rng.randint(0, 100 * MS)
        self.i += 1
        load = max(0, self.i - 1 - self.onset) * self.rate * S if self.rate else 0.0
        return (
            round(t + self.offset(t)),
            round(t + self.base + load + self.rng.expovariate(1 / self.mu)),
            t,
        )


def bench_clock(sources: int, batches: int = 240, seed: int = 0) -> BenchResult:
    """p99 |aligned - true| after convergence over sources with offsets up to ±1 h, drift
    ±200 ppm, base delay 0.2-2 ms and exponential jitter (mean 1-5 ms), and the share within
    the stated error bound; the same share for such sources whose delays grow by 100-1000
    µs a second from a batch between 40 and 120 on (150 batches from then); and batches
    until a source more than 1 s off is flagged."""
    import pyarrow as pa

    from pipelines.refine.clock import ClockEstimator, align

    rng = random.Random(seed)
    errs: list[float] = []
    within = loaded_within = loaded = 0
    flagged: list[int] = []
    for _ in range(sources):
        src = _Source(
            rng,
            rng.uniform(-3600 * S, 3600 * S),
            rng.uniform(-200, 200),
            rng.uniform(0.2 * MS, 2 * MS),
            rng.uniform(1 * MS, 5 * MS),
        )
        est = ClockEstimator()
        for _ in range(batches):
            sent, arrival, t = src.next_pair()
            e = est.observe(sent, arrival)
            if e.converged:
                true_ts = [t - src.rng.randint(0, S) for _ in range(20)]
                ts_src = pa.array([round(x + src.offset(x)) for x in true_ts], pa.int64())
                aligned, _, _ = align(ts_src, e)
                new = [abs(a - x) for a, x in zip(aligned.to_pylist(), true_ts, strict=True)]
                within += sum(x <= e.error_ns for x in new)
                errs += new
        onset = rng.randint(40, 120)
        grows = _Source(
            rng, rng.uniform(-3600 * S, 3600 * S), rng.uniform(-200, 200),
            rng.uniform(0.2 * MS, 2 * MS), rng.uniform(1 * MS, 3 * MS),
            onset=onset, rate=rng.uniform(100e-6, 1000e-6),
        )  # fmt: skip
        est = ClockEstimator()
        for i in range(onset + 150):
            sent, arrival, t = grows.next_pair()
            e = est.observe(sent, arrival)
            if i >= onset:
                loaded += 1
                loaded_within += abs(e.offset_at(sent) - grows.offset(t)) <= e.error_ns
        # a source off by 1.01 s to 1 h (either sign): batches until flagged
        off = rng.uniform(1.01 * S, 3600 * S) * rng.choice((-1, 1))
        bad, est = _Source(rng, off, rng.uniform(-200, 200), 0.5 * MS, 2 * MS), ClockEstimator()
        for n in range(1, 61):
            sent, arrival, _ = bad.next_pair()
            if est.observe(sent, arrival).alert():
                flagged.append(n)
                break
        else:
            flagged.append(10_000)
    r = BenchResult("clock")
    r.add("clock_p99_abs_error_ms", percentile(errs, 0.99) / MS, "ms", "<=", 1.0)
    r.add("clock_p50_abs_error_ms", percentile(errs, 0.5) / MS, "ms")
    r.add("clock_within_bound_share", within / max(len(errs), 1), "x", note="stated error bound")
    r.add(
        "clock_growing_delays_within_bound_share",
        loaded_within / max(loaded, 1),
        "x",
        note="delays growing 100-1000 us/s: batches from the onset on",
    )
    r.add(
        "clock_flag_batches_max",
        max(flagged),
        "batches",
        "<=",
        10,
        note="1 batch/s: batches = seconds",
    )
    r.add("clock_flag_batches_p50", percentile([float(x) for x in flagged], 0.5), "batches")
    r.details.update(
        {
            "sources": sources,
            "batches": batches,
            "aligned_samples": len(errs),
            "growing_delay_batches": loaded,
        }
    )
    return r


def bench_lake(
    rows: int, *, penalty: tuple[int, int, int], query_rows: int | None = None
) -> BenchResult:
    """The lake: landing and bytes/sample at about ``rows`` rows; the named queries on a
    compacted lake of ``query_rows`` samples against one sorted file of them (default: 10^8
    in full mode, ``rows`` >= 10^6; 10 x ``rows`` otherwise), and the small-file penalty on
    ``penalty`` = (nodes, seconds, timed repeats) landed in 2 s flushes (each mode's in
    :class:`lab.bench.cli.Sizes`)."""
    from lab.lake import bench as lake
    from lab.lake import scalebench
    from lab.lake.synth_lake import LakeSpec

    full = rows >= 1_000_000
    query_rows = query_rows or (100_000_000 if full else 10 * rows)
    nodes, seconds, repeat = penalty
    slice_spec = LakeSpec(nodes=nodes, seconds=seconds)
    r = BenchResult("lake")
    with contextlib.redirect_stdout(sys.stderr):  # its own lines are progress, not results
        land = lake.bench_landing(rows)
        size = lake.bench_bytes_per_sample(rows)
        q = scalebench.bench_queries_at_scale(query_rows)
        pen = scalebench.bench_small_file_penalty(slice_spec, repeat=repeat)
    r.add("landing_to_write_table_ratio", land["ratio"], "x", ">=", 0.8, note="wall clock")
    r.add("landing_cpu_ratio", land["cpu_ratio"], "x", note="process CPU, write_table/landing")
    r.add(
        "landing_ratio_without_fsync",
        land["ratio_without_fsync"],
        "x",
        note=f"{land['fsyncs']} fsyncs took {land['fsync_share']:.0%} of landing",
    )
    r.add("bytes_per_sample_compacted", size["bytes_per_sample"], "B/sample", "<=", 6)
    per = q["queries"]
    note = f"{q['rows']:,} samples, {len(per)} named queries, medians"
    r.add("query_rows", q["rows"], "samples")
    r.add("queries_compacted_to_single_file_ratio", q["ratio_vs_single_total"], "x", "<=", 1.3)
    r.add(
        "small_file_penalty",
        pen["penalty_total"],
        "x",
        note=f"{pen['files_small']} files in {pen['flush_s']} s flushes / compacted, "
        f"{pen['rows']:,} samples",
    )
    r.add("query_worst_ratio_vs_single", q["worst_ratio_vs_single"], "x", "<=", 1.3)
    r.add("query_slowest_compacted_s", q["slowest_compacted_s"], "s", "<=", 2.0, note=note)
    for name, v in sorted(per.items()):
        r.add(f"query_{name}_compacted_s", v["compacted_s"], "s", "<=", 2.0)
        r.add(f"query_{name}_ratio_vs_single", v["ratio_vs_single"], "x", "<=", 1.3)
    r.details.update(
        {
            "rows_requested": rows,
            "landing": land,
            "bytes_per_sample": size,
            "queries": q,
            "small_file_penalty": pen,
        }
    )
    return r


def _h100_trees(root: Path) -> tuple[Path, Path]:
    extract(SYSFS_PROCFS / "procfs-fixtures.ttar", root / "procfs")
    with tarfile.open(SYSFS_PROCFS / "gpud-sys-class-infiniband-h100.tar.gz") as tf:
        tf.extractall(root / "h100-raw", filter="data")
    (root / "h100" / "sys" / "class").mkdir(parents=True)
    shutil.move(
        root / "h100-raw" / "sys-class-infiniband-h100",
        root / "h100" / "sys" / "class" / "infiniband",
    )
    return root / "procfs" / "fixtures" / "proc", root / "h100" / "sys"


def bench_exporter(scrapes: int) -> BenchResult:
    """Node exporter CPU per scrape on the H100 IB tree (8 HCAs + RoCE bond) + procfs."""
    from services.exporters.node import bench_scrape

    r = BenchResult("exporter")
    with tempfile.TemporaryDirectory() as tmp:
        proc, sys_ = _h100_trees(Path(tmp))
        d = bench_scrape(proc, sys_, scrapes)
    r.add("exporter_cpu_ms_per_scrape", d["cpu_s_per_scrape"] * 1e3, "ms")
    r.add("exporter_core_share_at_1s_pct", d["core_share_at_1s"] * 100, "%", "<=", 0.5)
    r.add("exporter_rows_per_scrape", d["rows_per_scrape"], "rows")
    r.details.update(d)
    return r


def bench_sasl(quick: bool) -> BenchResult:
    """SASL_SSL (SCRAM-SHA-512 over TLS, ACLs enforced) against PLAINTEXT in one run
    (:func:`lab.bench.sasl.bench_sasl`): producer and consumer throughput of
    simulator raw batches, client and broker CPU per million samples, and their ratios
    (SASL_SSL / PLAINTEXT); without ``quick`` also the worker through each, whose ratios are
    figures only when both workers drained."""
    from lab.bench.sasl import bench_sasl as run

    r = BenchResult("sasl")
    d = run(quick=quick)
    note = "SASL_SSL / PLAINTEXT, same run"

    def ratio(name: str, v: float | None) -> None:  # None: a denominator measured 0
        r.add(name, math.nan if v is None else v, "x", note=note)

    for way in ("produce", "consume"):
        ratio(f"sasl_{way}_throughput_ratio", d[f"{way}_throughput_ratio"])
        for who in ("total", "client", "broker"):
            ratio(f"sasl_{way}_{who}_cpu_ratio", d[f"{way}_{who}_cpu_ratio"])
        for mode in ("plaintext", "sasl_ssl"):
            m = d[mode][way]
            r.add(f"{mode}_{way}_samples_per_s", m["samples_per_s"], "samples/s")
            for who in ("total", "client", "broker"):
                key = f"{who}_cpu_s_per_million"
                r.add(f"{mode}_{way}_{key}", m[key], "CPU-s/M samples")
    w = d.get("worker")
    if w is not None:  # a stalled worker has no rate: its ratios stay out of the figures
        for k in ("throughput_ratio", "cpu_ratio"):
            if w[k] is not None:
                ratio(f"sasl_worker_{k}", w[k])
    r.details.update(d)
    return r
