"""detect_stage: detect alone, in-process, over simulated refined data of N nodes.

For each node count a child process writes the input (:mod:`lab.bench.detect_input`: the
simulator's cluster with congestion, throttling and Xid incidents, refined by the worker's
``Refiner``) and another replays it through ``DetectCore``/``Detector`` as the agent feeds
them (:mod:`lab.bench.detect_child`); no Kafka, no Faust. Figures: samples per CPU-second of
detect's calls, peak RSS of the replaying process at each node count, and the slope of a
least-squares fit of peak RSS over nodes (what each node more costs).

Ratios it exists to measure: samples per CPU-second against the 1 M goal, and RSS growth per
node against the 1 MiB goal. Every run's output digest is in the details: equal digests at
one node count are equal alerts, episodes and rollups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from lab.bench.figures import BenchResult
from lab.bench.machine import REPO

MIB = 2**20
GOAL_SAMPLES_PER_CPU_S = 1_000_000
GOAL_GROWTH_MIB_PER_NODE = 1.0


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "lab.bench.detect_child", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        check=True,
    )
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def replay_nodes(workdir: Path, nodes: int, seconds: int, seed: int = 7) -> dict[str, Any]:
    """Write ``nodes`` x ``seconds`` of input under ``workdir`` and replay it in a fresh
    process; the replay's JSON (see :func:`lab.bench.detect_child.replay`). The input is
    removed afterwards. Blocks (minutes at hundreds of nodes); raises CalledProcessError."""
    path = workdir / f"detect-input-{nodes}.bin"
    try:
        _child(["write", str(path), str(nodes), str(seconds), str(seed)], 1800)
        return _child(["run", str(path)], 1800)
    finally:
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)


def fit_slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points.

    >>> fit_slope([1, 2, 3], [2, 4, 6])
    (2.0, 0.0)
    """
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def bench_detect_stage(
    workdir: Path, node_counts: tuple[int, ...] = (24, 96, 384), seconds: int = 30
) -> BenchResult:
    """Replay ``seconds`` of each node count; figures per count and the RSS slope."""
    r = BenchResult("detect_stage")
    runs = [replay_nodes(workdir, n, seconds) for n in node_counts]
    for d in runs:
        n = d["nodes"]
        r.add(
            f"detect_samples_per_cpu_s_{n}_nodes",
            d["samples_per_cpu_s"],
            "samples/CPU-s",
            ">=",
            GOAL_SAMPLES_PER_CPU_S,
            note=f"{d['samples']:,} refined samples, {seconds} s simulated, in-process",
        )
        r.add(f"detect_peak_rss_mib_{n}_nodes", d["peak_rss_bytes"] / MIB, "MiB",
              note=f"baseline {d['baseline_rss_bytes'] / MIB:.0f} MiB before any data")  # fmt: skip
    if len(runs) > 1:
        slope, base = fit_slope(
            [float(d["nodes"]) for d in runs], [d["peak_rss_bytes"] / MIB for d in runs]
        )
        r.add(
            "detect_rss_growth_per_node_mib",
            slope,
            "MiB/node",
            "<=",
            GOAL_GROWTH_MIB_PER_NODE,
            note=f"least-squares slope of peak RSS over {', '.join(map(str, node_counts))} "
            f"nodes (intercept {base:.0f} MiB)",
        )
    r.details["runs"] = runs
    r.details["second_replica"] = (
        "not measured here: detect_stage runs no broker; two detect processes in one group "
        "need services/detect's replica support and a Kafka bench"
    )
    return r
