"""Derived streams from refined data, in one place: rule alerts, congestion and throttling
episodes, cross-layer straggler alerts and rollups.

:class:`Detector` wires the pure evaluators of ``pipelines/`` together; it does no I/O. The
Faust agent (:mod:`services.detect.agent`) feeds it records in arrival order and publishes
what it returns. Everything it emits carries stable ids derived from data time, so a replay
of the same input yields the same ids and consumers deduplicate on ``(id, state)``.

Time: refined batches of several partitions interleave, and after a restart or during a
backlog one partition may be read minutes ahead of another. Whatever is judged on data time
— an episode gone quiet, a straggler's cause, a silent source — waits for the **watermark**:
the data time every refined partition has reached, which the service computes and hands to
:meth:`Detector.advance`. The newest ``ts`` of any one batch says nothing about the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import MetricRows
from pipelines.detect.episodes import EpisodeSettings, EpisodeTracker
from pipelines.detect.rollup import Rollup, RollupSettings
from pipelines.detect.rule_config import load_rules
from pipelines.detect.rules import RuleEngine
from pipelines.detect.stragglers import PathLookup, StragglerDetector
from schemas.catalog import Catalog
from schemas.records import Alert, Episode, JobPlacement
from schemas.topics import TOPICS
from services.data_files import data_path

DEFAULT_RULES = data_path("deploy", "rules", "default.yaml")
FIRST_DATA_NS = 120_000_000_000  # how long held collectives wait for the first refined data
# how long held collectives wait while refined data has stopped with none left to read: a
# worker killed and started again (Faust's start, its state's recovery) takes tens of seconds
STALL_NS = 60_000_000_000
# how long (wall time) collectives the watermark has passed wait for a node of their job not
# read that far: a worker catching up on a backlog reads nodes tens of seconds apart; a node
# whose data ended (a job's nodes gone, no silence judged) must not hold them for good
NODE_WAIT_NS = 60_000_000_000


@dataclass
class Emitted:
    alerts: list[Alert] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    rollups: list[pa.Table] = field(default_factory=list)

    def extend(self, other: Emitted) -> None:
        self.alerts += other.alerts
        self.episodes += other.episodes
        self.rollups += other.rollups


class Detector:
    """State of every derived stream of one detect process."""

    def __init__(
        self,
        catalog: Catalog,
        rules_path: Path = DEFAULT_RULES,
        topology: PathLookup | None = None,
        raw_topic: str = TOPICS.raw,
        episodes: EpisodeSettings | None = None,
        rollups: RollupSettings | None = None,
        grace_ns: int = 3_000_000_000,
    ) -> None:
        self.engine = RuleEngine(load_rules(rules_path, catalog), catalog, raw_topic=raw_topic)
        self.episodes = EpisodeTracker(episodes or EpisodeSettings())
        self.stragglers = StragglerDetector([], topology)
        self.rollup = Rollup(rollups or RollupSettings())
        self.watermark = 0  # aligned ts every refined partition has reached (see advance)
        self.newest = 0  # newest aligned ts seen in any refined batch
        self.grace_ns = grace_ns
        self._held: list[_Held] = []
        self._node_latest: dict[str, int] = {}  # node -> newest aligned ts read of its rows
        self._stalled_since: int | None = None  # wall ns since when held data waits in vain

    def set_topology(self, topology: PathLookup) -> None:
        self.stragglers.topology = topology

    def set_jobs(self, jobs: list[JobPlacement]) -> None:
        for j in jobs:
            self.stragglers.set_placement(j)

    def on_refined(self, table: pa.Table, now_ns: int) -> Emitted:
        out = Emitted()
        rows = MetricRows(table) if table.num_rows else None
        out.alerts += self.engine.evaluate(table, now_ns, rows)
        sub = rows.of(self.episodes.metrics) if rows is not None else table
        out.episodes += self.episodes.update(sub, now_ns, until_ns=self.watermark)
        rolled = self.rollup.update(table)
        if rolled.num_rows:
            out.rollups.append(rolled)
        # clock alerts come from the refining stage (it sees every batch's clock estimate)
        if table.num_rows:
            self.newest = max(self.newest, int(pc.max(table.column("ts")).as_py()))
            self._read_nodes(table)
            # refined data still comes (a backlog being caught up partition by partition, a
            # worker starting on one): the watermark will move, held collectives wait for it
            self._stalled_since = None
        return out

    def advance(self, watermark_ns: int, now_ns: int) -> Emitted:
        """Every refined partition has reached ``watermark_ns`` (aligned ts): judge the
        collectives it covers. ``now_ns`` (wall) only stamps records and times stalls.
        The watermark never moves back."""
        if watermark_ns > self.watermark:
            self.watermark = watermark_ns
            self._stalled_since = None
        return self._release_collectives(now_ns)

    def on_events(self, table: pa.Table, now_ns: int) -> Emitted:
        """Aligned events (``ts`` aligned, ``node`` column): onsets of XIDs, link flaps..."""
        ev = _as_ts_ns(table)
        return Emitted(alerts=self.engine.on_events(ev, now_ns))

    def on_collectives(self, table: pa.Table, now_ns: int) -> Emitted:
        """Collectives wait until refined data covers their time plus ``grace_ns``, so the
        congestion episodes on the stragglers' paths are open before they are judged."""
        if table.num_rows:
            t = _as_ts_ns(table)
            due = int(pc.max(t.column("ts_ns")).as_py()) + self.grace_ns
            self._held.append(_Held(due, tuple(pc.unique(t.column("job")).to_pylist()), t))
        return self._release_collectives(now_ns)

    def _read_nodes(self, table: pa.Table) -> None:
        """Each node's rows come in its raw order: the newest ts read of a node is how far
        its data is known, whatever other nodes of the same refined partition reached."""
        if "node" not in table.column_names:
            return
        newest = table.group_by("node").aggregate([("ts", "max")])
        latest = self._node_latest
        for node, ts in zip(newest["node"].to_pylist(), newest["ts_max"].to_pylist(), strict=True):
            if node is not None and ts > latest.get(node, 0):
                latest[node] = ts

    def _reach(self) -> Callable[[str], float]:
        """Per job, the least newest ts read of the nodes its collectives wait for: every
        node of the job, but for nodes found silent and nodes of which neither refined rows
        nor accounting were read (not monitored). Computed once per job per call."""
        silent, accounted = self.engine.silent_nodes(), self.engine.accounted_nodes()
        placements, latest, memo = self.stragglers.placements, self._node_latest, {}

        def reach(job: str) -> float:
            if job not in memo:
                p = placements.get(job)
                waited = [
                    latest.get(n, 0)
                    for n in (p.nodes if p is not None else ())
                    if n not in silent and (n in latest or n in accounted)
                ]
                memo[job] = min(waited, default=math.inf)
            return memo[job]

        return reach

    def _release_collectives(self, now_ns: int, force: bool = False) -> Emitted:
        """Judge the held collectives refined data covers plus the grace (all with
        ``force``): the watermark has passed them, and so has every node of their jobs
        (refined partitions interleave nodes read at paces of their own: one node ahead moves
        a partition's newest ts past another's), but for nodes found silent. A node behind
        holds them back ``NODE_WAIT_NS`` of wall time at most; a node not monitored does
        not."""
        wm = self.watermark
        passed = [h for h in self._held if force or h.due <= wm]
        if not passed:
            return Emitted()
        if not force:
            reach = self._reach()
            for h in passed:
                h.passed_ns = h.passed_ns or now_ns
            passed = [
                h
                for h in passed
                if now_ns - h.passed_ns >= NODE_WAIT_NS or all(reach(j) >= h.due for j in h.jobs)
            ]
            if not passed:
                return Emitted()
        gone = {id(h) for h in passed}
        self._held = [h for h in self._held if id(h) not in gone]
        coll = pa.concat_tables([h.table for h in passed])
        return Emitted(alerts=self.stragglers.update(coll, self.episodes.all_episodes(), now_ns))

    def on_deadletters(self, count: int, now_ns: int) -> None:
        self.engine.on_deadletters(count, now_ns)

    def on_progress(
        self,
        partition: int,
        offset: int,
        append_ns: int,
        node: str | None,
        rows: bool,
        topic: str | None = None,
        ts_max: int | None = None,
    ) -> None:
        """The refiner accounted for a raw record (of ``node``, with refined ``rows`` whose
        newest aligned ts is ``ts_max``, on raw ``topic``): silence is judged on this
        progress."""
        self.engine.on_progress(partition, offset, append_ns, node, rows, topic, ts_max)

    def tick(self, now_ns: int, refined_pending: bool = False) -> Emitted:
        """Time-driven changes, judged on data time (the watermark), so that catching up on
        a backlog does not close episodes early; silent sources are judged on each raw
        partition's progress in broker time (:meth:`on_progress`), so a refiner behind or
        restarting makes nobody silent; a whole pipeline going quiet is the freshness
        rule's business. Collectives are judged anyway once neither the watermark has moved
        nor refined data come for ``STALL_NS`` of wall time (``now_ns``) while they wait
        and none is left to read (``refined_pending``: records of an assigned refined
        partition past detect's position): refined data stopped, and it is only ever judged
        once. Refined data still queued in the broker is coming, however slowly detect
        reads it on a busy host, so the stragglers' causes are judged on it."""
        out = Emitted()
        if self._held and refined_pending:
            self._stalled_since = None
        elif self._held:
            self._stalled_since = self._stalled_since or now_ns
            # before this process has seen any refined data (a worker starting on a backlog
            # takes a while for its first refined group), the refined stream is not stalled,
            # it has not begun: wait for it longer
            seen = self.newest or self.watermark
            patience = STALL_NS if seen else max(STALL_NS, FIRST_DATA_NS)
            if now_ns - self._stalled_since > patience:
                out.extend(self._release_collectives(now_ns, force=True))
        if self.watermark:
            out.alerts += self.engine.tick(self.watermark)
            out.episodes += self.episodes.tick(self.watermark)
            out.alerts += self.stragglers.tick(self.watermark)
        return out

    def flush(self) -> Emitted:
        """At shutdown: judge held collectives, close rollup windows."""
        out = self._release_collectives(0, force=True) if self._held else Emitted()
        rolled = self.rollup.flush()
        if rolled.num_rows:
            out.rollups.append(rolled)
        return out


@dataclass
class _Held:
    """Collectives waiting for refined data to cover ``due`` (their newest ts plus the
    grace), of ``jobs``; ``passed_ns``: when (wall) the watermark passed ``due``."""

    due: int
    jobs: tuple[str, ...]
    table: pa.Table
    passed_ns: int = 0


def _as_ts_ns(table: pa.Table) -> pa.Table:
    """Aligned records carry ``ts`` (common clock) and ``ts_source``; the evaluators read
    ``ts_ns`` as the aligned time."""
    if "ts" not in table.column_names:
        return table
    t = table.drop_columns([c for c in ("ts_ns",) if c in table.column_names])
    names = ["ts_ns" if c == "ts" else c for c in t.column_names]
    return t.rename_columns(names)
