"""Derived streams from refined data, in one place: rule alerts, congestion and throttling
episodes, cross-layer straggler alerts and rollups.

:class:`Detector` wires the pure evaluators of ``pipelines/`` together; it does no I/O. The
service (:mod:`services.detect.service`) feeds it records in arrival order and publishes
what it returns. Everything it emits carries stable ids derived from data time, so a replay
of the same input yields the same ids and consumers deduplicate on ``(id, state)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from pipelines.episodes import EpisodeSettings, EpisodeTracker
from pipelines.rollup import Rollup, RollupSettings
from pipelines.rule_config import load_rules
from pipelines.rule_health import ClockStatus
from pipelines.rules import RuleEngine
from pipelines.stragglers import PathLookup, StragglerDetector
from schemas.catalog import Catalog
from schemas.records import Alert, Episode, JobPlacement

DEFAULT_RULES = Path(__file__).resolve().parents[2] / "deploy" / "rules" / "default.yaml"


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
        raw_topic: str = "telemetry.raw",
        episodes: EpisodeSettings | None = None,
        rollups: RollupSettings | None = None,
    ) -> None:
        self.engine = RuleEngine(load_rules(rules_path, catalog), catalog, raw_topic=raw_topic)
        self.episodes = EpisodeTracker(episodes or EpisodeSettings())
        self.stragglers = StragglerDetector([], topology)
        self.rollup = Rollup(rollups or RollupSettings())
        self._clock_seen: dict[str, int] = {}

    def set_topology(self, topology: PathLookup) -> None:
        self.stragglers.topology = topology

    def set_jobs(self, jobs: list[JobPlacement]) -> None:
        for j in jobs:
            self.stragglers.set_placement(j)

    def on_refined(self, table: pa.Table, now_ns: int) -> Emitted:
        out = Emitted()
        out.alerts += self.engine.evaluate(table, now_ns)
        out.episodes += self.episodes.update(table, now_ns)
        rolled = self.rollup.update(table)
        if rolled.num_rows:
            out.rollups.append(rolled)
        out.alerts += self.engine.on_clock(self._clock_status(table), now_ns)
        return out

    def _clock_status(self, table: pa.Table) -> list[ClockStatus]:
        """One status per source stream in the batch (its latest sample)."""
        if table.num_rows == 0:
            return []
        node = table.column("node")[0].as_py()
        exporter = table.column("exporter")[0].as_py()
        instance = table.column("instance")[0].as_py()
        i = table.num_rows - 1
        offset = int(table.column("clock_offset_ns")[i].as_py())
        error = int(table.column("clock_error_ns")[i].as_py())
        ts = int(table.column("ts")[i].as_py())
        source = f"{node}|{exporter}|{instance}"
        return [
            ClockStatus(
                source=source,
                offset_ns=offset,
                error_ns=error,
                flagged=abs(offset) > 1_000_000_000,
                ts_ns=ts,
            )
        ]

    def on_events(self, table: pa.Table, now_ns: int) -> Emitted:
        """Aligned events (``ts`` aligned, ``node`` column): onsets of XIDs, link flaps..."""
        ev = _as_ts_ns(table)
        return Emitted(alerts=self.engine.on_events(ev, now_ns))

    def on_collectives(self, table: pa.Table, now_ns: int) -> Emitted:
        coll = _as_ts_ns(table)
        return Emitted(alerts=self.stragglers.update(coll, self.episodes.all_episodes(), now_ns))

    def on_deadletters(self, count: int, now_ns: int) -> None:
        self.engine.on_deadletters(count, now_ns)

    def tick(self, now_ns: int) -> Emitted:
        out = Emitted()
        out.alerts += self.engine.tick(now_ns)
        out.episodes += self.episodes.tick(now_ns)
        out.alerts += self.stragglers.tick(now_ns)
        return out

    def flush(self) -> Emitted:
        rolled = self.rollup.flush()
        return Emitted(rollups=[rolled] if rolled.num_rows else [])


def _as_ts_ns(table: pa.Table) -> pa.Table:
    """Aligned records carry ``ts`` (common clock) and ``ts_source``; the evaluators read
    ``ts_ns`` as the aligned time."""
    if "ts" not in table.column_names:
        return table
    t = table.drop_columns([c for c in ("ts_ns",) if c in table.column_names])
    names = ["ts_ns" if c == "ts" else c for c in t.column_names]
    return t.rename_columns(names)
