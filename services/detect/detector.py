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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import take
from pipelines.detect.episodes import EpisodeSettings, EpisodeTracker, OpenEpisode
from pipelines.detect.rollup import Rollup, RollupSettings
from pipelines.detect.rule_config import load_rules
from pipelines.detect.rule_eval import MetricIndex
from pipelines.detect.rules import RuleEngine
from pipelines.detect.stragglers import PathLookup, StragglerDetector
from schemas.catalog import Catalog
from schemas.records import Alert, Episode, JobPlacement
from schemas.topics import TOPICS
from services.data_files import data_path
from services.detect.collectives import GRACE_NS, CollectiveJudge, Coverage

DEFAULT_RULES = data_path("deploy", "rules", "default.yaml")


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
        grace_ns: int = GRACE_NS,
        coverage: Coverage | None = None,
    ) -> None:
        self.engine = RuleEngine(load_rules(rules_path, catalog), catalog, raw_topic=raw_topic)
        self.episodes = EpisodeTracker(episodes or EpisodeSettings())
        self.stragglers = StragglerDetector([], topology)
        self.rollup = Rollup(rollups or RollupSettings())
        self.watermark = 0  # aligned ts every refined partition it reads has reached
        self.newest = 0  # newest aligned ts seen in any refined batch
        self.refined_batches = 0
        self.node_latest: dict[str, int] = {}  # node -> newest aligned ts read of its rows
        # what refined data covers for the collectives: every replica's progress (a
        # ProgressView), or by default this detector's own (it reads every partition)
        self.own = OwnCoverage(self)
        self.collectives = CollectiveJudge(self.stragglers, coverage or self.own, grace_ns)

    def judge_on(self, coverage: Coverage) -> None:
        """Judge collectives on ``coverage`` (every replica's progress) instead of this
        detector's own."""
        self.collectives.view = coverage

    def set_topology(self, topology: PathLookup) -> None:
        self.stragglers.topology = topology

    def set_jobs(self, jobs: list[JobPlacement]) -> None:
        for j in jobs:
            self.stragglers.set_placement(j)

    def on_refined(self, table: pa.Table, now_ns: int) -> Emitted:
        out = Emitted()
        # one index over the table: its dictionary encodings (metric, node, device) serve
        # the rules, the episodes' rows, the rollup's series and each node's newest ts
        ix = MetricIndex(table, self.engine.row_metrics) if table.num_rows else None
        out.alerts += self.engine.evaluate(table, now_ns, ix)
        eps = self.episodes
        sub = ix.rows_of(eps.metrics, eps.columns) if ix is not None else table
        out.episodes += eps.update(sub, now_ns, until_ns=self.watermark)
        rolled = self.rollup.update(table, ix.encoded if ix is not None else None)
        if rolled.num_rows:
            out.rollups.append(rolled)
        # clock alerts come from the refining stage (it sees every batch's clock estimate)
        if ix is not None:
            self.newest = max(self.newest, int(pc.max(table.column("ts")).as_py()))
            self._read_nodes(ix)
            self.refined_batches += 1
        return out

    def advance(self, watermark_ns: int, now_ns: int) -> Emitted:
        """Every refined partition this detector reads has reached ``watermark_ns`` (aligned
        ts); judge the collectives refined data covers. ``now_ns`` (wall) only stamps
        records and times stalls. The watermark never moves back."""
        self.watermark = max(self.watermark, watermark_ns)
        return Emitted(alerts=self.collectives.release(now_ns))

    def on_events(self, table: pa.Table, now_ns: int) -> Emitted:
        """Aligned events (``ts`` aligned, ``node`` column): onsets of XIDs, link flaps..."""
        ev = _as_ts_ns(table)
        return Emitted(alerts=self.engine.on_events(ev, now_ns))

    def on_collectives(self, table: pa.Table, now_ns: int) -> Emitted:
        """Collectives wait until refined data covers their time plus the grace, so the
        congestion episodes on the stragglers' paths are open before they are judged
        (:class:`~services.detect.collectives.CollectiveJudge`); judged on
        :meth:`advance` and :meth:`tick`."""
        if table.num_rows:
            self.collectives.hold(_as_ts_ns(table))
        return Emitted()

    def _read_nodes(self, ix: MetricIndex) -> None:
        """Each node's rows come in its raw order: the newest ts read of a node is how far
        its data is known, whatever other nodes of the same refined partition reached.
        Grouped on the nodes' dictionary codes (``ix``'s), in order of first row."""
        table = ix.table
        if "node" not in table.column_names:
            return
        enc = ix.encoded("node")
        codes = pa.table({"node": enc.indices, "ts": table.column("ts")})
        newest = codes.group_by("node", use_threads=False).aggregate([("ts", "max")])
        names = take(enc.dictionary, newest["node"]).to_pylist()
        latest = self.node_latest
        for node, ts in zip(names, newest["ts_max"].to_pylist(), strict=True):
            if node is not None and ts > latest.get(node, 0):
                latest[node] = ts

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
        rule's business. Held collectives: see :meth:`CollectiveJudge.tick`
        (``refined_pending``: records of a refined partition this detector reads are left
        past its position, for its own coverage)."""
        self.own.refined_pending = refined_pending
        out = Emitted(alerts=self.collectives.tick(now_ns))
        if self.watermark:
            out.alerts += self.engine.tick(self.watermark)
            out.episodes += self.episodes.tick(self.watermark)
        return out

    def flush(self) -> Emitted:
        """At shutdown: judge held collectives, close rollup windows."""
        out = Emitted(alerts=self.collectives.flush())
        rolled = self.rollup.flush()
        if rolled.num_rows:
            out.rollups.append(rolled)
        return out


class OwnCoverage:
    """A detector's own :class:`~services.detect.collectives.Coverage`, for one that reads
    every refined partition: its watermark, its nodes' newest ts, its silence judgement and
    its episodes."""

    def __init__(self, detector: Detector) -> None:
        self.d = detector
        self.refined_pending = False

    def watermark(self) -> int | None:
        return self.d.watermark or None

    def pending(self) -> bool:
        return self.refined_pending

    def seen(self) -> bool:
        return bool(self.d.newest or self.d.watermark)

    def moved(self) -> int:
        return self.d.refined_batches

    def reach(self, placements: Mapping[str, Any]) -> dict[str, float]:
        silent, accounted = self.d.engine.silent_nodes(), self.d.engine.accounted_nodes()
        latest = self.d.node_latest

        def waited(nodes: list[str]) -> list[int]:
            return [
                latest.get(n, 0)
                for n in nodes
                if n not in silent and (n in latest or n in accounted)
            ]

        return {job: min(waited(p.nodes), default=math.inf) for job, p in placements.items()}

    def episodes(self, watermark: int | None) -> list[OpenEpisode]:
        return self.d.episodes.all_episodes()


def _as_ts_ns(table: pa.Table) -> pa.Table:
    """Aligned records carry ``ts`` (common clock) and ``ts_source``; the evaluators read
    ``ts_ns`` as the aligned time."""
    if "ts" not in table.column_names:
        return table
    t = table.drop_columns([c for c in ("ts_ns",) if c in table.column_names])
    names = ["ts_ns" if c == "ts" else c for c in t.column_names]
    return t.rename_columns(names)
