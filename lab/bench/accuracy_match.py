"""Match derived-stream output (alerts, episodes) with a simulator run's truth.

Pure: takes the truth's incident rows, its clock rows and the alert/episode records read from
Kafka as plain dicts; does no I/O. :func:`score` returns an :class:`AccuracyReport`.

What each truth incident should produce (**required** signals count for recall; **optional**
ones make a detection a true positive without being required)::

    xid        gpu_xid on node/gpuN, onset within ``slack`` (plus the bound the alert states on
               it, ``evidence.ts_error_ns``) of the event, same Xid code
    throttle   gpu_thermal_throttle | gpu_power_throttle (by cause) on node/gpuN
               + a throttling episode on node/gpuN;   optional: gpu_temp_high (thermal)
    link_flap  nic_link_down on node/mlx5_K/1
    pfc_storm  a congestion episode on leaf/port (priority 3 or none)
               + per job on the stormed nodes: nccl_straggler on job/<job> whose cause
                 names that port
    reset      optional: exporter_silent on the node's sources (a reboot of exactly the
               silent rule's 3 intervals sits on its threshold)
    wrap       nothing: a counter wrap must not alert
    clock      (from the clock truth, per node) clock_offset on one of the node's sources
               while its true offset exceeded 1 s; optional within ``clock_band`` of 1 s

``dup``, ``late`` and ``malformed`` have no incidents: they must not alert at all. A signal
matches a detection of its rule and entity whose span ``[start, end]`` overlaps the
incident's ``[start - slack, end + slack]`` (unresolved detections extend to infinity).

Detections: one per firing id (alerts and episodes deduplicated on id, as a consumer keying
on the id sees them). ``exporter_silent`` alerts whose onset is at or after the last tick of
the run are the run's end, not an incident: they are listed as ``excluded``, never scored.

>>> inc = [{"id": "xid-000-00", "kind": "xid", "node": "n1", "device": "gpu2", "job": None,
...         "switch": None, "port": None, "start_ns": 10, "end_ns": 11, "detail": '{"code": 79}'}]
>>> al = [{"id": "a", "rule": "gpu_xid", "state": "firing", "entity": "n1/gpu2",
...        "starts_ns": 10, "evidence": {"code": 79}}]
>>> r = score(inc, [], al, [], run=(0, 100))
>>> (r.precision, r.recall)
(1.0, 1.0)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab.simulate.clock_models import truth_offsets

S = 1_000_000_000
FOREVER = 2**62
CLOCK_THRESHOLD_NS = S  # deploy/rules and the refiner: clock_offset above 1 s
# how long a clock must stay beyond the threshold for its alert to be required (clock_signals)
CLOCK_PROVABLE_NS = 3 * S
THROTTLE_RULE = {"thermal": "gpu_thermal_throttle", "power": "gpu_power_throttle"}


@dataclass(frozen=True)
class Detection:
    """One alert or episode as an id-keyed consumer sees it: its firing record, plus the end
    time of its resolved record when there is one."""

    id: str
    rule: str  # alert rule, or "episode:congestion" / "episode:throttling"
    entity: str
    start_ns: int
    end_ns: int | None
    node: str | None = None
    job: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    cause: str | None = None

    def overlaps(self, t0: int, t1: int) -> bool:
        end = FOREVER if self.end_ns is None else max(self.end_ns, self.start_ns)
        return self.start_ns <= t1 and t0 <= end

    def short(self) -> dict[str, Any]:
        return {
            k: getattr(self, k) for k in ("id", "rule", "entity", "start_ns", "end_ns", "cause")
        }


@dataclass(frozen=True)
class Signal:
    """One thing an incident should (``required``) or may produce."""

    incident: str
    kind: str  # fault kind (or "clock")
    name: str  # what is expected, e.g. "gpu_xid", "episode:congestion"
    entity: str
    required: bool
    matches: Callable[[Detection], bool]


@dataclass
class KindScore:
    incidents: int = 0
    incidents_detected: int = 0  # every required signal met
    signals: int = 0
    signals_met: int = 0
    detections: int = 0  # detections matched to an incident of this kind


@dataclass
class AccuracyReport:
    detections: int
    true_positive: int
    signals: int
    signals_met: int
    incidents: int
    incidents_detected: int
    by_kind: dict[str, KindScore]
    unmatched: list[dict[str, Any]]  # detections matching no incident (false positives)
    missed: list[dict[str, Any]]  # required signals no detection met
    excluded: list[dict[str, Any]]  # not scored (the run's end), with the reason
    redundant: list[dict[str, Any]]  # signals met by more than one detection id
    matched: list[dict[str, Any]] = field(default_factory=list)  # true positives

    @property
    def precision(self) -> float:
        return self.true_positive / self.detections if self.detections else 1.0

    @property
    def recall(self) -> float:
        """Required signals met / required signals."""
        return self.signals_met / self.signals if self.signals else 1.0

    @property
    def incident_recall(self) -> float:
        """Incidents with every required signal met / incidents expecting any."""
        return self.incidents_detected / self.incidents if self.incidents else 1.0

    def unmatched_by_rule(self) -> dict[str, int]:
        return _count(d["rule"] for d in self.unmatched)

    def missed_by_kind(self) -> dict[str, int]:
        return _count(m["kind"] for m in self.missed)


def _count(xs: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def detections(
    alerts: Iterable[Mapping[str, Any]], episodes: Iterable[Mapping[str, Any]]
) -> list[Detection]:
    """Alert and episode records (JSON dicts) → one :class:`Detection` per firing id, in
    onset order. A resolved record without a firing one (its firing record was before the
    read) is not a detection."""
    ends: dict[str, int | None] = {}
    firing: dict[str, Detection] = {}
    for a in alerts:
        if a.get("state") == "resolved":
            ends[str(a["id"])] = a.get("ends_ns")
        elif a.get("state") == "firing" and str(a["id"]) not in firing:
            ent = str(a.get("entity", ""))
            node = a.get("node") or (ent.split("|", 1)[0] if "|" in ent else None)
            firing[str(a["id"])] = Detection(
                str(a["id"]),
                str(a["rule"]),
                ent,
                int(a["starts_ns"]),
                None,
                node,
                a.get("job"),
                dict(a.get("evidence") or {}),
                a.get("cause"),
            )
    for e in episodes:
        if e.get("state") == "resolved":
            ends[str(e["id"])] = e.get("end_ns")
        elif e.get("state") == "firing" and str(e["id"]) not in firing:
            ev = {"port": e.get("entity"), "nodes": e.get("nodes", []), "jobs": e.get("jobs", [])}
            firing[str(e["id"])] = Detection(
                str(e["id"]),
                f"episode:{e['kind']}",
                str(e["entity"]),
                int(e["start_ns"]),
                None,
                None,
                None,
                ev,
                e.get("cause_hint"),
            )
    out = [
        Detection(
            d.id, d.rule, d.entity, d.start_ns, ends.get(d.id), d.node, d.job, d.evidence, d.cause
        )
        for d in firing.values()
    ]
    return sorted(out, key=lambda d: (d.start_ns, d.rule, d.entity))


def _detail(row: Mapping[str, Any]) -> dict[str, Any]:
    d = row.get("detail")
    if isinstance(d, str):
        parsed: dict[str, Any] = json.loads(d) if d else {}
        return parsed
    return dict(d or {})


def on_entity(rule: str, entity: str, t0: int, t1: int) -> Callable[[Detection], bool]:
    """Matches a detection of ``rule`` on ``entity`` overlapping ``[t0, t1]``."""
    return lambda d: d.rule == rule and d.entity == entity and d.overlaps(t0, t1)


def incident_signals(
    row: Mapping[str, Any], slack_ns: int, for_ns: Mapping[str, int] | None = None
) -> list[Signal]:
    """The signals one truth incident row should or may produce. ``for_ns``: each rule's
    ``for`` duration; an incident shorter than its rule's cannot fire it (not required)."""
    kind, iid = str(row["kind"]), str(row["id"])
    t0, t1 = int(row["start_ns"]) - slack_ns, int(row["end_ns"]) + slack_ns
    node, dev, det = row.get("node"), row.get("device"), _detail(row)
    gpu = f"{node}/{dev}"

    def sig(name: str, entity: str, required: bool, ok: Callable[[Detection], bool]) -> Signal:
        return Signal(iid, kind, name, entity, required, ok)

    if kind == "xid":
        code, at = det.get("code"), int(row["start_ns"])

        def xid(d: Detection) -> bool:
            # the onset is stated within its clock bound (wide right after a clock step)
            near = abs(d.start_ns - at) <= slack_ns + int(d.evidence.get("ts_error_ns") or 0)
            same = code is None or d.evidence.get("code") == code
            return d.rule == "gpu_xid" and d.entity == gpu and near and same

        return [sig("gpu_xid", gpu, True, xid)]
    if kind == "throttle":
        rule = THROTTLE_RULE.get(str(det.get("cause")), "gpu_thermal_throttle")
        lasts = int(row["end_ns"]) - int(row["start_ns"])
        long_enough = lasts >= (for_ns or {}).get(rule, 0)
        out = [
            sig(rule, gpu, long_enough, on_entity(rule, gpu, t0, t1)),
            sig("episode:throttling", gpu, True, on_entity("episode:throttling", gpu, t0, t1)),
        ]
        if rule == "gpu_thermal_throttle":  # the die heats past 85 degC: true, not required
            out.append(sig("gpu_temp_high", gpu, False, on_entity("gpu_temp_high", gpu, t0, t1)))
        return out
    if kind == "link_flap":
        return [sig("nic_link_down", gpu, True, on_entity("nic_link_down", gpu, t0, t1))]
    if kind == "pfc_storm":
        return _storm_signals(row, det, t0, t1, sig)
    if kind == "reset":

        def silent(d: Detection) -> bool:
            return (
                d.rule == "exporter_silent"
                and d.entity.startswith(f"{node}|")
                and d.overlaps(t0, t1)
            )

        return [sig("exporter_silent", f"{node}|*", False, silent)]
    return []  # wrap, and anything new: no alert expected


def _storm_signals(
    row: Mapping[str, Any], det: dict[str, Any], t0: int, t1: int, sig: Any
) -> list[Signal]:
    switch, port = row.get("switch"), row.get("port")
    ports = (
        {f"{switch}/{port}"} if port not in (None, "all") else None  # every port of the leaf
    )

    def on_port(p: Any) -> bool:
        p = str(p or "")
        return p in ports if ports is not None else p.startswith(f"{switch}/")

    def episode(d: Detection) -> bool:
        if d.rule != "episode:congestion" or not d.overlaps(t0, t1):
            return False
        base = d.entity.rsplit("/prio", 1)[0]
        return on_port(base) and (d.entity == base or d.entity.endswith("/prio3"))

    out = [sig("episode:congestion", f"{switch}/{port}", True, episode)]
    for job in sorted(set(det.get("jobs") or ([row["job"]] if row.get("job") else []))):

        def strag(d: Detection, job: str = job) -> bool:
            return (
                d.rule == "nccl_straggler"
                and d.entity == f"job/{job}"
                and d.overlaps(t0, t1)
                and d.evidence.get("episode_kind") == "congestion"
                and on_port(d.evidence.get("port"))
            )

        out.append(sig("nccl_straggler", f"job/{job}", True, strag))
    return out


def _longest_run(flags: np.ndarray) -> int:
    """The most consecutive True values in ``flags``."""
    best = run = 0
    for f in flags.tolist():
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def clock_signals(
    clocks: Iterable[Mapping[str, Any]], run: tuple[int, int], slack_ns: int, band_ns: int
) -> list[Signal]:
    """Per node whose true clock offset exceeded 1 s during the run (sampled each second,
    rebuilt from its clocks truth row by :func:`lab.simulate.clock_models.truth_offsets`):
    clock_offset on one of its sources while it did. Within ``band_ns`` of 1 s: optional.
    Beyond it for less than :data:`CLOCK_PROVABLE_NS` in a row (a paused VM whose daemon
    steps its clock a second after it resumes): optional too. The rule claims an offset its
    bound proves, and a source's batches carry an exchange taken during the excursion only
    from the one after the first sent in it: a second-long excursion may be gone before any
    batch can prove it; its rows' bounds then cover it (judged with the timestamps)."""
    start, end = run
    out: list[Signal] = []
    grid = np.arange(start, end + 1, S, dtype=np.int64)
    for c in clocks:
        node = str(c["node"])
        # its wall clock's true offset, rebuilt from the truth (steps, slews, pauses...)
        off = np.abs(truth_offsets(c, grid, start))
        over = [int(t) for t in grid[off > CLOCK_THRESHOLD_NS - band_ns]]
        if not over:
            continue
        t0, t1 = over[0] - slack_ns, (end + slack_ns if over[-1] + S > end else over[-1] + slack_ns)

        def ok(d: Detection, node: str = node, t0: int = t0, t1: int = t1) -> bool:
            return d.rule == "clock_offset" and d.node == node and d.overlaps(t0, t1)

        beyond = off > CLOCK_THRESHOLD_NS + band_ns
        required = _longest_run(beyond) * S >= CLOCK_PROVABLE_NS
        out.append(Signal(f"clock-{node}", "clock", "clock_offset", f"{node}|*", required, ok))
    return out


def score(
    incidents: Iterable[Mapping[str, Any]],
    clocks: Iterable[Mapping[str, Any]],
    alerts: Iterable[Mapping[str, Any]],
    episodes: Iterable[Mapping[str, Any]],
    run: tuple[int, int],
    slack_ns: int = 5 * S,
    clock_band_ns: int = 50_000_000,
    interval_ns: int = S,
    explained: Iterable[Signal] = (),
    for_ns: Mapping[str, int] | None = None,
) -> AccuracyReport:
    """Score alerts and episodes of a run ``[start, end)`` (true ns) against its truth.
    Incidents starting at or after ``end`` never happened and are dropped. A detection no
    incident explains but one of ``explained`` (e.g. :func:`lab.bench.accuracy.
    run_signals`) does is listed in
    ``excluded`` with the reason, and scored neither way. ``for_ns``: each rule's ``for``
    duration (an incident shorter than its rule's is not expected to fire it)."""
    end = run[1]
    happened = [i for i in incidents if int(i["start_ns"]) < end]
    signals = [s for i in happened for s in incident_signals(i, slack_ns, for_ns)]
    signals += clock_signals(clocks, run, slack_ns, clock_band_ns)
    dets, excluded = [], []
    for d in detections(alerts, episodes):
        if d.rule == "exporter_silent" and d.start_ns >= end - interval_ns:
            excluded.append({**d.short(), "why": "run end: it silences every exporter"})
        else:
            dets.append(d)
    hits: dict[int, list[Detection]] = {}
    for n, s in enumerate(signals):
        hits[n] = [d for d in dets if s.matches(d)]
    matched_ids = {d.id for ds in hits.values() for d in ds}
    run_sigs = list(explained)
    kept = []
    for d in dets:
        why = next((s.name for s in run_sigs if s.matches(d)), None)
        if d.id in matched_ids or why is None:
            kept.append(d)
        else:
            excluded.append({**d.short(), "why": why})
    dets = kept
    by_kind: dict[str, KindScore] = {}
    per_incident: dict[tuple[str, str], list[int]] = {}
    for n, s in enumerate(signals):
        per_incident.setdefault((s.kind, s.incident), []).append(n)
    for (kind, _), ns in per_incident.items():
        ks = by_kind.setdefault(kind, KindScore())
        req = [n for n in ns if signals[n].required]
        ks.detections += len({d.id for n in ns for d in hits[n]})
        if not req:
            continue
        ks.incidents += 1
        ks.signals += len(req)
        met = [n for n in req if hits[n]]
        ks.signals_met += len(met)
        ks.incidents_detected += len(met) == len(req)
    for i in happened:  # incidents that expect nothing still get a row
        by_kind.setdefault(str(i["kind"]), KindScore())
    missed = [
        {"incident": s.incident, "kind": s.kind, "signal": s.name, "entity": s.entity}
        for n, s in enumerate(signals)
        if s.required and not hits[n]
    ]
    redundant = [
        {"incident": s.incident, "signal": s.name, "ids": sorted(d.id for d in hits[n])}
        for n, s in enumerate(signals)
        if len(hits[n]) > 1 and s.kind != "clock"  # one clock alert per source is expected
    ]
    ks_all = by_kind.values()
    return AccuracyReport(
        detections=len(dets),
        true_positive=sum(1 for d in dets if d.id in matched_ids),
        signals=sum(k.signals for k in ks_all),
        signals_met=sum(k.signals_met for k in ks_all),
        incidents=sum(k.incidents for k in ks_all),
        incidents_detected=sum(k.incidents_detected for k in ks_all),
        by_kind=dict(sorted(by_kind.items())),
        unmatched=[d.short() for d in dets if d.id not in matched_ids],
        missed=missed,
        excluded=excluded,
        redundant=redundant,
        matched=[d.short() for d in dets if d.id in matched_ids],
    )
