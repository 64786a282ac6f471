"""docs/performance.md is rendered from a bench run's JSON: every figure, its goal, met or not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lab.bench.figures import BenchResult


def _bench_json(tmp_path: Path) -> Path:
    ok = BenchResult("worker_throughput")
    ok.add("worker_steady_samples_per_s", 812_345.0, "samples/s", ">=", 1_000_000)
    ok.add("worker_cpu_s_per_m", 1.52, "CPU-s")
    lat = BenchResult("alert_latency")
    lat.add("xid_p99_s", 1.4, "s", "<=", 5)
    broken = BenchResult("lake_scale", error="RuntimeError: disk full")
    doc = {
        "mode": "quick",
        "date": "2026-01-01T00:00:00",
        "commit": "0123456789abcdef",
        "machine": {
            "cpu_model": "AMD EPYC",
            "cores": 2,
            "cores_usable": 2,
            "ram_gib": 23.5,
            "loadavg_at_start": 0.4,
        },
        "versions": {"python": "3.11.7", "kafka": "4.2.2"},
        "benchmarks": {r.name: r.as_dict() for r in (ok, lat, broken)},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return path


def _render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "--render", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_page_holds_every_figure_with_its_goal_and_no_date_or_commit(tmp_path: Path) -> None:
    got = _render(str(_bench_json(tmp_path)))
    assert got.returncode == 0, got.stderr
    page = got.stdout
    assert (
        "| worker_throughput | worker_steady_samples_per_s | 812,345 samples/s "
        "| ≥ 1,000,000 samples/s | no |" in page
    )
    assert "| alert_latency | xid_p99_s | 1.4 s | ≤ 5 s | yes |" in page
    assert "| worker_throughput | worker_cpu_s_per_m | 1.52 CPU-s | — |  |" in page
    assert "| lake_scale | — | error | — | — |" in page
    assert "Goals met: 1 of 2 figures with a goal." in page
    assert "Run kind: `quick`." in page
    assert "2026-01-01" not in page and "0123456789abcdef" not in page


def test_a_file_that_is_not_a_bench_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"a": 1}')
    got = _render(str(bad))
    assert got.returncode == 2
    assert got.stderr.strip().count("\n") == 0
    assert "not a refinery bench --json file" in got.stderr
    missing = _render(str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_several_runs_make_one_page_that_says_which_figure_came_from_which(
    tmp_path: Path,
) -> None:
    first = json.loads(_bench_json(tmp_path).read_text())
    later = {**first, "benchmarks": {"alert_latency": first["benchmarks"]["alert_latency"]}}
    later["benchmarks"]["alert_latency"] = {
        **later["benchmarks"]["alert_latency"],
        "figures": {"xid_p99_s": {"value": 9.0, "unit": "s", "goal": "<= 5", "met": False}},
    }
    b = tmp_path / "later.json"
    b.write_text(json.dumps(later))
    page = _render(str(tmp_path / "bench.json"), str(b)).stdout
    assert "| alert_latency | xid_p99_s | 9 s | ≤ 5 s | no |" in page  # the later run's
    assert "- run 2 (load" in page and page.count("alert_latency") == 2  # row + run list
    other = {**later, "mode": "smoke"}
    b.write_text(json.dumps(other))
    got = _render(str(tmp_path / "bench.json"), str(b))
    assert got.returncode == 2 and "different kinds" in got.stderr
