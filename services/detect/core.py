"""How detect reads its input, whatever delivers it: topic names, routing of input records to
the :class:`~services.detect.detector.Detector`, the lineage replay skip, the watermark, the
warm-up spans and the derived records to publish. The product's engine is the Faust agent of
:mod:`services.detect.agent`; the lab's reference loop (``lab.detect_reference``) shares this
module, which is how the two are checked against each other.

Warm-up: on assignment each input partition is read from ``lookback_s`` of broker time before
its committed offset (its :class:`Span`) without publishing what those records produce, so
the evaluator state, and the alert and episode ids derived from data time, continue where
the previous process left them. Records from the committed offset on are published.

Watermark: per assigned refined partition the next offset to read and the newest aligned ts
read. The data time every partition has reached is the least newest ts of the partitions
that still have records to read (their high watermark, as last fetched, is ahead of what was
read); when none has, the newest ts read (:func:`low_watermark`). One partition read ahead
during a backlog must not close the episodes, or judge the stragglers, of another.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.detect.episodes import OpenEpisode
from pipelines.refine.enrich import TopologyIndex
from schemas.codec import ipc_stream
from schemas.topics import TOPICS, Topics
from services.detect.detector import Detector, Emitted
from services.detect.progress import AccountingProgress, Marker, PartitionProgress, ProgressView
from services.kafka.feed import TopologyFeed
from services.kafka.outputs import OutMessage
from services.telemetry import ServiceTelemetry

DEADLETTER_KEEP_S = 600  # dead-letter seconds kept per accounting partition (rate windows)
# refined rows judged in one pass at most (about 40 MB of their Arrow columns): the fixed cost
# of a pass (~2 ms) is ~1 % of such a pass's work
PASS_ROWS = 131_072
ARROW_HEADERS = [("content-type", b"application/vnd.apache.arrow.stream")]


def read_topics(topics: Topics) -> list[str]:
    """The topics detect reads, of the catalog ``topics`` (:mod:`schemas.topics`): refined
    data, aligned events and collectives, accounting."""
    return [topics.refined, topics.events_aligned, topics.collectives_aligned, topics.accounting]


@dataclass(frozen=True)
class Span:
    """One input partition on assignment: read from ``start``, publish from ``resume`` (the
    committed offset; with nothing committed both are the oldest offset still there)."""

    topic: str
    partition: int
    start: int
    resume: int


def assigned_spans(consumer: Any, parts: list[Any], lookback_ms: int) -> list[Span]:
    """The :class:`Span` of each of ``parts`` (confluent-kafka ``TopicPartition``), asking
    the broker for the group's committed offsets (``consumer`` carries the group id) and for
    the offset ``lookback_ms`` before now."""
    from confluent_kafka import TopicPartition

    spans = []
    back = int(time.time() * 1000) - lookback_ms
    for tp in consumer.committed(parts, timeout=10):
        if tp.offset < 0:  # nothing committed: read (and publish) from the oldest record
            low = (consumer.get_watermark_offsets(tp, timeout=10) or (0, 0))[0]
            spans.append(Span(tp.topic, tp.partition, low, low))
            continue
        found = consumer.offsets_for_times(
            [TopicPartition(tp.topic, tp.partition, back)], timeout=10
        )[0]
        start = tp.offset if found.offset < 0 else min(found.offset, tp.offset)
        spans.append(Span(tp.topic, tp.partition, start, tp.offset))
    return spans


class DetectCore:
    """Routing, lineage skip, watermark and payloads around one :class:`Detector`. Not
    thread-safe: one caller at a time."""

    def __init__(
        self,
        topics: Topics,
        detector: Detector,
        telemetry: ServiceTelemetry,
        view: ProgressView | None = None,
        progress_topic: str | None = None,
    ) -> None:
        self.topics = topics
        self.detector = detector
        self.telemetry = telemetry
        # every replica's progress (the detector judges collectives on it) and where this
        # replica's is published; None: a detector that reads every partition alone
        self.view = view
        self.progress_topic = progress_topic
        self._node_part: dict[str, int] = {}  # node -> the refined partition of its rows
        self._accounting_parts: set[int] = set()
        # with a view: dead letters per accounting partition, per second of append time
        self._deadletters: dict[int, dict[int, int]] = {}
        self._sent_closed: set[str] = set()  # closed episodes already in a progress record
        # (raw topic, raw partition, node) -> highest raw offset seen: a node's rows come in
        # raw order (the refiner sends one node's rows of a group as one message); the nodes
        # of a raw partition interleave in it, and may be spread over several refined
        # partitions read at paces of their own. Each raw topic has offsets of its own.
        self._raw_seen: dict[tuple[str, int, str], int] = {}
        self._next: dict[int, int] = {}  # refined partition -> next offset to read
        self._latest: dict[int, int] = {}  # refined partition -> newest aligned ts read
        self._topology_version = -1
        self._index: TopologyIndex | None = None
        self.stats = {"alerts": 0, "episodes": 0, "rollups": 0, "records": 0, "warmup": 0}

    def begin(self, spans: list[Span], keep: Iterable[int] = ()) -> None:
        """Partitions were assigned: reading starts at each span's start. Refined partitions
        in ``keep`` (still assigned, read on from where they were) keep their position; any
        other is no longer assigned."""
        kept = {p: n for p, n in self._next.items() if p in set(keep)}
        self._next = kept | {s.partition: s.start for s in spans if s.topic == self.topics.refined}
        self._sent_closed.clear()  # the next progress record carries every closed episode

    def own(self, parts: Iterable[tuple[str, int]]) -> None:
        """The input partitions now assigned (``(topic, partition)``)."""
        parts = list(parts)
        refined = {p for t, p in parts if t == self.topics.refined}
        self._accounting_parts = {p for t, p in parts if t == self.topics.accounting}
        self._deadletters = {
            p: v for p, v in self._deadletters.items() if p in self._accounting_parts
        }
        if self.view is not None:
            self.view.own(refined, self._accounting_parts)

    @property
    def refined_partitions(self) -> list[int]:
        return list(self._next)

    def sync_topology(self, feed: TopologyFeed) -> None:
        """Hand the detector the feed's topology and jobs when they changed."""
        if feed.error is not None:
            raise RuntimeError(f"topology feed failed: {feed.error}")
        if feed.version == self._topology_version:
            return
        version, entities, jobs = feed.snapshot()
        self._topology_version = version
        # the nodes the change did not touch keep their resolved joins
        self._index = TopologyIndex(entities, jobs, previous=self._index)
        self.detector.set_topology(self._index)
        self.detector.set_jobs(jobs)

    def route(self, topic: str, partition: int, offset: int, value: bytes, now: int) -> Emitted:
        """Feed one input record to the detector; what it produced."""
        return self.route_group([(topic, partition, offset, value)], now)

    def route_group(self, records: Iterable[tuple[str, int, int, bytes]], now: int) -> Emitted:
        """Feed input records ``(topic, partition, offset, value)``, in order; what they
        produced. The refined batches among them are evaluated as one table: every rule
        sorts its rows by series and time and the rollups and episodes group them, so one
        pass over the concatenation does what one pass per batch did, at a fraction of the
        fixed cost per call (about 40 Arrow kernel calls per batch). A group larger than
        :data:`PASS_ROWS` rows (a backlog read) is judged in passes of about that many, so
        the tables a pass builds (sorts, indexes, groupings: a few times its rows' bytes)
        stay bounded whatever the group's size."""
        out, tables, rows = Emitted(), [], 0
        for topic, partition, offset, value in records:
            self.stats["records"] += 1
            if topic == self.topics.refined:
                t = self._refined(partition, offset, value)
                if t is not None:
                    tables.append(t)
                    rows += t.num_rows
                    if rows >= PASS_ROWS:  # a backlog's group: judged in passes
                        out.extend(self.detector.on_refined(_one_table(tables), now))
                        tables, rows = [], 0
            elif topic == self.topics.accounting:
                self._accounted(json.loads(value), now, partition)
            elif topic == self.topics.events_aligned:
                out.extend(self.detector.on_events(pa.ipc.open_stream(value).read_all(), now))
            else:
                out.extend(self.detector.on_collectives(pa.ipc.open_stream(value).read_all(), now))
        if tables:
            out.extend(self.detector.on_refined(_one_table(tables), now))
        return out

    def _accounted(self, doc: dict[str, Any], now: int, partition: int = 0) -> None:
        """An accounting record: the refiner's progress on its raw partition (silence is
        judged on it) and its dead letters, at the raw record's broker append time."""
        append = doc.get("append_ms")
        at = now if append is None else int(append) * 1_000_000
        if append is not None:  # every raw topic: telemetry.raw and the ingest topics
            rows = doc.get("outcome") == "refined" and bool(doc.get("refined_samples"))
            ts_max = doc.get("ts_max")
            self.detector.on_progress(
                int(doc["raw_partition"]),
                int(doc["raw_offset"]),
                at,
                doc.get("node"),
                rows,
                doc.get("raw_topic"),
                int(ts_max) if isinstance(ts_max, int) and rows else None,
            )
        if doc.get("outcome") == "deadletter" or doc.get("quarantined_samples"):
            n = 1 if doc.get("outcome") == "deadletter" else int(doc["quarantined_samples"])
            if self.view is None:
                self.detector.on_deadletters(n, at)
            else:  # a cluster's rate: summed over every replica's partitions (progress)
                per = self._deadletters.setdefault(partition, {})
                sec = at // 1_000_000_000
                per[sec] = per.get(sec, 0) + n
                for old in [k for k in per if k < sec - DEADLETTER_KEEP_S]:
                    del per[old]

    def _refined(self, partition: int, offset: int, value: bytes) -> pa.Table | None:
        """A refined record's rows, less those of raw positions already seen (a refiner's
        replay), or None when none is left; advances the partition's position and newest ts
        either way. A refined record holds the rows of one or more raw records of one node,
        in raw order."""
        self._next[partition] = offset + 1
        table = pa.ipc.open_stream(value).read_all()
        if table.num_rows == 0:
            return None
        newest = _span(table.column("ts"))[1]
        self._latest[partition] = max(self._latest.get(partition, newest), newest)
        raw_part, raw_off = table.column("raw_partition"), table.column("raw_offset")
        node = str(table.column("node")[0].as_py())
        self._node_part[node] = partition
        topic = _raw_topics(table)
        lo, hi = _span(raw_part)
        if lo == hi and isinstance(topic, str):
            # the usual case: a node's records share a raw topic and partition
            return self._unseen(table, (topic, lo, node), raw_off)
        topics = pa.repeat(pa.scalar(topic), table.num_rows) if isinstance(topic, str) else topic
        lanes = (
            pa.table({"t": topics, "p": raw_part})
            .group_by(["t", "p"], use_threads=False)
            .aggregate([])
        )
        parts = []
        for t, p in zip(lanes.column("t").to_pylist(), lanes.column("p").to_pylist(), strict=True):
            sub = table.filter(pc.and_(pc.equal(topics, t), pc.equal(raw_part, p)))
            kept = self._unseen(sub, (str(t), int(p), node), sub.column("raw_offset"))
            if kept is not None:
                parts.append(kept)
        return pa.concat_tables(parts) if parts else None

    def _unseen(self, table: pa.Table, lane: tuple[str, int, str], raw_off: Any) -> pa.Table | None:
        """The rows of ``table`` (all of one node's records of one raw topic and partition:
        ``lane``) above the highest raw offset seen there; that high mark moves to the table's
        highest. Each raw topic (telemetry.raw, the ingest topics) has offsets of its own."""
        seen = self._raw_seen.get(lane, -1)
        lo, hi = _span(raw_off)
        if hi <= seen:
            return None  # a refiner replay of positions already seen
        self._raw_seen[lane] = hi
        return table if lo > seen else table.filter(pc.greater(raw_off, seen))

    def watermark(self, high: Callable[[int], int]) -> int | None:
        """:func:`low_watermark` of the assigned refined partitions; ``high(partition)``: its
        high watermark as last fetched (negative: not known)."""
        return low_watermark(self._next, {p: high(p) for p in self._next}, self._latest)

    def refined_pending(self, high: Callable[[int], int]) -> bool:
        """Whether refined records are still to read in an assigned partition (its next
        offset below its high watermark as last fetched): refined data is coming, however
        long since detect last read some."""
        return any(0 <= nxt < high(p) for p, nxt in self._next.items())

    def progress(self, high: Callable[[int], int], now: int) -> OutMessage | None:
        """This replica's progress record (:mod:`services.detect.progress`), applied to its
        own view; the record to publish (None without a view)."""
        if self.view is None:
            return None
        m = progress_marker(self, high, now)
        self.view.apply(m)
        # the owner of accounting partition 0 judges the cluster's dead-letter rate
        buckets = self.view.deadletters() if 0 in self._accounting_parts else {}
        self.detector.engine.deadletters.buckets = buckets
        if self.progress_topic is None:
            return None
        return OutMessage(self.progress_topic, self.view.replica.encode(), m.to_json())

    def messages(self, out: Emitted) -> list[OutMessage]:
        """The records to publish for ``out`` (alerts and episodes as JSON keyed by entity,
        rollups as Arrow keyed by node), counted in :attr:`stats` and the telemetry."""
        msgs = []
        for a in out.alerts:
            msgs.append(OutMessage(self.topics.alerts, a.entity.encode(), _json(a)))
            self.stats["alerts"] += 1
            attrs = {"rule": a.rule, "state": str(a.state)}
            self.telemetry.count("refinery.alerts", 1, attrs)
        for e in out.episodes:
            msgs.append(OutMessage(self.topics.episodes, e.entity.encode(), _json(e)))
            self.stats["episodes"] += 1
        for t in out.rollups:
            for node, part in _by_node(t):
                msgs.append(
                    OutMessage(
                        self.topics.rollups, node.encode(), ipc_stream(part), list(ARROW_HEADERS)
                    )
                )
            self.stats["rollups"] += t.num_rows
        return msgs


def progress_marker(core: DetectCore, high: Callable[[int], int], now: int) -> Marker:
    """``core``'s refined partitions (how far read, their nodes and episodes) and
    accounting partitions (silent and accounted nodes) as a progress record."""
    assert core.view is not None
    d, owned = core.detector, core._next
    entries = {}
    for p, nxt in owned.items():
        hi = high(p)
        entries[p] = PartitionProgress(hi < 0 or nxt < hi, core._latest.get(p))
    first = min(owned, default=None)
    for node, ts in d.node_latest.items():
        q = core._node_part.get(node)
        if q is not None and q in entries:
            entries[q].nodes[node] = ts
    for e in d.episodes.open.values():
        q = _episode_part(core._node_part, e, first)
        if q is not None and q in entries:
            entries[q].open.append(asdict(e))
    for e in d.episodes.recent:
        q = _episode_part(core._node_part, e, first)
        if q is not None and q in entries and e.id not in core._sent_closed:
            entries[q].closed.append(asdict(e))
            core._sent_closed.add(e.id)
    core._sent_closed &= {e.id for e in d.episodes.recent}  # those no longer kept: forgotten
    silent = sorted(d.engine.silent_nodes())
    accounted = sorted(d.engine.accounted_nodes())
    acc = {
        a: AccountingProgress(
            silent, accounted, [[k, v] for k, v in sorted(core._deadletters.get(a, {}).items())]
        )
        for a in core._accounting_parts
    }
    return Marker(core.view.replica, now, entries, acc)


def _episode_part(node_part: Mapping[str, int], e: OpenEpisode, first: int | None) -> int | None:
    """The refined partition of an episode's nodes (the first known), else ``first``."""
    names = [*e.nodes, e.entity.split("/", 1)[0]]
    return next((node_part[n] for n in names if n in node_part), first)


def _span(col: pa.ChunkedArray) -> tuple[int, int]:
    """(least, greatest) of an integer column without NULLs: numpy's over the one chunk of a
    refined record's column (an Arrow kernel call cost three times as much per record)."""
    if col.num_chunks == 1 and col.null_count == 0:
        a = col.chunk(0).to_numpy()
        return int(a.min()), int(a.max())
    lo, hi = pc.min_max(col).values()
    return int(lo.as_py()), int(hi.as_py())


def _raw_topics(table: pa.Table) -> str | pa.Array:
    """The raw topic of every row of refined ``table`` when they share one, else each row's
    (NULL or absent, in rows written before refined rows carried it: telemetry.raw)."""
    if "raw_topic" not in table.schema.names:
        return _RAW
    col = table.column("raw_topic")
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    col = pc.fill_null(col, _RAW) if col.null_count else col
    lo, hi = pc.min_max(col).values()
    if lo.as_py() == hi.as_py():
        return str(lo.as_py())
    return col.combine_chunks()


_RAW = TOPICS.raw
# refined columns the evaluators read whole, many times over (indexed by metric, series and
# time, taken at positions): each is made one chunk once per group. The rest are read once
# (grouped, filtered) or at a few rows (alerts take theirs: rule_eval._rows) and stay in
# their tables' chunks: copying a group's string columns cost as much as a rule pass.
_READ_WHOLE = frozenset(
    ["node", "device", "metric", "ts", "value", "rate", "raw_partition", "raw_offset"]
)


def _one_table(tables: list[pa.Table]) -> pa.Table:
    """Refined ``tables`` as one, the columns of :data:`_READ_WHOLE` each in one chunk."""
    if len(tables) == 1:
        return tables[0]
    one = pa.concat_tables(tables, promote_options="permissive")
    cols = [
        c.combine_chunks() if n in _READ_WHOLE else c
        for n, c in zip(one.column_names, one.columns, strict=True)
    ]
    return pa.table(cols, schema=one.schema)


def _by_node(t: pa.Table) -> list[tuple[str, pa.Table]]:
    """``t``'s rows per node, each node's in table order, nodes in order of first row: one
    stable sort by node, then slices (filtering the table once per node cost O(nodes x
    rows))."""
    if t.num_rows == 0:
        return []
    enc = pc.dictionary_encode(t.column("node").combine_chunks())
    order = pc.sort_indices(enc.indices)  # stable: a node's rows keep their order
    sorted_t = t.take(order)
    codes = enc.indices.take(order).to_numpy()
    names = enc.dictionary.to_pylist()
    bounds = [0, *(np.flatnonzero(codes[1:] != codes[:-1]) + 1).tolist(), len(codes)]
    return [(str(names[codes[a]]), sorted_t.slice(a, b - a)) for a, b in itertools.pairwise(bounds)]


def _json(record: Any) -> bytes:
    data: bytes = record.model_dump_json().encode()
    return data


def low_watermark(
    next_offset: Mapping[int, int], high: Mapping[int, int], latest: Mapping[int, int]
) -> int | None:
    """The data time every partition has reached, from per partition the next offset to
    read, the high watermark (negative: not known yet) and the newest ts read: the least
    newest ts of the partitions with records left to read, or the newest ts read when none
    has. None while unknown (a high watermark not known, or records left in a partition of
    which none was read).

    >>> low_watermark({0: 5, 1: 9}, {0: 9, 1: 9}, {0: 100, 1: 160})  # 0 has 4 left
    100
    >>> low_watermark({0: 9, 1: 9}, {0: 9, 1: 9}, {0: 100, 1: 160})  # all read
    160
    >>> low_watermark({0: 0, 1: 9}, {0: 3, 1: 9}, {1: 160}) is None  # 0 not read yet
    True
    """
    behind: list[int] = []
    for p, nxt in next_offset.items():
        hi = high.get(p, -1)
        if hi < 0:
            return None
        if nxt < hi:
            if p not in latest:
                return None
            behind.append(latest[p])
    if behind:
        return min(behind)
    return max(latest.values(), default=None)
