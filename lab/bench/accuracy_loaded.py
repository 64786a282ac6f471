"""alert_accuracy_loaded: clock and alert accuracy of the whole pipeline on the loaded case.

Worker, detect and ``refinery land`` run as processes on fresh topics, sharing the machine with
the broker and the simulator, which publishes at speed 1, phases spread, every fault kind on
(``--faults all``), as many nodes as make half the whole pipeline's maximum rate on this
machine (:mod:`lab.bench.capacity`; the worker's own maximum, if lower); the worker
is killed -9 and started again every ``restart_every_s`` while it publishes (a user's restart,
with its replay and catch-up). Once everything has drained and landed, the lake is compared
with the run's truth by :func:`lab.verify.verdict.verify`, the same check as ``refinery
verify``: samples within their own stated clock bound, |aligned - true| and the bound's
percentiles, alert precision and incident recall, every false alert by rule, nothing lost or
duplicated. ``refinery bench --only alert_accuracy_loaded``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from lab.bench.capacity import pipeline_max_rate
from lab.bench.figures import BenchResult
from lab.bench.harness import BenchKafka, S, sim_topics
from lab.bench.latency import _half_load_nodes, samples_per_node_s
from lab.bench.pipeline_procs import Services
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish
from lab.verify.verdict import PRECISION_GOAL, WITHIN_BOUND_GOAL, Verdict, verify

SEED = 29


def bench_accuracy_loaded(
    k: BenchKafka,
    worker_max_rate: float | None,
    seconds: int,
    seed: int = SEED,
    restart_every_s: float = 25.0,
    capacity: tuple[int, int] = (32, 30),
) -> BenchResult:
    """One run, after the pipeline's maximum is measured on a backlog of ``capacity`` (nodes,
    simulated seconds); blocks for ``seconds`` plus the drain. Raises RuntimeError when a child dies
    (other than the worker it kills) or the pipeline does not drain."""
    res = BenchResult("alert_accuracy_loaded")
    per_node = samples_per_node_s(S, 10)
    cap = pipeline_max_rate(k, *capacity)
    res.add(
        "pipeline_max_samples_per_s",
        cap.samples_per_s,
        "samples/s",
        note="worker, detect and lander draining a published backlog together: half of it"
        " (or of the worker's own maximum, if lower) is this run's load",
    )
    limit = cap.samples_per_s
    if worker_max_rate is not None and math.isfinite(worker_max_rate):
        limit = min(limit, worker_max_rate)
    rate, nodes = _half_load_nodes(limit, per_node)
    prefix = k.fresh_topics()
    lake = k.workdir / f"{prefix}lake"
    svc = Services(k, prefix, lake)
    try:
        svc.wait_joined()
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
            svc.supervise()
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
    res.details.update(cap.details())
    res.add(
        "worker_self_exits",
        len(svc.self_exits),
        "",
        "<=",
        0,
        note="the worker exited on its own and was started again, as a supervisor would: "
        + ("; ".join(svc.self_exits) or "none"),
    )
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
        "max_rate_halved": rate,
        "verify": v.as_dict(),
    }
