"""alert_accuracy: precision and recall of alerts and episodes against the simulator's truth.

The worker and ``refinery detect`` run as processes on fresh topics; the simulator publishes a
small cluster with **every** fault kind on (``--faults all``) at speed 1 for a long run — the
pipeline aligns clocks against the broker's LogAppendTime, so it cannot be fed faster than
real time. Once both have drained, every alert (the worker's clock alerts included) and
episode is read back and scored by :func:`lab.bench.accuracy_match.score`: a detection
is a true positive when it matches an incident by rule, entity, job and time overlap; an
incident's required signals are listed there.

The run is measured too: how late each raw record reached the broker against the time the
truth says (the simulator falls behind its schedule on a busy machine) and how far the refiner
lagged. Clock alerts of a source whose input was late enough to look more than 1 s off, and
freshness alerts while the refiner really lagged, are listed as ``excluded`` with the reason
(:func:`run_signals`), not scored; everything else counts.

Full mode: 360 s (three 120 s planning windows, each with its own storm, link flap, throttle,
two XIDs, reset and clock step); quick mode: 60 s. ``refinery bench --only alert_accuracy``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow.parquet as pq

from lab.bench.accuracy_match import (
    AccuracyReport,
    Detection,
    Signal,
    detections,
    on_entity,
    score,
)
from lab.bench.figures import BenchResult
from lab.bench.harness import BenchKafka, S, end_count, records, sim_topics
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish
from lab.simulate.truth import sibling

FAULTS = "all"
NODES = 8  # two jobs (5 + 3 nodes), 15 k samples/s: within one worker's rate on 2 cores
SEED = 11


def read_json_topic(k: BenchKafka, topic: str, timeout: float = 120) -> list[tuple[Any, int]]:
    """Every record of ``topic`` as (JSON, record timestamp ns), from the beginning to the
    current end."""
    n = end_count(k.conf, topic)
    if n == 0:
        return []
    return [
        (json.loads(m.value()), m.timestamp()[1] * 1_000_000)
        for m in records(k.conf, topic, lambda c: c >= n, timeout)
    ]


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
        truth = k.workdir / f"{prefix}truth.parquet"
        rep = publish(sim, k.kafka, sim_topics(prefix), truth, speed=1.0, progress_cb=None)
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
    alerts = [a for a, _ in read_json_topic(k, prefix + "telemetry.alerts")]
    episodes = [e for e, _ in read_json_topic(k, prefix + "telemetry.episodes")]
    clocks = sim.clocks.table(sim.cluster.node_names).to_pylist()
    incidents = [i.row() for i in sim.incidents]
    sends = pq.read_table(sibling(truth, "sends")).to_pylist()
    raw_topic = prefix + "telemetry.raw"
    acc = [
        (d, t)
        for d, t in read_json_topic(k, prefix + "telemetry.accounting")
        if d.get("raw_topic") == raw_topic
    ]
    names = sim.cluster.node_names
    late, lags, timing = input_timing(
        [x for x in sends if x["topic"] == raw_topic],
        acc,
        lambda t: {n: int(o) for n, o in zip(names, sim.clocks.offsets(t), strict=True)},
    )
    r = score(incidents, clocks, alerts, episodes, run, explained=run_signals(late, lags, 5 * S))
    _figures(res, r)
    res.details.update(
        {
            "nodes": nodes,
            "seconds": seconds,
            "seed": seed,
            "faults": FAULTS,
            "publish_unacked": rep.unacked,
            "input_timing": timing,
            "late_inputs": late,
            "refiner_lag_spans": lags,
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


def input_timing(
    sends: list[dict[str, Any]],
    accounting: list[tuple[dict[str, Any], int]],
    true_offsets: Callable[[int], dict[str, int]],
    freshness_s: float = 30.0,
    resolve_s: float = 10.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """How the run's inputs really arrived, from the truth's raw sends (``due_true_ns``: when
    the simulator meant the broker to append each) and the accounting records (the raw
    record's append time, and their own append time: when the refiner had processed it).

    Returns ``(late_inputs, lags, stats)`` for :func:`run_signals`: spans of a source whose
    records were late enough that its clock appeared beyond 1 s while truly within it, and
    spans where the refiner was behind by more than ``resolve_s`` reaching ``freshness_s``.
    """
    done = {
        (int(d["raw_partition"]), int(d["raw_offset"])): (int(d["append_ms"]) * 10**6, t)
        for d, t in accounting
        if d.get("append_ms") is not None
    }
    marked: dict[tuple[str, str], list[tuple[int, int, float]]] = {}
    worst_late, lag_rows = 0.0, []
    for x in sends:
        got = done.get((int(x["partition"]), int(x["offset"])))
        if got is None or x["exporter"] is None:
            continue
        appended, processed = got
        late = appended - int(x["due_true_ns"])
        worst_late = max(worst_late, late / S)
        lag_rows.append((processed, (processed - appended) / S))
        true = true_offsets(int(x["due_true_ns"])).get(str(x["node"]), 0)
        if abs(true - late) > 0.95 * S and abs(true) <= 1.05 * S:
            marked.setdefault((x["node"], x["exporter"]), []).append(
                (appended, processed, late / S)
            )
    late_inputs = []
    for (node, exporter), rows in sorted(marked.items()):
        for span in _spans(sorted(rows)):
            late_inputs.append(
                {
                    "node": node,
                    "exporter": exporter,
                    "t0_ns": span[0][0],
                    "t1_ns": span[-1][1],
                    "late_s": max(r[2] for r in span),
                }
            )
    lags = []
    behind = sorted((t, t, lag) for t, lag in lag_rows if lag > resolve_s)
    for span in _spans(behind):
        peak = max(r[2] for r in span)
        if peak > freshness_s:
            lags.append({"t0_ns": span[0][0], "t1_ns": span[-1][1], "lag_s": peak})
    stats = {
        "publish_late_max_s": worst_late,
        "refiner_lag_max_s": max((lag for _, lag in lag_rows), default=0.0),
    }
    return late_inputs, lags, stats


def _spans(rows: list[tuple[int, int, float]], gap_ns: int = 5 * S) -> list[list[Any]]:
    """Rows sorted by their first field, cut where it jumps by more than ``gap_ns``."""
    out: list[list[Any]] = []
    for r in rows:
        if out and r[0] - out[-1][-1][0] <= gap_ns:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def run_signals(
    late_inputs: Iterable[Mapping[str, Any]], lags: Iterable[Mapping[str, Any]], slack_ns: int
) -> list[Signal]:
    """Alerts the benchmark run itself explains, not an incident of the simulated cluster:

    - ``late_inputs`` rows ``{node, exporter, t0_ns, t1_ns, late_s}``: records of one source
      reached the broker so late (the simulator running behind its schedule on a busy
      machine) that its clock *appeared* more than 1 s off — one-way stamps cannot tell a
      delay from an offset; ``t0``..``t1`` from the first late append to the last one's
      processing (the refiner stamps clock alerts with processing time);
    - ``lags`` rows ``{t0_ns, t1_ns, lag_s}``: the refiner was behind by more than the
      ``refined_freshness`` threshold (an alert about the pipeline, and a true one)."""
    out: list[Signal] = []
    for r in late_inputs:
        src = f"{r['node']}|{r['exporter']}|"
        t0, t1 = int(r["t0_ns"]) - slack_ns, int(r["t1_ns"]) + slack_ns
        why = f"input late: up to {float(r['late_s']):.1f} s, the simulator behind schedule"

        def late(d: Detection, src: str = src, t0: int = t0, t1: int = t1) -> bool:
            return d.rule == "clock_offset" and d.entity.startswith(src) and d.overlaps(t0, t1)

        out.append(Signal("run", "run", why, src + "*", False, late))
    for r in lags:
        t0, t1 = int(r["t0_ns"]) - slack_ns, int(r["t1_ns"]) + slack_ns
        why = f"refiner behind: up to {float(r['lag_s']):.0f} s"
        out.append(
            Signal(
                "run",
                "run",
                why,
                "pipeline",
                False,
                on_entity("refined_freshness", "pipeline", t0, t1),
            )
        )
    return out


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
    why: dict[str, int] = {}
    for e in r.excluded:
        reason = str(e["why"]).split(":")[0]
        why[reason] = why.get(reason, 0) + 1
    res.add(
        "excluded_detections",
        len(r.excluded),
        "detections",
        note="explained by the run, not scored: " + _kv(why),
    )
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
        f"{_kv(r.unmatched_by_rule())}; missed: {_kv(r.missed_by_kind())}; excluded "
        f"{len(r.excluded)}"
    )
