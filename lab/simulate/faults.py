"""Fault specification and incident planning.

Spec grammar (``--faults``)::

    spec   := "all" | "none" | item ("," item)*
    item   := ["-"] kind [":" param] | param        # a bare param continues the previous kind
    param  := name "=" value
    kind   := dup | clock | reset | wrap | malformed | late | pfc_storm | link_flap
            | throttle | xid | chrony_slew | ntpd_slew | steps | vm_pause | ptp
            | leap_smear | fast_clock

``all`` enables every kind with defaults; ``all,-dup`` all but one; parameters are per kind, e.g.
``pfc_storm:leaf=leaf-p0-r3,port=2,start=20,dur=15,xid:count=3``. Times (``start``, ``dur``,
``delay``) are seconds of simulated time from the start of the run; an explicit ``start`` places
the incident in the first planning window only.

Parameters by kind (defaults in brackets):

============  ===========================================================================
pfc_storm     leaf [random], port [random; ``all`` = every port], start, dur [20 % window],
              count [1 per window]
link_flap     node, nic, start, dur [3 s], count [1]
throttle      node, gpu, cause [thermal|power, random], start, dur [20 % window], count [1]
xid           node, gpu, code [79|48|119|94|63|31, random], start, count [2]
reset         node [an idle node if any], start, dur [downtime, 3 intervals], count [1]
wrap          node, nic, start [approximate wrap time]
clock         node [forced bad node], fraction [0.25 of nodes skewed], max_offset [3600 s],
              max_drift [200 ppm], step [random ±0.5..30 s, once per window]
chrony_slew   node, fraction [one node], start, offset [random ±0.05..0.5 s], maxslewrate
              [83333 ppm], correction [chrony's correction_rate, 0.0096 s²; once per window]
ntpd_slew     node, fraction, start, offset [random ±0.01..0.1 s], rate [500 ppm; per window]
steps         node, start, sizes [``30|-120|5000`` µs, ``every`` 2 s apart], pair [``1588|-1548``
              µs, ``gap`` 0.3 s apart, between two sends; once per window]
vm_pause      node [an idle node], start, pause [random 0.5..2 s], delay [1 s], maxslewrate,
              correction [once per window]
ptp           node, fraction, offset [random ±200 ns], wander [300 ns; the whole run]
leap_smear    node, fraction, ppm [-11.574; the whole run]
fast_clock    node, start, ppm [random ±1000], dur [60 s; once per window]
dup           rate [0.003 of batches; at least one per window]
late          rate [0.002 of batches; at least one per window], delay [3 s]
malformed     reasons [all; ``|``-separated Reason values], every [once per window each]
============  ===========================================================================

The clock models (``chrony_slew`` .. ``fast_clock``) are no incidents: they are planned with the
clocks (:mod:`.clocks`, which says what each does) and recorded in the clocks truth.

Incidents are planned per window (``window_ns``, the run's duration capped at 120 s) from
``(seed, window index)``, so an endless run keeps producing faults and any prefix of a run is
the same whatever its total length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from lab.simulate.cluster import Cluster
from schemas.errors import ConfigError
from schemas.reasons import REFINER_REASONS, Reason

S = 1_000_000_000


class FaultKind(StrEnum):
    DUP = "dup"
    CLOCK = "clock"
    RESET = "reset"
    WRAP = "wrap"
    MALFORMED = "malformed"
    LATE = "late"
    PFC_STORM = "pfc_storm"
    LINK_FLAP = "link_flap"
    THROTTLE = "throttle"
    XID = "xid"
    # clock models (lab.simulate.clocks): real clock discipline, in the clocks truth
    CHRONY_SLEW = "chrony_slew"
    NTPD_SLEW = "ntpd_slew"
    STEPS = "steps"
    VM_PAUSE = "vm_pause"
    PTP = "ptp"
    LEAP_SMEAR = "leap_smear"
    FAST_CLOCK = "fast_clock"


@dataclass(frozen=True)
class FaultSpec:
    """Enabled fault kinds and their parameters (strings, as given)."""

    enabled: dict[FaultKind, dict[str, str]] = field(default_factory=dict)

    def on(self, kind: FaultKind) -> bool:
        return kind in self.enabled

    def param(self, kind: FaultKind, name: str) -> str | None:
        return self.enabled.get(kind, {}).get(name)

    def fparam(self, kind: FaultKind, name: str, default: float) -> float:
        v = self.param(kind, name)
        try:
            return default if v is None else float(v)
        except ValueError as e:
            raise ConfigError(f"--faults: {kind}:{name}={v!r} is not a number") from e


def parse_faults(spec: str | None) -> FaultSpec:
    """Parse a ``--faults`` spec; raises ConfigError on an unknown kind or a stray param."""
    if spec is None or spec.strip() in ("", "none"):
        return FaultSpec()
    enabled: dict[FaultKind, dict[str, str]] = {}
    current: FaultKind | None = None
    for raw in spec.split(","):
        tok = raw.strip()
        if not tok:
            continue
        if tok == "all":
            for k in FaultKind:
                enabled.setdefault(k, {})
            current = None
            continue
        if "=" in tok and ":" not in tok.split("=", 1)[0]:
            if current is None:
                raise ConfigError(f"--faults: parameter {tok!r} follows no fault kind")
            name, value = tok.split("=", 1)
            enabled[current][name.strip()] = value.strip()
            continue
        head, _, param = tok.partition(":")
        drop = head.startswith("-")
        try:
            kind = FaultKind(head.lstrip("-"))
        except ValueError as e:
            known = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"--faults: unknown fault {head!r} (known: {known})") from e
        if drop:
            enabled.pop(kind, None)
            current = None
            continue
        enabled.setdefault(kind, {})
        current = kind
        if param:
            if "=" not in param:
                raise ConfigError(f"--faults: parameter {param!r} of {kind} needs name=value")
            name, value = param.split("=", 1)
            enabled[kind][name.strip()] = value.strip()
    return FaultSpec(enabled)


@dataclass(frozen=True)
class Incident:
    """One injected fault with its true time span (ns, true clock) and the entities it hits."""

    id: str
    kind: FaultKind
    start_ns: int
    end_ns: int
    node: str | None = None
    device: str | None = None
    switch: str | None = None
    port: str | None = None
    job: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    node_idx: tuple[int, ...] = ()  # the nodes it acts on
    unit: int = -1  # the rail / GPU index it acts on (-1: none)

    def active(self, t_ns: int) -> bool:
        return self.start_ns <= t_ns < self.end_ns

    def row(self) -> dict[str, Any]:
        """The incident as a truth row (``*.incidents.parquet``)."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "node": self.node,
            "device": self.device,
            "switch": self.switch,
            "port": self.port,
            "job": self.job,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "detail": json.dumps(self.detail, sort_keys=True),
        }


XID_CODES = (79, 48, 119, 94, 63, 31)
PLANNED = (
    FaultKind.PFC_STORM,
    FaultKind.LINK_FLAP,
    FaultKind.THROTTLE,
    FaultKind.XID,
    FaultKind.RESET,
    FaultKind.WRAP,
)


def plan_window(
    cluster: Cluster,
    spec: FaultSpec,
    seed: int,
    w: int,
    window_ns: int,
    start_ns: int,
    interval_ns: int,
) -> list[Incident]:
    """Incidents of planning window ``w`` (deterministic in ``seed`` and ``w``)."""
    rng = np.random.default_rng([seed, 7919, w])
    w0 = start_ns + w * window_ns
    out: list[Incident] = []
    job_of = cluster.job_of_node()
    names = cluster.job_list

    def when(kind: FaultKind, dur_default: float) -> tuple[int, int]:
        dur = int(spec.fparam(kind, "dur", dur_default) * S)
        st = spec.param(kind, "start")
        if st is not None and w == 0:
            t0 = start_ns + int(float(st) * S)
        else:
            t0 = w0 + int(rng.uniform(0.1, 0.6) * window_ns)
        t0 = start_ns + (t0 - start_ns) // interval_ns * interval_ns  # on a tick boundary
        return t0, t0 + max(dur, interval_ns)

    def pick_node(kind: FaultKind, prefer_busy: bool) -> int:
        v = spec.param(kind, "node")
        if v is not None:
            idx = cluster.node_names.index(v) if v in cluster.node_names else int(v)
            if not 0 <= idx < cluster.n_nodes:
                raise ConfigError(f"--faults: {kind}: no node {v!r}")
            return idx
        pool = [i for i in range(cluster.n_nodes) if (job_of[i] >= 0) == prefer_busy]
        pool = pool or list(range(cluster.n_nodes))
        return int(pool[rng.integers(len(pool))])

    def count(kind: FaultKind, default: int) -> int:
        return int(spec.fparam(kind, "count", default))

    def job_name(i: int) -> str | None:
        return names[job_of[i]].job if job_of[i] >= 0 else None

    k = FaultKind.PFC_STORM
    for n in range(count(k, 1) if spec.on(k) else 0):
        leaf = spec.param(k, "leaf")
        if leaf is None:
            leaf = cluster.leaf_of(pick_node(k, True), int(rng.integers(cluster.nics)))
        port = spec.param(k, "port")
        behind = cluster.nodes_behind(leaf, None)
        if port is None and behind:
            port = cluster.port_of(behind[int(rng.integers(len(behind)))])
        idx = cluster.nodes_behind(leaf, None if port == "all" else port)
        rail = int(leaf.rsplit("-r", 1)[1])
        t0, t1 = when(k, 0.2 * window_ns / S)
        jobs = sorted({j for i in idx if (j := job_name(i)) is not None})
        out.append(
            Incident(
                f"pfc_storm-{w:03d}-{n:02d}",
                k,
                t0,
                t1,
                node=cluster.node_name(idx[0]) if len(idx) == 1 else None,
                device=f"mlx5_{rail}/1",
                switch=leaf,
                port=port,
                job=jobs[0] if jobs else None,
                detail={"priority": 3, "nodes": [cluster.node_name(i) for i in idx], "jobs": jobs},
                node_idx=tuple(idx),
                unit=rail,
            )
        )
    k = FaultKind.LINK_FLAP
    for n in range(count(k, 1) if spec.on(k) else 0):
        i = pick_node(k, True)
        nic = int(spec.fparam(k, "nic", float(rng.integers(cluster.nics))))
        t0, t1 = when(k, 3.0)
        out.append(
            Incident(
                f"link_flap-{w:03d}-{n:02d}",
                k,
                t0,
                t1,
                node=cluster.node_name(i),
                device=f"mlx5_{nic}/1",
                switch=cluster.leaf_of(i, nic),
                port=cluster.port_of(i),
                job=job_name(i),
                node_idx=(i,),
                unit=nic,
            )
        )
    k = FaultKind.THROTTLE
    for n in range(count(k, 1) if spec.on(k) else 0):
        i = pick_node(k, True)
        g = int(spec.fparam(k, "gpu", float(rng.integers(cluster.gpus))))
        cause = spec.param(k, "cause") or ("thermal", "power")[int(rng.integers(2))]
        t0, t1 = when(k, 0.2 * window_ns / S)
        bits = 0x20 | 0x40 if cause == "thermal" else 0x4 | 0x80
        out.append(
            Incident(
                f"throttle-{w:03d}-{n:02d}",
                k,
                t0,
                t1,
                node=cluster.node_name(i),
                device=f"gpu{g}",
                job=job_name(i),
                detail={"cause": cause, "bits": bits},
                node_idx=(i,),
                unit=g,
            )
        )
    k = FaultKind.XID
    for n in range(count(k, 2) if spec.on(k) else 0):
        i = pick_node(k, True)
        g = int(spec.fparam(k, "gpu", float(rng.integers(cluster.gpus))))
        code = int(spec.fparam(k, "code", float(XID_CODES[int(rng.integers(len(XID_CODES)))])))
        t0, _ = when(k, 0.0)
        t0 += int(rng.integers(interval_ns))  # events happen between scrapes
        out.append(
            Incident(
                f"xid-{w:03d}-{n:02d}",
                k,
                t0,
                t0 + 1,
                node=cluster.node_name(i),
                device=f"gpu{g}",
                job=job_name(i),
                detail={"code": code},
                node_idx=(i,),
                unit=g,
            )
        )
    k = FaultKind.RESET
    for n in range(count(k, 1) if spec.on(k) else 0):
        i = pick_node(k, False)
        t0, t1 = when(k, 3 * interval_ns / S)
        out.append(
            Incident(
                f"reset-{w:03d}-{n:02d}",
                k,
                t0,
                t1,
                node=cluster.node_name(i),
                job=job_name(i),
                detail={"what": "reboot: new boot_id, counters restart"},
                node_idx=(i,),
            )
        )
    k = FaultKind.WRAP
    if spec.on(k) and w == 0:
        i = pick_node(k, True)
        nic = int(spec.fparam(k, "nic", float(rng.integers(cluster.nics))))
        t0, _ = when(k, 0.0)
        out.append(
            Incident(
                f"wrap-{w:03d}-00",
                k,
                t0,
                t0 + interval_ns,
                node=cluster.node_name(i),
                device=f"mlx5_{nic}/1",
                detail={"metric": "rdma.out_of_sequence", "width": 32, "approximate": True},
                node_idx=(i,),
                unit=nic,
            )
        )
    return _after_reboots(out, interval_ns)


def _after_reboots(out: list[Incident], interval_ns: int) -> list[Incident]:
    """``out`` with each XID planned while its node is down (a reset: the node reports
    nothing) moved to as far into the tick after the node is back up: it is the truth of an
    event the node can report."""
    downs = [(x.node_idx, x.start_ns, x.end_ns) for x in out if x.kind is FaultKind.RESET]
    moved = []
    for x in out:
        for nodes, a, b in downs:
            if x.kind is FaultKind.XID and x.node_idx == nodes and a <= x.start_ns < b:
                t0 = b + (x.start_ns - a) % interval_ns
                x = replace(x, start_ns=t0, end_ns=t0 + 1)
        moved.append(x)
    return moved


def malformed_reasons(spec: FaultSpec) -> list[Reason]:
    """The dead-letter reasons to inject, in Reason declaration order."""
    if not spec.on(FaultKind.MALFORMED):
        return []
    sel = spec.param(FaultKind.MALFORMED, "reasons")
    if sel is None:  # every reason a malformed record can carry
        return [r for r in Reason if r not in REFINER_REASONS]
    try:
        chosen = {Reason(r.strip()) for r in sel.split("|") if r.strip()}
    except ValueError as e:
        raise ConfigError(f"--faults: malformed:reasons={sel!r}: {e}") from e
    return [r for r in Reason if r in chosen]
