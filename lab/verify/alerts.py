"""Alerts and episodes of a lake scored against a simulator run's truth.

Matching is :func:`lab.bench.accuracy_match.score` (the benchmark's): a detection is
true when it matches an injected incident, or a clock truly more than 1 s off, by rule,
entity and time. Pipeline-health alerts are true when the pipeline really was in the state
they report, measured from the lake itself (:func:`pipeline_signals`):

- ``refined_freshness``: records refined more than its resolve threshold after the truth
  says they reached the broker, peaking above its threshold (a real backlog, a restart);
- ``deadletter_rate``: dead letters counted as the detector counts them (a rejected record
  1, a quarantined sample 1) at their arrival or at the refiner's processing time, above
  the rule's resolve rate over its window.

A run faster than real time judges nothing about clocks (the simulated clocks run ahead of
the broker's): its ``clock_offset`` alerts are listed as not judged. Every rule of the rule
file gets a row, firing or not (:func:`by_rule`).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from lab.bench.accuracy import _spans, input_timing
from lab.bench.accuracy_match import AccuracyReport, Detection, Signal, score
from pipelines.detect.rule_config import DeadletterRule, FreshnessRule, Rule, load_rules
from schemas.catalog import default_catalog

S = 1_000_000_000
SLACK_NS = 5 * S
DEFAULT_RULES = Path(__file__).resolve().parents[2] / "deploy" / "rules" / "default.yaml"
EPISODE_KINDS = ("congestion", "throttling")


@dataclass(frozen=True)
class Run:
    """The truth's run: true-time window, publishing speed (None: flat out), interval."""

    start_ns: int
    end_ns: int
    speed: float | None
    interval_ns: int = S
    factor: float = 1.0  # true time per broker time: the speed (flat out: as measured)
    # (true times, broker times) the publisher really kept: a run faster than real time whose
    # publisher could not keep its speed ran slower, and unevenly; None: ``factor`` throughout
    knots: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def real_time(self) -> bool:
        return self.speed is not None and abs(self.speed - 1.0) < 1e-9

    def to_true(self, t: int) -> int:
        """A broker (aligned, processing) time as the simulator's true time: they start
        together, and true time runs ``factor`` times faster (or as the knots say)."""
        if self.knots is not None:
            return _interp(t, self.knots[1], self.knots[0], self.factor)
        return t if self.factor == 1.0 else self.start_ns + round((t - self.start_ns) * self.factor)

    def to_broker(self, t: int) -> int:
        if self.knots is not None:
            return _interp(t, self.knots[0], self.knots[1], 1 / self.factor)
        return t if self.factor == 1.0 else self.start_ns + round((t - self.start_ns) / self.factor)


def _interp(t: int, xs: tuple[int, ...], ys: tuple[int, ...], slope: float) -> int:
    """``t`` on the piecewise-linear map ``xs -> ys``; past either end, on ``slope``."""
    if t <= xs[0]:
        return ys[0] - round((xs[0] - t) * slope)
    if t >= xs[-1]:
        return ys[-1] + round((t - xs[-1]) * slope)
    i = bisect.bisect_right(xs, t)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + round((t - x0) * (y1 - y0) / (x1 - x0)) if x1 > x0 else y0


def _kept_pace(
    con: duckdb.DuckDBPyConnection, start: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per second of true time, the median aligned time of the run's samples true in it
    (``verify_err``, :func:`lab.verify.data.clock_figures`), kept non-decreasing and anchored
    at the run's start: the pace the publisher really kept, on the time detections carry.
    None without such samples."""
    try:
        rows = con.execute(
            """SELECT median(true_ns), median(aligned_ns)
               FROM verify_err GROUP BY true_ns // 1000000000 ORDER BY 1"""
        ).fetchall()
    except duckdb.CatalogException:
        return None
    if len(rows) < 2:
        return None
    xs, ys = [start], [start]
    for true, aligned in rows:
        x, y = int(true), max(int(aligned), ys[-1])
        if x > xs[-1]:
            xs.append(x)
            ys.append(y)
    return tuple(xs), tuple(ys)


def run_of(con: duckdb.DuckDBPyConnection, facts: Mapping[str, Any] | None) -> Run:
    """The run from the truth's ``run.json`` facts, or, for a truth without them, from its
    sends (assumed real time)."""
    if facts:
        speed = None if facts.get("speed") is None else float(facts["speed"])
        start, end = int(facts["start_ns"]), int(facts["end_ns"])
        interval = int(facts.get("interval_ns") or S)
        if speed is None:
            return Run(start, end, None, interval, max(1.0, _measured_factor(con, start, end)))
        knots = None if abs(speed - 1.0) < 1e-9 else _kept_pace(con, start)
        if knots is None:
            return Run(start, end, speed, interval, max(1.0, speed))
        kept = (knots[0][-1] - knots[0][0]) / max(1, knots[1][-1] - knots[1][0])
        return Run(start, end, speed, interval, max(1.0, kept), knots)
    row = con.execute(
        "SELECT min(due_true_ns), max(due_true_ns) FROM truth_sends WHERE stream = 'raw'"
    ).fetchone()
    if row is None or row[0] is None:
        raise ValueError("the truth has no raw sends: not a simulator run's truth")
    return Run(int(row[0]), int(row[1]) + S, 1.0)


def _measured_factor(con: duckdb.DuckDBPyConnection, start: int, end: int) -> float:
    """A run published flat out: its true span over the span the refiner processed it in."""
    row = con.execute("SELECT max(ts) - min(ts) FROM refine_accounting").fetchone()
    span = int(row[0]) if row is not None and row[0] is not None else 0
    return (end - start) / span if span > 0 else 1.0


def _records(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict[str, Any]]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def lake_detections(
    con: duckdb.DuckDBPyConnection, run: Run, nodes: set[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Alert and episode records of the run: started within the run (with slack) and, when
    they name a node, on one of the truth's nodes."""
    lo, hi = run.start_ns - 60 * S, run.end_ns + 600 * S
    alerts = _records(
        con,
        f"""SELECT id, rule, state, entity, node, device, job, starts_ns, ends_ns, cause,
                   evidence FROM alerts WHERE starts_ns BETWEEN {lo} AND {hi}
            ORDER BY emitted_ns, id""",
    )
    for a in alerts:
        a["evidence"] = json.loads(a["evidence"]) if a["evidence"] else {}
        a["starts_ns"] = run.to_true(a["starts_ns"])
        a["ends_ns"] = None if a["ends_ns"] is None else run.to_true(a["ends_ns"])
    alerts = [a for a in alerts if a["node"] is None or a["node"] in nodes]
    episodes = _records(
        con,
        f"""SELECT id, kind, state, entity, start_ns, end_ns, nodes, jobs, cause_hint
            FROM episodes WHERE start_ns BETWEEN {lo} AND {hi} ORDER BY emitted_ns, id""",
    )
    for e in episodes:
        e["start_ns"] = run.to_true(e["start_ns"])
        e["end_ns"] = None if e["end_ns"] is None else run.to_true(e["end_ns"])
    return alerts, episodes


def pipeline_signals(con: duckdb.DuckDBPyConnection, rules: list[Rule], run: Run) -> list[Signal]:
    """Pipeline-health alerts the run's own measured state explains (true, not incidents),
    spans on the true clock (as the detections' times are)."""
    out: list[Signal] = []
    for rule in rules:
        if isinstance(rule, FreshnessRule):
            out += _freshness_signals(con, rule, run)
        elif isinstance(rule, DeadletterRule):
            out += _deadletter_signals(con, rule, run)
    return out


def _freshness_signals(
    con: duckdb.DuckDBPyConnection, rule: FreshnessRule, run: Run
) -> list[Signal]:
    """Spans where raw records were refined more than the rule's resolve threshold after the
    truth says they reached the broker, peaking above its threshold
    (:func:`lab.bench.accuracy.input_timing` with the due time as the append time)."""
    rows = _records(
        con,
        """SELECT a.raw_partition AS partition, a.raw_offset AS offset, a.ts, s.due_true_ns
           FROM refine_accounting a JOIN truth_sends s
             ON s.partition = a.raw_partition AND s.offset = a.raw_offset
            AND s.topic = coalesce(a.raw_topic, s.topic) AND s.stream = 'raw'
           WHERE a.outcome <> 'replay'""",
    )
    sends = [r | {"exporter": "any", "node": "any"} for r in rows]
    acc = [
        (
            {
                "raw_partition": r["partition"],
                "raw_offset": r["offset"],
                "append_ms": run.to_broker(r["due_true_ns"]) // 1_000_000,
            },
            int(r["ts"]),
        )
        for r in rows
    ]
    resolve = rule.above_ns if rule.resolve_ns is None else rule.resolve_ns
    _, lags, _ = input_timing(sends, acc, lambda t: {}, rule.above_ns / S, resolve / S)
    out = []
    for r in lags:
        t0 = run.to_true(int(r["t0_ns"])) - SLACK_NS
        t1 = run.to_true(int(r["t1_ns"])) + SLACK_NS

        def ok(d: Detection, t0: int = t0, t1: int = t1) -> bool:
            return d.rule == rule.name and d.overlaps(t0, t1)

        why = f"refiner behind: up to {float(r['lag_s']):.0f} s"
        out.append(Signal("run", "run", why, "pipeline", False, ok))
    return out


def _deadletter_signals(
    con: duckdb.DuckDBPyConnection, rule: DeadletterRule, run: Run
) -> list[Signal]:
    """Spans where the dead letters the detector counts exceeded the rule's resolve rate over
    its window, at the raw records' broker arrival (their due time in the truth, when the
    detector counts them) or at the refiner's processing time (a burst of a backlog)."""
    rows = _records(
        con,
        """SELECT a.ts AS processed, s.due_true_ns AS arrived,
                  CASE WHEN a.outcome = 'deadletter' THEN 1 ELSE a.quarantined_samples END AS n
           FROM refine_accounting a LEFT JOIN truth_sends s
             ON s.partition = a.raw_partition AND s.offset = a.raw_offset
            AND s.topic = coalesce(a.raw_topic, s.topic)
           WHERE a.outcome = 'deadletter' OR a.quarantined_samples > 0""",
    )
    signals = []
    for when in ("arrived", "processed"):
        per_s: dict[int, int] = {}
        for r in rows:
            if r[when] is not None:
                sec = (int(r[when]) if when == "arrived" else run.to_true(int(r[when]))) // S
                per_s[sec] = per_s.get(sec, 0) + int(r["n"])
        signals += _hot_spans(per_s, rule, when)
    return signals


def _hot_spans(per_s: dict[int, int], rule: DeadletterRule, when: str) -> list[Signal]:
    win_s = rule.window_ns // S
    resolve = rule.above if rule.resolve is None else rule.resolve
    hot = []
    for s in per_s:
        rate = sum(n for t, n in per_s.items() if s - win_s < t <= s) / win_s
        if rate > resolve:
            hot.append((s * S, s * S + rule.window_ns, rate))
    out = []
    for span in _spans(sorted(hot)):
        t0, t1 = span[0][0] - SLACK_NS, span[-1][1] + SLACK_NS
        peak = max(r[2] for r in span)

        def ok(d: Detection, t0: int = t0, t1: int = t1) -> bool:
            return d.rule == rule.name and d.overlaps(t0, t1)

        why = f"dead letters at up to {peak:.1f}/s ({when})"
        out.append(Signal("run", "run", why, "pipeline", False, ok))
    return out


def clock_not_judged() -> Signal:
    return Signal(
        "run",
        "run",
        "not judged: faster than real time, simulated clocks run ahead of the broker's",
        "*",
        False,
        lambda d: d.rule == "clock_offset",
    )


def score_run(
    con: duckdb.DuckDBPyConnection,
    run: Run,
    incidents: list[dict[str, Any]],
    clocks: list[dict[str, Any]],
    nodes: set[str],
    rules_path: Path = DEFAULT_RULES,
) -> tuple[AccuracyReport, list[Rule]]:
    rules = load_rules(rules_path, default_catalog())
    alerts, episodes = lake_detections(con, run, nodes)
    explained = pipeline_signals(con, rules, run)
    if not run.real_time:
        explained.insert(0, clock_not_judged())
        clocks = []  # no clock incident is expected either
    report = score(
        incidents,
        clocks,
        alerts,
        episodes,
        (run.start_ns, run.end_ns),
        slack_ns=SLACK_NS,
        interval_ns=run.interval_ns,
        explained=explained,
        # a rule holds ``for`` in the pipeline's (broker) time: that much times the speed
        # of the simulator's true time
        for_ns={r.name: round((getattr(r, "for_ns", 0) or 0) * run.factor) for r in rules},
    )
    return report, rules


def by_rule(report: AccuracyReport, rules: Iterable[Rule]) -> dict[str, dict[str, int]]:
    """Per rule of the rule file (and each episode kind and any other rule that fired):
    detections true, false and not scored."""
    names = [r.name for r in rules] + ["nccl_straggler"] + [f"episode:{k}" for k in EPISODE_KINDS]
    table = {n: {"true": 0, "false": 0, "not_scored": 0} for n in names}
    for d in report.matched:
        table.setdefault(d["rule"], {"true": 0, "false": 0, "not_scored": 0})["true"] += 1
    for d in report.unmatched:
        table.setdefault(d["rule"], {"true": 0, "false": 0, "not_scored": 0})["false"] += 1
    for e in report.excluded:
        table.setdefault(e["rule"], {"true": 0, "false": 0, "not_scored": 0})["not_scored"] += 1
    return table
