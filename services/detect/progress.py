"""What detect replicas tell each other: how far each refined partition is read, and the
congestion and throttling episodes of its nodes.

Detect scales out by partitions. Node-local judgement (rules, episodes, rollups, silence)
follows the refined and accounting partitions a replica owns. A job's stragglers are judged
by the replica that owns the job's collectives partition (collectives are keyed by job), and
their causes are the episodes on the ranks' paths, which other replicas track. So every
replica publishes, per refined partition it owns, a :class:`PartitionProgress` into the
group's progress topic (``<group>-progress``, one partition) after each group of records and
each tick, and every replica follows that topic into a :class:`ProgressView`:

- ``behind`` / ``latest``: whether records are left to read in the partition and the newest
  aligned ts read there; the view's :meth:`~ProgressView.watermark` is the data time every
  refined partition has reached, as one process computed it over all of them
  (:func:`services.detect.core.low_watermark`);
- ``nodes``: each node's newest aligned ts read (a job's collectives wait for its nodes);
- ``open``: the partition's open episodes, whole (their peaks grow while they last);
  ``closed``: episodes closed since the replica's previous record of the partition (all it
  holds in the first one after an assignment); the view keeps closed ones ``retain_ns``.

Per accounting partition a replica publishes the nodes it found silent, the nodes it has
accounting for (silence is judged on the accounting partitions) and its dead letters per
second; the dead-letter rate is a cluster's figure, judged by the owner of accounting
partition 0 on the sum. A partition's newest record
wins; records of partitions a replica owns itself are applied locally, never from the topic
(its own view is the freshest). Ids are functions of the data, so two replicas that tracked
one episode across a rebalance publish the same episode.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pipelines.detect.episodes import OpenEpisode

RETAIN_NS = 600_000_000_000  # closed episodes kept for stragglers (EpisodeSettings.retain_ns)


def replica_id() -> str:
    """This process's replica name: host, pid and a random suffix (a restarted process on
    the same pid is another replica)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class PartitionProgress:
    """One refined partition as its owner last saw it."""

    behind: bool  # records left to read (or the high watermark not known)
    latest: int | None  # newest aligned ts read
    nodes: dict[str, int] = field(default_factory=dict)
    open: list[dict[str, Any]] = field(default_factory=list)
    closed: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class AccountingProgress:
    """One accounting partition's owner: nodes found silent, nodes with accounting read."""

    silent: list[str] = field(default_factory=list)
    accounted: list[str] = field(default_factory=list)
    # dead letters of the partition per second of broker append time: [[second, count]...]
    deadletters: list[list[int]] = field(default_factory=list)


@dataclass
class Marker:
    """One replica's progress record."""

    replica: str
    at_ns: int
    refined: dict[int, PartitionProgress] = field(default_factory=dict)
    accounting: dict[int, AccountingProgress] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "replica": self.replica,
            "at_ns": self.at_ns,
            "refined": {str(p): asdict(e) for p, e in self.refined.items()},
            "accounting": {str(p): asdict(e) for p, e in self.accounting.items()},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Marker:
        doc = json.loads(data)
        return cls(
            str(doc["replica"]),
            int(doc["at_ns"]),
            {int(p): PartitionProgress(**e) for p, e in doc.get("refined", {}).items()},
            {int(p): AccountingProgress(**e) for p, e in doc.get("accounting", {}).items()},
        )


class ProgressView:
    """Every refined partition's progress and every replica's episodes, as the progress
    topic and this replica's own records tell them. Thread-safe (the topic is followed in a
    thread of its own)."""

    def __init__(self, replica: str, partitions: int | None = None) -> None:
        self.replica = replica
        self.partitions = partitions  # the refined topic's partition count (None: those seen)
        self._lock = threading.Lock()
        self._refined: dict[int, PartitionProgress] = {}
        self._accounting: dict[int, AccountingProgress] = {}
        self._closed: dict[str, OpenEpisode] = {}
        self._owned: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
        self.version = 0  # moves with every record applied

    def own(self, refined: Iterable[int], accounting: Iterable[int]) -> None:
        """The partitions this replica owns: records of others about them are ignored."""
        with self._lock:
            self._owned = (frozenset(refined), frozenset(accounting))

    def apply(self, m: Marker) -> None:
        """Fold a progress record in (this replica's own, or another's from the topic)."""
        mine = m.replica == self.replica
        with self._lock:
            owned_r, owned_a = self._owned
            for p, e in m.refined.items():
                if mine or p not in owned_r:
                    self._refined[p] = e
                    for d in e.closed:
                        self._closed[d["id"]] = OpenEpisode(**d)
            for p, a in m.accounting.items():
                if mine or p not in owned_a:
                    self._accounting[p] = a
            self.version += 1

    def watermark(self) -> int | None:
        """The data time every refined partition has reached: the least newest ts of the
        partitions with records left to read, else the newest ts read; None while a
        partition has not been heard of, or is behind with nothing read."""
        with self._lock:
            entries = dict(self._refined)
        want = range(self.partitions) if self.partitions else entries
        behind: list[int] = []
        for p in want:
            e = entries.get(p)
            if e is None:
                return None
            if e.behind:
                if e.latest is None:
                    return None
                behind.append(e.latest)
        if behind:
            return min(behind)
        return max((e.latest for e in entries.values() if e.latest is not None), default=None)

    def deadletters(self) -> dict[int, int]:
        """Dead letters of every accounting partition per second of broker append time."""
        out: dict[int, int] = {}
        with self._lock:
            for a in self._accounting.values():
                for sec, n in a.deadletters:
                    out[sec] = out.get(sec, 0) + n
        return out

    def pending(self) -> bool:
        """Whether some refined partition still has records to read."""
        with self._lock:
            return any(e.behind for e in self._refined.values())

    def moved(self) -> int:
        """A number that moves whenever some partition's newest ts read does."""
        with self._lock:
            return sum(e.latest or 0 for e in self._refined.values())

    def seen(self) -> bool:
        """Whether any refined data has been read (by any replica)."""
        with self._lock:
            return any(e.latest is not None for e in self._refined.values())

    def reach(self, placements: Mapping[str, Any]) -> dict[str, float]:
        """Per job of ``placements`` (job → placement with ``nodes``), the least newest ts
        read of the nodes its collectives wait for: every node of the job but those found
        silent and those neither read nor accounted for (not monitored)."""
        with self._lock:
            latest: dict[str, int] = {}
            for e in self._refined.values():
                latest.update(e.nodes)
            silent = {n for a in self._accounting.values() for n in a.silent}
            accounted = {n for a in self._accounting.values() for n in a.accounted}
        out: dict[str, float] = {}
        for job, p in placements.items():
            waited = [
                latest.get(n, 0)
                for n in p.nodes
                if n not in silent and (n in latest or n in accounted)
            ]
            out[job] = min(waited, default=math.inf)
        return out

    def episodes(self, watermark: int | None) -> list[OpenEpisode]:
        """Closed episodes still retained at ``watermark``, then every partition's open
        ones (an id closed wins over the same id still open in an older record)."""
        with self._lock:
            if watermark is not None:
                lo = watermark - RETAIN_NS
                self._closed = {k: e for k, e in self._closed.items() if (e.end_ns or 0) >= lo}
            closed = list(self._closed.values())
            opened = {
                d["id"]: d
                for e in self._refined.values()
                for d in e.open
                if d["id"] not in self._closed
            }
        return [*closed, *(OpenEpisode(**d) for d in opened.values())]
