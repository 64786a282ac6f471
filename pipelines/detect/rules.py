"""The rule engine: rules as data (see :mod:`pipelines.detect.rule_config`), evaluated in
the stream.

What the Faust shim calls (all pure; time is always passed in, never read)::

    engine = RuleEngine(load_rules(path, catalog), catalog)
    engine = RuleEngine.from_dict(rules, catalog, table_value)   # restore after a restart
    alerts = engine.evaluate(refined_batch, now_ns)    # per telemetry.refined batch
    alerts = engine.on_events(events_table, now_ns, node=envelope_node)  # telemetry.events
    alerts = engine.on_clock([ClockStatus(...)], now_ns)   # per refiner clock estimate
    engine.on_deadletters(n, now_ns)                    # per dead-letter batch
    engine.on_progress(partition, offset, append_ns, node, rows, topic)  # per record accounted
    alerts = engine.tick(now_ns)                        # every second or so
    table_value = engine.to_dict()                      # JSON-able, for a Faust table

Every method returns only **state changes** (firing and resolved :class:`Alert` records);
the firing and resolved records of one alert share a stable id (:mod:`pipelines.detect.alerts`).
State is bounded by series that are pending or firing, plus a few numbers per source.

>>> from schemas.catalog import default_catalog
>>> rules = parse_rules({"rules": [{"name": "hot", "kind": "threshold", "metric": "gpu.temp",
...     "above": 85, "resolve": 80, "for": "10s"}]})
>>> RuleEngine(rules, default_catalog()).evaluate(empty_refined(), 0)
[]
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipelines._arrow import MetricRows
from pipelines.detect.alerts import RAW_TOPIC, AlertBook, lineage_of
from pipelines.detect.rule_config import (
    BitmaskRule,
    ClockRule,
    DeadletterRule,
    EventRule,
    FreshnessRule,
    FrozenRule,
    Rule,
    SilentRule,
    ThresholdRule,
    load_rules,
    parse_rules,
)
from pipelines.detect.rule_eval import (
    MetricIndex,
    eval_bitmask,
    eval_events,
    eval_metric_events,
    eval_threshold,
    expire_events,
)
from pipelines.detect.rule_health import (
    ClockStatus,
    DeadletterWindow,
    NodeProgress,
    PartitionProgress,
    SourceState,
    entity_node,
    eval_clock,
    eval_deadletters,
    eval_freshness,
    observe_sources,
    summarize_batches,
    tick_silent,
)
from pipelines.detect.threshold_pass import eval_plain_thresholds, plain
from pipelines.detect.xid import XID_TABLE, xid_info
from schemas.catalog import Catalog, Kind
from schemas.errors import ConfigError
from schemas.records import REFINED_SCHEMA, Alert, Lineage

__all__ = [
    "XID_TABLE",
    "ClockStatus",
    "Rule",
    "RuleEngine",
    "empty_refined",
    "load_rules",
    "parse_rules",
    "xid_info",
]


def empty_refined() -> pa.Table:
    return REFINED_SCHEMA.empty_table()


class RuleEngine:
    """Evaluates a rule set over refined batches, events, clock estimates and time."""

    def __init__(self, rules: list[Rule], catalog: Catalog, raw_topic: str = RAW_TOPIC) -> None:
        self.rules = list(rules)
        self.catalog = catalog
        self.raw_topic = raw_topic
        self.book = AlertBook()
        self.sources: dict[str, SourceState] = {}
        self.progress: dict[tuple[str, int], PartitionProgress] = {}  # per topic, partition
        self.nodes: dict[tuple[str, str], NodeProgress] = {}  # per raw topic and node
        self.deadletters = DeadletterWindow()
        self.last_values: dict[str, dict[str, float]] = {}  # sample-borne events per rule
        self._silence_memo: dict[str, tuple[Any, ...]] = {}  # tick_silent's, per source
        self._fields: dict[str, str] = {}
        for r in self.rules:
            metric = getattr(r, "metric", None)
            if metric is not None and metric not in catalog:
                raise ConfigError(f"rules: rule {r.name}: metric: unknown metric {metric!r}")
            if isinstance(r, ThresholdRule):
                m = catalog[r.metric]
                auto = "rate" if m.kind is Kind.COUNTER else "value"
                self._fields[r.name] = auto if r.field == "auto" else r.field
        self._threshold = [r for r in self.rules if isinstance(r, ThresholdRule)]
        self._plain = plain(self._threshold)  # evaluated in one pass
        self._plain_names = {r.name for r in self._plain}
        self._bitmask = [r for r in self.rules if isinstance(r, BitmaskRule)]
        ev = [r for r in self.rules if isinstance(r, EventRule)]
        self._events = [r for r in ev if r.metric is None]
        self._metric_events = [r for r in ev if r.metric is not None]
        self._clock = [r for r in self.rules if isinstance(r, ClockRule)]
        self._silent = [r for r in self.rules if isinstance(r, SilentRule)]
        self._frozen = [r for r in self.rules if isinstance(r, FrozenRule)]
        self._deadletter = [r for r in self.rules if isinstance(r, DeadletterRule)]
        self._fresh = [r for r in self.rules if isinstance(r, FreshnessRule)]
        # the metrics whose rows the sample rules read (a MetricIndex sorts only theirs)
        self.row_metrics = frozenset(
            [r.metric for r in self._threshold]
            + [r.metric for r in self._bitmask]
            + [r.metric for r in self._metric_events if r.metric is not None]
        )

    # --- inputs --------------------------------------------------------------------------

    def evaluate(
        self, refined: pa.Table, now_ns: int, by_metric: MetricIndex | MetricRows | None = None
    ) -> list[Alert]:
        """State changes caused by one refined batch (REFINED_SCHEMA columns; extra
        columns are ignored). ``now_ns``: the engine's clock, stamped as ``emitted_ns``.
        ``by_metric``: a :class:`~pipelines.detect.rule_eval.MetricIndex` over ``refined``
        when the caller has one (its encodings are shared); any other is ignored (the rules
        take the positions of their metric's rows, not copies of the rows)."""
        if refined.num_rows == 0:
            return []
        ix = (
            by_metric
            if isinstance(by_metric, MetricIndex)
            else MetricIndex(refined, self.row_metrics)
        )
        out: list[Alert] = []
        fused = eval_plain_thresholds(
            [(t, self._fields[t.name]) for t in self._plain], ix, self.book, now_ns, self.raw_topic
        )
        for t in self._threshold:  # in rule order, as one by one
            if t.name in self._plain_names:
                out += fused.get(t.name, [])
            else:
                f = self._fields[t.name]
                out += eval_threshold(t, f, ix, self.book, now_ns, self.raw_topic)
        for b in self._bitmask:
            out += eval_bitmask(b, self.catalog, ix, self.book, now_ns, self.raw_topic)
        for e in self._metric_events:
            last = self.last_values.setdefault(e.name, {})
            out += eval_metric_events(e, ix, last, self.book, now_ns, self.raw_topic)
        if self._silent or self._frozen:
            rows = summarize_batches(refined)
            out += observe_sources(
                rows,
                self.sources,
                self._silent,
                self._frozen,
                self.book,
                now_ns,
                self.nodes,
                self.raw_topic,
            )
        out += eval_freshness(refined, self._fresh, self.book, now_ns)
        return out

    def on_events(
        self,
        events: pa.Table,
        now_ns: int,
        node: str | None = None,
        lineage: list[Lineage] | None = None,
    ) -> list[Alert]:
        """State changes from an events table (EVENTS_SCHEMA, ``ts_ns`` aligned). The node
        comes from a ``node`` column or, for one envelope's batch, the ``node`` argument.
        ``lineage``: the telemetry.events position(s) of the batch, if known."""
        if events.num_rows == 0 or not self._events:
            return []
        if "node" not in events.column_names:
            if node is None:
                raise ValueError("on_events: the table has no node column and node is None")
            events = events.append_column("node", pa.array([node] * events.num_rows))
        out: list[Alert] = []
        for r in self._events:
            out += eval_events(r, events, self.book, now_ns, lineage or [])
        return out

    def on_clock(self, statuses: list[ClockStatus], now_ns: int) -> list[Alert]:
        """State changes from per-source clock estimates."""
        return eval_clock(statuses, self._clock, self.book, now_ns)

    def on_progress(
        self,
        partition: int,
        offset: int,
        append_ns: int,
        node: str | None = None,
        rows: bool = False,
        topic: str | None = None,
        ts_max: int | None = None,
    ) -> None:
        """The refiner accounted for the raw record at ``(partition, offset)`` of the raw
        topic, appended by the broker at ``append_ns``, a batch of ``node`` that gave refined
        rows when ``rows``: silence is judged on this progress
        (:mod:`pipelines.detect.rule_health`).
        Records of a partition arrive in offset order. ``topic``: the raw topic (None: the
        engine's); ``ts_max``: the newest aligned ts of the record's refined rows, if known."""
        topic = topic or self.raw_topic
        pp = self.progress.setdefault((topic, partition), PartitionProgress())
        pp.accounted(offset, append_ns)
        if ts_max is not None:
            pp.data_ts = max(pp.data_ts, ts_max)
        if node is not None and rows:
            np_ = self.nodes.setdefault((topic, node), NodeProgress())
            np_.accounted = max(np_.accounted, offset)

    def on_deadletters(self, count: int, now_ns: int) -> None:
        """Count ``count`` dead letters at ``now_ns``; the rate is judged by :meth:`tick`."""
        if count > 0:
            self.deadletters.add(count, now_ns)

    def tick(self, now_ns: int) -> list[Alert]:
        """Time-driven changes at ``now_ns``: silent sources, dead-letter rate, expiry of
        per-occurrence event alerts."""
        out = tick_silent(
            self.sources,
            self._silent,
            self.book,
            now_ns,
            self.progress,
            self.nodes,
            self._silence_memo,
        )
        out += eval_deadletters(self.deadletters, self._deadletter, self.book, now_ns)
        out += expire_events(self._events + self._metric_events, self.book, now_ns)
        return out

    def accounted_nodes(self) -> set[str]:
        """Nodes of which the refiner accounted for raw records with refined rows."""
        return {node for (_, node), np_ in self.nodes.items() if np_.accounted >= 0}

    def silent_nodes(self) -> set[str]:
        """Nodes with a source a silence rule has found silent (firing)."""
        names = {r.name for r in self._silent}
        return {
            entity_node(key)
            for (rule, key), st in self.book.states.items()
            if rule in names and st.firing is not None
        }

    def firing(self) -> list[tuple[str, str]]:
        """(rule, key) of every open alert."""
        return sorted(k for k, s in self.book.states.items() if s.firing is not None)

    # --- state ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able state (alerts pending/firing, per-source state, dead-letter window)."""
        return {
            "book": self.book.to_dict(),
            "sources": {k: vars(v) for k, v in self.sources.items()},
            "deadletters": self.deadletters.to_dict(),
            "last_values": self.last_values,
        }

    @classmethod
    def from_dict(
        cls, rules: list[Rule], catalog: Catalog, state: dict[str, Any], raw_topic: str = RAW_TOPIC
    ) -> RuleEngine:
        e = cls(rules, catalog, raw_topic)
        e.book = AlertBook.from_dict(state.get("book", {}))
        e.sources = {k: SourceState(**v) for k, v in state.get("sources", {}).items()}
        e.deadletters = DeadletterWindow(
            {int(k): int(v) for k, v in state.get("deadletters", {}).items()}
        )
        e.last_values = {k: dict(v) for k, v in state.get("last_values", {}).items()}
        return e


def lineage_for(table: pa.Table, topic: str = RAW_TOPIC) -> list[Lineage]:
    """Re-exported :func:`pipelines.detect.alerts.lineage_of` for shims."""
    return lineage_of(table, topic)
