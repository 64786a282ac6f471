"""alert_accuracy: precision and recall of alerts and episodes against the simulator's truth.

The worker and ``refinery detect`` run as processes on fresh topics; the simulator publishes a
small cluster with **every** fault kind on (``--faults all``) at speed 1 for a long run — the
pipeline aligns clocks against the broker's LogAppendTime, so it cannot be fed faster than
real time. Once both have drained, every alert (the worker's clock alerts included) and
episode is read back and scored by :func:`services.bench.accuracy_match.score`: a detection
is a true positive when it matches an incident by rule, entity, job and time overlap; an
incident's required signals are listed there.

Full mode: 360 s (three 120 s planning windows, each with its own storm, link flap, throttle,
two XIDs, reset and clock step); quick mode: 60 s.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.bench.accuracy_match import AccuracyReport, detections, score
from services.bench.figures import BenchResult
from services.bench.harness import BenchKafka, S, end_count, records, sim_topics
from services.simulate.cluster import Cluster
from services.simulate.engine import Simulation
from services.simulate.publish import publish

FAULTS = "all"
NODES = 8  # two jobs (5 + 3 nodes), 15 k samples/s: within one worker's rate on 2 cores
SEED = 11


def read_json_topic(k: BenchKafka, topic: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Every record of ``topic`` as JSON, from the beginning to the current end."""
    n = end_count(k.conf, topic)
    if n == 0:
        return []
    return [json.loads(m.value()) for m in records(k.conf, topic, lambda c: c >= n, timeout)]


def bench_alert_accuracy(
    k: BenchKafka, seconds: int, nodes: int = NODES, seed: int = SEED
) -> BenchResult:
    """One run; blocks for ``seconds`` plus the drain. Raises RuntimeError when a child dies
    or the pipeline does not drain."""
    res = BenchResult("alert_accuracy")
    prefix = k.fresh_topics()
    worker = k.start_worker(prefix, name=f"{prefix}acc-worker")
    detect = k.start(
        f"{prefix}acc-detect", ["detect", "--topic-prefix", prefix, "--group", prefix + "detect"]
    )
    kids = [worker, detect]
    try:
        k.wait(
            "worker and detect join",
            lambda: all(k.joined(prefix + g) for g in ("worker", "detect")),
            120,
            kids,
        )
        k.say(f"  publishing {nodes} nodes for {seconds}s at speed 1 with --faults {FAULTS}")
        sim = Simulation(
            Cluster.build(nodes, seed=seed), FAULTS, seed=seed, duration_ns=seconds * S
        )
        rep = publish(sim, k.kafka, sim_topics(prefix), None, speed=1.0, progress_cb=None)
        raw = [prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")]
        k.wait("the worker drains", lambda: k.lag(prefix + "worker", raw) == 0, 300, kids)
        derived = [
            prefix + t
            for t in (
                "telemetry.refined",
                "telemetry.events.aligned",
                "telemetry.collectives.aligned",
            )
        ]
        k.wait("detect drains", lambda: k.lag(prefix + "detect", derived) == 0, 300, kids)
        time.sleep(3)  # a few detect ticks on the final watermark
    finally:
        for c in kids:
            c.stop(30)
    assert sim.start_ns is not None
    run = (sim.start_ns, sim.start_ns + seconds * S)
    alerts = read_json_topic(k, prefix + "telemetry.alerts")
    episodes = read_json_topic(k, prefix + "telemetry.episodes")
    clocks = sim.clocks.table(sim.cluster.node_names).to_pylist()
    incidents = [i.row() for i in sim.incidents]
    r = score(incidents, clocks, alerts, episodes, run)
    _figures(res, r)
    res.details.update(
        {
            "nodes": nodes,
            "seconds": seconds,
            "seed": seed,
            "faults": FAULTS,
            "publish_unacked": rep.unacked,
            "alert_records": len(alerts),
            "episode_records": len(episodes),
            "by_kind": {kind: vars(ks) for kind, ks in r.by_kind.items()},
            "unmatched": r.unmatched,
            "missed": r.missed,
            "redundant": r.redundant,
            "excluded": r.excluded,
            "run_ns": list(run),
            "incidents": incidents,
            "clocks_unsynced": [c for c in clocks if not c["synced"]],
            "detections": [d.short() for d in detections(alerts, episodes)],
        }
    )
    k.say("  " + summary_line(r))
    return res


def _figures(res: BenchResult, r: AccuracyReport) -> None:
    res.add(
        "precision",
        r.precision,
        "",
        ">=",
        1.0,
        note=f"{r.true_positive}/{r.detections} alerts+episodes match an incident",
    )
    res.add("recall", r.recall, "", ">=", 1.0, note=f"{r.signals_met}/{r.signals} required signals")
    res.add(
        "incident_recall",
        r.incident_recall,
        "",
        ">=",
        1.0,
        note=f"{r.incidents_detected}/{r.incidents} incidents fully detected",
    )
    res.add("unmatched_detections", len(r.unmatched), "detections", note=_kv(r.unmatched_by_rule()))
    res.add("missed_signals", len(r.missed), "signals", note=_kv(r.missed_by_kind()))
    res.add(
        "redundant_matches",
        len(r.redundant),
        "signals",
        note="an incident matched by several ids of one signal",
    )


def _kv(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def summary_line(r: AccuracyReport) -> str:
    kinds = "; ".join(
        f"{kind} {ks.signals_met}/{ks.signals} ({ks.incidents_detected}/{ks.incidents} inc.)"
        for kind, ks in r.by_kind.items()
    )
    return (
        f"precision {r.precision:.3f} ({r.true_positive}/{r.detections}), recall "
        f"{r.recall:.3f} ({r.signals_met}/{r.signals}); by kind: {kinds}; unmatched: "
        f"{_kv(r.unmatched_by_rule())}; missed: {_kv(r.missed_by_kind())}"
    )
