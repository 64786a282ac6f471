"""The SASL_SSL benchmark on a small workload: both brokers side by side, every throughput,
CPU figure and ratio numeric, and ``refinery bench`` turns them into figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lab.bench.sasl import bench_sasl
from lab.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_sasl_bench_reports_ratios_of_one_run(tmp_path: Path) -> None:
    d = bench_sasl(quick=True, nodes=8, seconds=10, rounds=1, work_dir=tmp_path)
    for way in ("produce", "consume"):
        for mode in ("plaintext", "sasl_ssl"):
            m = d[mode][way]
            assert m["samples_per_s"] > 0 and m["client_cpu_s_per_million"] > 0, (mode, way, m)
        for name in ("throughput", "client_cpu", "total_cpu"):
            v = d[f"{way}_{name}_ratio"]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (way, name, v)
    assert d["workload"]["samples_per_round"] > 100_000
    assert "worker" not in d  # quick: transport only
    for mode in ("plaintext", "sasl_ssl"):  # both brokers were stopped
        assert LocalKafka(tmp_path / mode).status()["running"] is False
