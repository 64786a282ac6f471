"""Alert lifecycle: stable ids, lineage, and the hysteresis state machine every rule shares.

An alert is born ``firing`` and dies ``resolved`` with the **same id**. The id is a pure
function of what the alert is about, never of when it was processed::

    alert_id(rule, entity, onset_ns)  ==  sha1(rule | entity | onset bucket)[:20]

so a replay of the same input after a crash or restart produces byte-identical ids and
consumers deduplicate on ``(id, state)``. A condition that resolves and fires again within
one onset bucket would get the id it had before (and a consumer would drop the new firing as
a duplicate): :class:`AlertBook` gives such a re-fire an id keyed on its exact onset instead,
still a function of the data.

:class:`Hysteresis` is the per-(rule, entity) state machine: a condition must hold (``hi``)
for ``for_ns`` before the alert fires; once firing it resolves only when the value falls to
the resolve side (``lo``); anything in between (``mid``) keeps the current state, so a value
wandering around the threshold does not flap. Its state is a small dict (``to_dict``).

Pure: no clocks, no I/O; ``emitted_ns`` is passed in.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from schemas.records import Alert, AlertState, Lineage, Severity
from schemas.topics import TOPICS

DEFAULT_BUCKET_NS = 60_000_000_000
REFIRE_NS = 2 * DEFAULT_BUCKET_NS  # how long a resolved id is remembered against re-fires
RESOLVED_KEY = "\x1fresolved"
RAW_TOPIC = TOPICS.raw  # the raw topic of rows that name none

# Classes a value falls into relative to a rule's thresholds.
LO, MID, HI = 0, 1, 2


def stable_id(*parts: object) -> str:
    """sha1 over ``parts`` joined by ``|`` (20 hex chars)."""
    text = "|".join(str(p) for p in parts)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def alert_id(rule: str, entity: str, onset_ns: int, bucket_ns: int = DEFAULT_BUCKET_NS) -> str:
    """The stable id of the alert of ``rule`` on ``entity`` whose condition began at
    ``onset_ns`` (floored to ``bucket_ns``; ``bucket_ns=1`` keys on the exact time)."""
    return stable_id("alert", rule, entity, onset_ns // max(bucket_ns, 1))


def lineage_of(table: pa.Table, topic: str = RAW_TOPIC) -> list[Lineage]:
    """Offset range per raw partition of the rows of ``table`` (REFINED_SCHEMA lineage
    columns), one :class:`Lineage` per partition, in partition order."""
    if table.num_rows == 0 or "raw_partition" not in table.column_names:
        return []
    g = table.group_by("raw_partition", use_threads=False).aggregate(
        [("raw_offset", "min"), ("raw_offset", "max")]
    )
    rows = g.sort_by("raw_partition").to_pylist()
    return [
        Lineage(
            topic=topic,
            partition=int(r["raw_partition"]),
            offset_first=int(r["raw_offset_min"]),
            offset_last=int(r["raw_offset_max"]),
        )
        for r in rows
        if r["raw_partition"] is not None
    ]


def merge_lineage(a: list[Lineage], b: list[Lineage]) -> list[Lineage]:
    """Union of two lineage lists: one widened offset range per (topic, partition)."""
    out: dict[tuple[str, int], Lineage] = {}
    for x in (*a, *b):
        k = (x.topic, x.partition)
        y = out.get(k)
        out[k] = (
            x
            if y is None
            else Lineage(
                topic=x.topic,
                partition=x.partition,
                offset_first=min(x.offset_first, y.offset_first),
                offset_last=max(x.offset_last, y.offset_last),
            )
        )
    return [out[k] for k in sorted(out)]


def classify(values: Any, fire: float, resolve: float, below: bool) -> Any:
    """Vectorized :data:`HI`/:data:`MID`/:data:`LO` classes (int8; NULL where value is NULL).

    ``below=False``: HI when ``v > fire``, LO when ``v <= resolve``. ``below=True`` mirrors
    it: HI when ``v < fire``, LO when ``v >= resolve``."""
    if below:
        hi, lo = pc.less(values, fire), pc.greater_equal(values, resolve)
    else:
        hi, lo = pc.greater(values, fire), pc.less_equal(values, resolve)
    h, m, lo_ = (pa.scalar(c, pa.int8()) for c in (HI, MID, LO))
    return pc.if_else(hi, h, pc.if_else(lo, lo_, m))


@dataclass
class Firing:
    """What a firing alert needs to emit its resolved record later."""

    id: str
    starts_ns: int
    summary: str
    severity: str
    node: str | None = None
    device: str | None = None
    job: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    lineage: list[dict[str, Any]] = field(default_factory=list)
    entity: str = ""  # when the book keys the alert by something finer than its entity

    def alert(self, rule: str, entity: str, state: AlertState, ends: int | None, now: int) -> Alert:
        return Alert(
            id=self.id,
            rule=rule,
            state=state,
            severity=Severity(self.severity),
            entity=self.entity or entity,
            node=self.node,
            device=self.device,
            job=self.job,
            starts_ns=self.starts_ns,
            ends_ns=ends,
            summary=self.summary,
            evidence=self.evidence,
            lineage=[Lineage.model_validate(x) for x in self.lineage],
            emitted_ns=now,
        )

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Firing:
        return Firing(**d)


@dataclass
class Hysteresis:
    """State of one (rule, entity): pending onset and/or the firing alert."""

    pending_since: int | None = None
    pending_lineage: list[dict[str, Any]] = field(default_factory=list)
    firing: Firing | None = None
    last_ts: int = 0

    def step(
        self, cls: int, ts: int, for_ns: int, lineage: list[Lineage] | None = None
    ) -> str | None:
        """Advance with one observation of class ``cls`` at ``ts``; returns ``"fire"``,
        ``"resolve"`` or None. The caller builds the alert records."""
        self.last_ts = max(self.last_ts, ts)
        lin = [x.model_dump() for x in lineage or []]
        if self.firing is not None:
            if cls == LO:
                return "resolve"
            return None
        if cls != HI:
            self.pending_since = None
            self.pending_lineage = []
            return None
        if self.pending_since is None:
            self.pending_since = ts
            self.pending_lineage = lin
        else:
            merged = merge_lineage(
                [Lineage.model_validate(x) for x in self.pending_lineage],
                lineage or [],
            )
            self.pending_lineage = [x.model_dump() for x in merged]
        if ts - self.pending_since >= for_ns:
            return "fire"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Hysteresis:
        f = d.get("firing")
        return Hysteresis(
            pending_since=d.get("pending_since"),
            pending_lineage=list(d.get("pending_lineage", [])),
            firing=Firing.from_dict(f) if f else None,
            last_ts=int(d.get("last_ts", 0)),
        )


class AlertBook:
    """Open alerts and pending conditions keyed by ``(rule, entity)``; emits the lifecycle
    records. Bounded by the number of distinct (rule, entity) pairs that are pending or
    firing: idle pairs are dropped."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, str], Hysteresis] = {}
        # ids resolved lately per (rule, entity), with their onsets: a re-fire in the same
        # onset bucket must not reuse one
        self.resolved: dict[tuple[str, str], list[tuple[int, str]]] = {}

    def get(self, rule: str, entity: str) -> Hysteresis:
        return self.states.setdefault((rule, entity), Hysteresis())

    def fire(
        self,
        rule: str,
        entity: str,
        firing: Firing,
        now_ns: int,
    ) -> Alert:
        """Record ``firing`` as open for (rule, entity) and return its firing record."""
        st = self.get(rule, entity)
        before = self.resolved.get((rule, entity), [])
        if any(i == firing.id for _, i in before):
            exact = stable_id("alert", rule, entity, "at", firing.starts_ns)
            firing = replace(firing, id=exact)
        st.firing = firing
        st.pending_since = None
        st.pending_lineage = []
        return firing.alert(rule, entity, AlertState.FIRING, None, now_ns)

    def resolve(self, rule: str, entity: str, ends_ns: int, now_ns: int) -> Alert | None:
        """Close the open alert of (rule, entity), if any, and return its resolved record."""
        st = self.states.get((rule, entity))
        if st is None or st.firing is None:
            return None
        out = st.firing.alert(rule, entity, AlertState.RESOLVED, ends_ns, now_ns)
        del self.states[(rule, entity)]
        onset = st.firing.starts_ns
        kept = [(t, i) for t, i in self.resolved.get((rule, entity), []) if onset - t < REFIRE_NS]
        self.resolved[(rule, entity)] = [*kept, (onset, st.firing.id)]
        return out

    def is_firing(self, rule: str, entity: str) -> bool:
        st = self.states.get((rule, entity))
        return st is not None and st.firing is not None

    def gc(self) -> None:
        """Drop idle entries (neither pending nor firing)."""
        for k in [
            k for k, s in self.states.items() if s.firing is None and s.pending_since is None
        ]:
            del self.states[k]
        horizon = max((t for v in self.resolved.values() for t, _ in v), default=0) - REFIRE_NS
        self.resolved = {
            k: kept for k, v in self.resolved.items() if (kept := [x for x in v if x[0] > horizon])
        }

    def to_dict(self) -> dict[str, Any]:
        self.gc()
        out: dict[str, Any] = {f"{r}\x1f{e}": s.to_dict() for (r, e), s in self.states.items()}
        if self.resolved:
            out[RESOLVED_KEY] = [[r, e, t, i] for (r, e), v in self.resolved.items() for t, i in v]
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> AlertBook:
        b = AlertBook()
        for r, e, t, i in d.get(RESOLVED_KEY, []):
            b.resolved.setdefault((r, e), []).append((int(t), str(i)))
        for k, v in d.items():
            if k == RESOLVED_KEY:
                continue
            r, e = k.split("\x1f", 1)
            b.states[(r, e)] = Hysteresis.from_dict(v)
        return b
