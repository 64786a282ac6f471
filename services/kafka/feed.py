"""Follow the compacted ``topology`` and ``jobs`` topics into an in-memory, versioned view.

Every worker reads both topics whole (no consumer group: all partitions assigned from the
beginning) in a background thread and keeps the latest record per key. :meth:`TopologyFeed.
wait_caught_up` blocks until the end offsets seen at start have been read, so no sample is
enriched against a half-loaded topology. :meth:`snapshot` returns the current entity and job
lists plus a version number that changes whenever either changed (a record republished
unchanged does not count), so the caller rebuilds its join index only then; :attr:`version`
reads the number alone. During the first load the version moves once, when it is caught up.

A record that does not parse is logged, counted in ``stats['bad']`` and skipped; a tombstone
(null value) deletes its key.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import ValidationError

from schemas.records import JobPlacement, TopologyEntity

log = logging.getLogger(__name__)


class TopologyFeed:
    """Background reader of the topology and jobs topics. Start with :meth:`start`."""

    def __init__(self, conf: dict[str, Any], topology_topic: str, jobs_topic: str) -> None:
        self._conf = conf
        self._topics = {topology_topic: "topology", jobs_topic: "jobs"}
        self._lock = threading.Lock()
        self._entities: dict[str, TopologyEntity] = {}
        self._jobs: dict[str, JobPlacement] = {}
        self._version = 0
        self._caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"records": 0, "bad": 0}
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="topology-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def wait_caught_up(self, timeout: float = 60.0) -> bool:
        return self._caught_up.wait(timeout)

    @property
    def version(self) -> int:
        """Changes whenever an entity or job changed (cheap: no copy)."""
        return self._version

    def snapshot(self) -> tuple[int, list[TopologyEntity], list[JobPlacement]]:
        with self._lock:
            return self._version, list(self._entities.values()), list(self._jobs.values())

    def _run(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

        try:
            c = Consumer(
                {
                    **self._conf,
                    **LIBRDKAFKA_CONSUMER_BOUNDS,
                    "group.id": "refinery-topology-feed",  # never used to commit
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                    "auto.offset.reset": "earliest",
                }
            )
            md = c.list_topics(timeout=30)
            parts: list[TopicPartition] = []
            for topic in self._topics:
                tmd = md.topics.get(topic)
                if tmd is None or tmd.error is not None:
                    log.warning("topic %s not found; enrichment will carry reasons", topic)
                    continue
                parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in tmd.partitions]
            c.assign(parts)
            pending = set()
            for tp in parts:
                lo, hi = c.get_watermark_offsets(tp, timeout=10)
                if hi > lo:
                    pending.add((tp.topic, tp.partition))
            caught = not pending
            if caught:
                self._caught_up.set()
            changed = False  # applied since the version last moved
            while not self._stop.is_set():
                msgs = c.consume(500, 0.2)
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            pending.discard((m.topic(), m.partition()))
                            caught = caught or not pending
                        continue
                    changed |= self._apply(m.topic(), m.key(), m.value())
                # while the first load runs the version stands still: a reader waiting for it
                # would otherwise rebuild its join index for every half-loaded view; it moves
                # before waiters are released, so they see the whole load at once
                if changed and caught:
                    with self._lock:
                        self._version += 1
                    changed = False
                if caught and not self._caught_up.is_set():
                    self._caught_up.set()
            c.close()
        except BaseException as e:  # surfaced to the worker, which crashes on it
            log.exception("topology feed failed")
            self.error = e
            self._caught_up.set()

    def _apply(self, topic: str | None, key: bytes | None, value: bytes | None) -> bool:
        kind = self._topics.get(topic or "")
        if kind is None or key is None:
            return False
        k = key.decode("utf-8", "replace")
        self.stats["records"] += 1
        with self._lock:
            store: dict[str, Any] = self._entities if kind == "topology" else self._jobs
            if value is None:
                return store.pop(k, None) is not None
            try:
                doc = json.loads(value)
                new: TopologyEntity | JobPlacement = (
                    TopologyEntity.model_validate(doc)
                    if kind == "topology"
                    else JobPlacement.model_validate(doc)
                )
            except (ValueError, ValidationError) as e:
                self.stats["bad"] += 1
                log.warning("bad %s record %r: %s", kind, k, str(e).splitlines()[0])
                return False
            if store.get(k) == new:
                return False  # republished unchanged: the join index stays valid
            store[k] = new
        return True
