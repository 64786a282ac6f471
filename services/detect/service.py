"""``refinery detect``: the derived-stream service.

One consumer loop over telemetry.refined, the aligned events and collectives topics and the
accounting topic, feeding :class:`~services.detect.detector.Detector`, publishing alerts,
episodes and rollups, committing input offsets only after those are acknowledged.

Cross-layer answers need every node's episodes next to every job's collectives, so one detect
process reads all partitions (run one per cluster; it is light next to the refiner).

Restart: evaluator state is a function of recent data, so on assignment the loop rewinds each
partition by ``lookback_s`` of broker time before its committed offset and replays that span
*without publishing* (warm-up), then publishes from the committed offset on. Alert and episode
ids derive from data time, so the warmed-up state continues the same ids. A refined batch
whose raw position was already seen (a refiner replay) is skipped by lineage.

Watermark: per assigned refined partition the loop keeps the next offset to read and the
newest aligned ts read. The data time every partition has reached is the least newest ts of
the partitions that still have records to read (their high watermark, as last fetched, is
ahead of what was read); when none has, the newest ts read. It is handed to
:meth:`Detector.advance` after every poll: one partition read ahead during a backlog must
not close the episodes, or judge the stragglers, of another.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.enrich import TopologyIndex
from schemas.records import Alert, Episode
from services.detect.detector import Detector, Emitted
from services.telemetry import ServiceTelemetry
from services.worker.feed import TopologyFeed
from services.worker.refiner import arrow_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DetectTopics:
    refined: str = "telemetry.refined"
    events: str = "telemetry.events.aligned"
    collectives: str = "telemetry.collectives.aligned"
    accounting: str = "telemetry.accounting"
    topology: str = "topology"
    jobs: str = "jobs"
    alerts: str = "telemetry.alerts"
    episodes: str = "telemetry.episodes"
    rollups: str = "telemetry.rollups"

    @classmethod
    def with_prefix(cls, prefix: str) -> DetectTopics:
        d = cls()
        return cls(**{k: prefix + v for k, v in d.__dict__.items()})


class DetectService:
    """The consume → detect → publish → commit loop. Not thread-safe."""

    def __init__(
        self,
        conf: dict[str, Any],
        topics: DetectTopics,
        detector: Detector,
        telemetry: ServiceTelemetry,
        group: str = "refinery-detect",
        lookback_s: float = 600.0,
    ) -> None:
        self.conf = conf
        self.topics = topics
        self.detector = detector
        self.telemetry = telemetry
        self.group = group
        self.lookback_ms = int(lookback_s * 1000)
        self._emit_from: dict[tuple[str, int], int] = {}
        self._raw_seen: dict[int, int] = {}
        self._next: dict[int, int] = {}  # refined partition -> next offset to read
        self._latest: dict[int, int] = {}  # refined partition -> newest aligned ts read
        self.stats = {"alerts": 0, "episodes": 0, "rollups": 0, "records": 0, "warmup": 0}

    def run(self, stop: Callable[[], bool], idle_exit_s: float | None = None) -> int:
        from confluent_kafka import Consumer, Producer

        consumer = Consumer(
            {
                **self.conf,
                "group.id": self.group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "max.poll.interval.ms": 300000,
                "fetch.max.bytes": 64 * 1024 * 1024,
            }
        )
        producer = Producer(
            {
                **self.conf,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "compression.type": "zstd",
            }
        )
        feed = TopologyFeed(self.conf, self.topics.topology, self.topics.jobs)
        feed.start()
        feed.wait_caught_up(60)
        version = -1
        consumer.subscribe(
            [
                self.topics.refined,
                self.topics.events,
                self.topics.collectives,
                self.topics.accounting,
            ],
            on_assign=self._on_assign(consumer),
        )
        last_tick = last_commit = last_data = time.monotonic()
        pending: dict[tuple[str, int], int] = {}
        try:
            while not stop():
                if feed.error is not None:
                    raise RuntimeError(f"topology feed failed: {feed.error}")
                v, entities, jobs = feed.snapshot()
                if v != version:
                    version = v
                    self.detector.set_topology(TopologyIndex(entities, jobs))
                    self.detector.set_jobs(jobs)
                msgs: list[Any] = consumer.consume(500, 0.2)
                now = time.time_ns()
                for m in msgs:
                    if m.error() is not None:
                        continue
                    tp = (m.topic(), m.partition())
                    out = self._route(m, now)
                    pending[tp] = m.offset() + 1
                    self.stats["records"] += 1
                    if m.offset() < self._emit_from.get(tp, 0):
                        self.stats["warmup"] += 1
                        continue
                    self._publish(producer, out)
                if msgs:
                    last_data = time.monotonic()
                wm = self._watermark(consumer)
                if wm is not None:
                    self._publish(producer, self.detector.advance(wm, time.time_ns()))
                if time.monotonic() - last_tick >= 1.0:
                    last_tick = time.monotonic()
                    self._publish(producer, self.detector.tick(time.time_ns()))
                if pending and time.monotonic() - last_commit >= 1.0:
                    self._commit(consumer, producer, pending)
                    last_commit = time.monotonic()
                if idle_exit_s is not None and time.monotonic() - last_data > idle_exit_s:
                    break
            self._publish(producer, self.detector.flush())
            self._commit(consumer, producer, pending)
        finally:
            consumer.close()
            feed.stop()
        return 0

    def _on_assign(self, consumer: Any) -> Callable[[Any, Any], None]:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        def on_assign(c: Any, parts: list[Any]) -> None:
            committed = consumer.committed(parts, timeout=10)
            starts = []
            self._next = {}
            for tp in committed:
                if tp.topic == self.topics.refined:
                    first = tp.offset
                    if first < 0:  # from the beginning: the oldest offset still there
                        first = (consumer.get_watermark_offsets(tp, timeout=10) or (0, 0))[0]
                    self._next[tp.partition] = first
                if tp.offset < 0:  # nothing committed: read (and publish) from the start
                    self._emit_from[(tp.topic, tp.partition)] = 0
                    starts.append(TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING))
                    continue
                self._emit_from[(tp.topic, tp.partition)] = tp.offset
                back = int(time.time() * 1000) - self.lookback_ms
                found = consumer.offsets_for_times(
                    [TopicPartition(tp.topic, tp.partition, back)], timeout=10
                )[0]
                start = tp.offset if found.offset < 0 else min(found.offset, tp.offset)
                starts.append(TopicPartition(tp.topic, tp.partition, start))
                if tp.topic == self.topics.refined:
                    self._next[tp.partition] = start
            c.assign(starts)

        return on_assign

    def _route(self, m: Any, now: int) -> Emitted:
        topic = m.topic()
        if topic == self.topics.accounting:
            doc = json.loads(m.value())
            if doc.get("outcome") == "deadletter" or doc.get("quarantined_samples"):
                n = 1 if doc.get("outcome") == "deadletter" else int(doc["quarantined_samples"])
                self.detector.on_deadletters(n, now)
            return Emitted()
        table = pa.ipc.open_stream(m.value()).read_all()
        if topic == self.topics.refined:
            p = m.partition()
            self._next[p] = m.offset() + 1
            if table.num_rows == 0:
                return Emitted()
            newest = int(pc.max(table.column("ts")).as_py())
            self._latest[p] = max(self._latest.get(p, newest), newest)
            part = int(table.column("raw_partition")[0].as_py())
            off = int(table.column("raw_offset")[0].as_py())
            if off <= self._raw_seen.get(part, -1):
                return Emitted()  # a refiner replay of a position already seen
            self._raw_seen[part] = off
            return self.detector.on_refined(table, now)
        if topic == self.topics.events:
            return self.detector.on_events(table, now)
        return self.detector.on_collectives(table, now)

    def _watermark(self, consumer: Any) -> int | None:
        """:func:`low_watermark` of the assigned refined partitions, with their high
        watermarks as last fetched (no broker round trip)."""
        from confluent_kafka import TopicPartition

        high = {}
        for p in self._next:
            tp = TopicPartition(self.topics.refined, p)
            high[p] = (consumer.get_watermark_offsets(tp, cached=True) or (-1, -1))[1]
        return low_watermark(self._next, high, self._latest)

    def _publish(self, producer: Any, out: Emitted) -> None:
        for a in out.alerts:
            producer.produce(
                self.topics.alerts, a.model_dump_json().encode(), key=a.entity.encode()
            )
            self._count(a)
        for e in out.episodes:
            producer.produce(
                self.topics.episodes, e.model_dump_json().encode(), key=e.entity.encode()
            )
            self.stats["episodes"] += 1
        for t in out.rollups:
            for node in set(t.column("node").to_pylist()):
                part = t.filter(pc.equal(t.column("node"), node))
                producer.produce(
                    self.topics.rollups,
                    arrow_bytes(part),
                    key=node.encode(),
                    headers=[("content-type", b"application/vnd.apache.arrow.stream")],
                )
            self.stats["rollups"] += t.num_rows
        producer.poll(0)

    def _count(self, a: Alert | Episode) -> None:
        self.stats["alerts"] += 1
        self.telemetry.count(
            "refinery.alerts", 1, {"rule": getattr(a, "rule", "episode"), "state": str(a.state)}
        )

    def _commit(self, consumer: Any, producer: Any, pending: dict[tuple[str, int], int]) -> None:
        from confluent_kafka import TopicPartition

        left = producer.flush(30)
        if left:
            raise RuntimeError(f"{left} derived records not acknowledged; not committing")
        if pending:
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in pending.items()],
                asynchronous=False,
            )
            pending.clear()


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
