"""The goals a run must meet, the verdict of one lake against its truth, and its report.

Goals (issue-level promises of the product):

- nothing lost, duplicated or made up: samples, events and collective records;
- real-time runs: at least 99.9 % of samples within their own stated clock bound (a run
  faster than real time judges nothing about clocks and says so);
- alert precision at least 0.98 and incident recall 1.0 (each false alert and each missed
  incident named); the straggler's cause is the injected port.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab.bench.accuracy_match import AccuracyReport, incident_signals
from lab.simulate.truth import load_truth
from lab.verify.alerts import DEFAULT_RULES, SLACK_NS, Run, by_rule, run_of, score_run
from lab.verify.data import ClockFigures, Counts, clock_figures, data_counts, open_run

WITHIN_BOUND_GOAL = 0.999
PRECISION_GOAL = 0.98
RECALL_GOAL = 1.0


@dataclass
class Verdict:
    run: Run
    data: dict[str, Counts]
    clock: ClockFigures
    alerts: AccuracyReport
    rules: dict[str, dict[str, int]]
    stragglers: dict[str, int]  # signals (pfc_storm x job) and how many named the port
    misses: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.misses

    def as_dict(self) -> dict[str, Any]:
        a = self.alerts
        return {
            "ok": self.ok,
            "misses": self.misses,
            "run": asdict(self.run) | {"real_time": self.run.real_time},
            "data": {k: asdict(v) for k, v in self.data.items()},
            "clock": asdict(self.clock)
            | {"within_share": self.clock.within_share, "judged": self.run.real_time},
            "alerts": {
                "precision": a.precision,
                "incident_recall": a.incident_recall,
                "signal_recall": a.recall,
                "detections": a.detections,
                "true": a.true_positive,
                "incidents": a.incidents,
                "incidents_detected": a.incidents_detected,
                "false": a.unmatched,
                "missed": a.missed,
                "not_scored": a.excluded,
                "by_rule": self.rules,
                "stragglers": self.stragglers,
            },
        }


def _stragglers(
    report: AccuracyReport, incidents: list[dict[str, Any]], end: int
) -> dict[str, int]:
    sigs = [
        (s.incident, s.entity)
        for i in incidents
        if int(i["start_ns"]) < end
        for s in incident_signals(i, SLACK_NS)
        if s.name == "nccl_straggler"
    ]
    missed = {
        (m["incident"], m["entity"]) for m in report.missed if m["signal"] == "nccl_straggler"
    }
    return {"expected": len(sigs), "named": sum(1 for s in sigs if s not in missed)}


def verify(lake: Path, truth_path: Path, rules_path: Path = DEFAULT_RULES) -> Verdict:
    """Compare ``lake`` with the truth at ``truth_path``. Raises FileNotFoundError when the
    truth is incomplete, duckdb.Error when the lake cannot be read."""
    truth = load_truth(truth_path)
    con = open_run(lake, truth_path)
    try:
        data = data_counts(con)
        clock = clock_figures(con)  # before the run: its pace is read from the samples' times
        run = run_of(con, truth.run)
        nodes = set(truth.clocks.column("node").to_pylist())
        incidents = truth.incidents.to_pylist()
        report, rules = score_run(con, run, incidents, truth.clocks.to_pylist(), nodes, rules_path)
    finally:
        con.close()
    v = Verdict(
        run, data, clock, report, by_rule(report, rules), _stragglers(report, incidents, run.end_ns)
    )
    v.misses = misses(v)
    return v


def misses(v: Verdict) -> list[str]:
    """Each goal the run missed, in one line."""
    out = []
    for name, c in v.data.items():
        if not c.ok:
            out.append(
                f"{name}: {c.lost} lost, {c.duplicated} duplicated, {c.unexpected} not in the truth"
            )
    if v.run.real_time and v.clock.within_share < WITHIN_BOUND_GOAL:
        out.append(
            f"clock: {100 * v.clock.within_share:.2f} % of samples within their bound "
            f"(goal {100 * WITHIN_BOUND_GOAL:.1f} %)"
        )
    a = v.alerts
    if a.precision < PRECISION_GOAL:
        out.append(f"alerts: precision {a.precision:.3f} (goal {PRECISION_GOAL})")
    if a.incident_recall < RECALL_GOAL:
        out.append(f"alerts: incident recall {a.incident_recall:.3f} (goal {RECALL_GOAL})")
    return out


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3g} ms"


def render(v: Verdict) -> str:
    """The human-readable report."""
    r = v.run
    speed = "flat out" if r.speed is None else f"speed {r.speed:g}"
    lines = [
        f"── verify: the lake against the truth ({speed}, "
        f"{(r.end_ns - r.start_ns) / 1e9:.0f} s) " + "─" * 20
    ]
    for name, c in v.data.items():
        lines.append(
            f"  {name:<12} {c.truth:>10,} expected  {c.landed:>10,} landed  "
            f"lost {c.lost}  duplicated {c.duplicated}  not in truth {c.unexpected}"
        )
    k = v.clock
    judged = "" if r.real_time else "  [not judged: faster than real time, simulated clocks "
    judged += "" if r.real_time else "run ahead of the broker's]"
    lines.append(
        f"  clock        {100 * k.within_share:.3f} % of {k.samples:,} samples within "
        f"their bound; |aligned - true| p50 {_ms(k.err_p50_ns)} p99 "
        f"{_ms(k.err_p99_ns)} max {_ms(k.err_max_ns)}; bound p50 "
        f"{_ms(k.bound_p50_ns)} p99 {_ms(k.bound_p99_ns)}{judged}"
    )
    for w in k.worst_sources:
        lines.append(
            f"    out of bound: {w['source']}  {w['out_of_bound']} of {w['samples']} "
            f"(max {_ms(w['err_max_ns'])})"
        )
    a = v.alerts
    lines.append(
        f"  alerts       precision {a.precision:.3f} ({a.true_positive}/{a.detections})"
        f"  incident recall {a.incident_recall:.3f} "
        f"({a.incidents_detected}/{a.incidents})  straggler cause named "
        f"{v.stragglers['named']}/{v.stragglers['expected']}"
    )
    lines.append(
        "  by rule      "
        + ", ".join(
            f"{k} {x['true']}/{x['false']}" + (f"/{x['not_scored']}" if x["not_scored"] else "")
            for k, x in v.rules.items()
        )
        + "   (true/false[/not scored])"
    )
    for d in a.unmatched:
        lines.append(f"    false: {d['rule']} {d['entity']} at {d['start_ns']} ({d['id']})")
    for m in a.missed:
        lines.append(
            f"    missed: {m['incident']} ({m['kind']}): no {m['signal']} on {m['entity']}"
        )
    reasons: dict[str, int] = {}
    for e in a.excluded:
        reasons[str(e["why"])] = reasons.get(str(e["why"]), 0) + 1
    for why, n in sorted(reasons.items()):
        lines.append(f"    not scored: {n} x {why}")
    lines.append(
        "  verdict      " + ("every goal met" if v.ok else "MISSED: " + "; ".join(v.misses))
    )
    return "\n".join(lines)
