"""alert_accuracy_loaded: clock and alert accuracy of the whole pipeline on the loaded case.

Worker, detect and ``refinery land`` run as processes on fresh topics, sharing the machine with
the broker and the simulator, which publishes at speed 1, phases spread, every fault kind on
(``--faults all``), as many nodes as make half the worker's measured maximum rate; the worker
is killed -9 and started again every ``restart_every_s`` while it publishes (a user's restart,
with its replay and catch-up). Once everything has drained and landed, the lake is compared
with the run's truth by :func:`lab.verify.verdict.verify`, the same check as ``refinery
verify``: samples within their own stated clock bound, |aligned - true| and the bound's
percentiles, alert precision and incident recall, every false alert by rule, nothing lost or
duplicated. ``refinery bench --only alert_accuracy_loaded``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from lab.bench.figures import BenchResult
from lab.bench.harness import BenchKafka, S, sim_topics
from lab.bench.latency import _half_load_nodes, samples_per_node_s
from lab.demo.procs import Child, worker_args
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish
from lab.verify.verdict import PRECISION_GOAL, WITHIN_BOUND_GOAL, Verdict, verify

SEED = 29
LANDED = (
    ("telemetry.refined", "samples"),
    ("telemetry.events.aligned", "events"),
    ("telemetry.collectives.aligned", "collectives"),
    ("telemetry.alerts", "alerts"),
    ("telemetry.episodes", "episodes"),
    ("telemetry.deadletter", "deadletter"),
    ("topology", "topology"),
    ("jobs", "jobs"),
    ("telemetry.accounting", "accounting"),
    ("telemetry.rollups", "rollups"),
)


class _Services:
    """Worker, detect and lander of one run; the worker restarts on the same state dir."""

    def __init__(self, k: BenchKafka, prefix: str, lake: Path) -> None:
        self.k, self.prefix, self.restarts = k, prefix, 0
        self.worker_args = worker_args(prefix, k.workdir / f"{prefix}worker")
        self.worker = k.start(f"{prefix}loaded-worker", self.worker_args)
        self.detect = k.start(
            f"{prefix}loaded-detect",
            ["detect", "--topic-prefix", prefix, "--group", prefix + "detect"],
        )
        topics = [f"{prefix}{t}={d}" for t, d in LANDED]
        self.land_topics = [prefix + t for t, _ in LANDED]
        self.land = k.start(
            f"{prefix}loaded-land",
            [
                "land",
                "--group",
                prefix + "land",
                "--instance-id",
                "bench",
                "--max-age",
                "2",
                "--topics",
                *topics,
            ],
            lake=lake,
        )

    @property
    def kids(self) -> list[Child]:
        return [self.worker, self.detect, self.land]

    def restart_worker(self) -> None:
        self.worker.proc.kill()
        self.worker.proc.wait()
        self.restarts += 1
        self.worker = self.k.start(f"{self.prefix}loaded-worker{self.restarts}", self.worker_args)

    def drain(self) -> None:
        k, p = self.k, self.prefix
        raw = [p + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")]
        k.wait("the worker drains", lambda: k.lag(p + "worker", raw) == 0, 600, self.kids)
        derived = [
            p + t
            for t in (
                "telemetry.refined",
                "telemetry.events.aligned",
                "telemetry.collectives.aligned",
            )
        ]
        k.wait("detect drains", lambda: k.lag(p + "detect", derived) == 0, 300, self.kids)
        time.sleep(3)  # a few detect ticks on the final progress
        self.detect.stop(60)  # publishes what it still holds
        k.wait(
            "the lake lands everything",
            lambda: k.lag(p + "land", self.land_topics) == 0,
            300,
            [self.land],
        )


def bench_accuracy_loaded(
    k: BenchKafka,
    worker_max_rate: float | None,
    seconds: int,
    seed: int = SEED,
    restart_every_s: float = 25.0,
) -> BenchResult:
    """One run; blocks for ``seconds`` plus the drain. Raises RuntimeError when a child dies
    (other than the worker it kills) or the pipeline does not drain."""
    res = BenchResult("alert_accuracy_loaded")
    per_node = samples_per_node_s(S, 10)
    rate, nodes = _half_load_nodes(worker_max_rate, per_node)
    prefix = k.fresh_topics()
    lake = k.workdir / f"{prefix}lake"
    svc = _Services(k, prefix, lake)
    try:
        k.wait(
            "worker, detect and land join",
            lambda: all(k.joined(prefix + g) for g in ("worker", "detect", "land")),
            120,
            svc.kids,
        )
        k.say(
            f"  publishing {nodes} nodes (~{nodes * per_node:,.0f} samples/s, half of "
            f"{rate:,.0f}) for {seconds}s at speed 1, spread, --faults all; the worker "
            f"killed -9 every {restart_every_s:g}s"
        )
        sim = Simulation(
            Cluster.build(nodes, seed=seed), "all", seed=seed, duration_ns=seconds * S, spread=True
        )
        truth = k.workdir / f"{prefix}truth.parquet"
        failed: list[BaseException] = []

        def run() -> None:
            try:
                publish(sim, k.kafka, sim_topics(prefix), truth, speed=1.0, progress_cb=None)
            except BaseException as e:  # re-raised in the caller's thread
                failed.append(e)

        pub = threading.Thread(target=run, name="loaded-publish")
        pub.start()
        due = time.monotonic() + restart_every_s
        while pub.is_alive():
            pub.join(0.5)
            if restart_every_s > 0 and time.monotonic() >= due and pub.is_alive():
                svc.restart_worker()
                due = time.monotonic() + restart_every_s
        if failed:
            raise failed[0]
        svc.drain()
    finally:
        for c in svc.kids:
            if c.alive():
                c.stop(30)
    v = verify(lake, truth)
    _figures(res, v)
    res.details.update(_details(v, nodes, seconds, seed, svc.restarts, rate))
    k.say(
        f"  precision {v.alerts.precision:.3f}, incident recall {v.alerts.incident_recall:.3f}"
        f", within bound {100 * v.clock.within_share:.3f} %, restarts {svc.restarts}"
    )
    return res


def _figures(res: BenchResult, v: Verdict) -> None:
    c, a = v.clock, v.alerts
    ms = 1e6
    res.add(
        "within_bound_share",
        c.within_share,
        "",
        ">=",
        WITHIN_BOUND_GOAL,
        note=f"{c.within:,} of {c.samples:,} samples: |aligned - true| <= their own bound",
    )
    res.add("clock_err_p50_ms", c.err_p50_ns / ms, "ms")
    res.add("clock_err_p99_ms", c.err_p99_ns / ms, "ms")
    res.add("clock_err_max_ms", c.err_max_ns / ms, "ms")
    res.add("clock_bound_p50_ms", c.bound_p50_ns / ms, "ms", note="the stated clock_error_ns")
    res.add("clock_bound_p99_ms", c.bound_p99_ns / ms, "ms")
    false = ", ".join(f"{r} {x['false']}" for r, x in v.rules.items() if x["false"]) or "none"
    res.add(
        "precision",
        a.precision,
        "",
        ">=",
        PRECISION_GOAL,
        note=f"{a.true_positive}/{a.detections} true; false by rule: {false}",
    )
    res.add(
        "incident_recall",
        a.incident_recall,
        "",
        ">=",
        1.0,
        note=f"{a.incidents_detected}/{a.incidents} incidents fully detected",
    )
    lost = sum(x.lost for x in v.data.values())
    dup = sum(x.duplicated for x in v.data.values())
    res.add("lost", lost, "rows", "<=", 0, note="samples, events and collectives")
    res.add("duplicated", dup, "rows", "<=", 0)


def _details(
    v: Verdict, nodes: int, seconds: int, seed: int, restarts: int, rate: float
) -> dict[str, Any]:
    return {
        "nodes": nodes,
        "seconds": seconds,
        "seed": seed,
        "worker_restarts": restarts,
        "worker_max_rate": rate,
        "verify": v.as_dict(),
    }
