"""The detect group's progress topic (``<group>-progress``): created when absent, and followed
into a :class:`~services.detect.progress.ProgressView` in a thread of its own.

The topic has one partition, so every replica reads every record in the order they were
appended. A replica starts reading ``lookback_s`` of broker time back (the closed episodes a
straggler's cause may name are that old at most) and is caught up once it has read to the end
offset it saw at start (:meth:`ProgressFeed.wait_caught_up`). Its own records are not applied
from the topic: they were applied when made.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from services.detect.progress import Marker, ProgressView

log = logging.getLogger(__name__)

RETENTION_MS = 3_600_000


def progress_topic(group: str) -> str:
    """The progress topic of detect group ``group`` (the group's ACLs cover its prefix)."""
    return f"{group}-progress"


def ensure_topic(conf: dict[str, Any], topic: str, refined: str) -> int:
    """Create ``topic`` when absent (one partition, the refined topic's replication,
    append-time stamps, an hour kept); the refined topic's partition count (0: absent)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({**conf, "log_level": 3})
    md = admin.list_topics(timeout=30)
    ref = md.topics.get(refined)
    parts = len(ref.partitions) if ref is not None and ref.error is None else 0
    if topic in md.topics and md.topics[topic].error is None:
        return parts
    rf = len(next(iter(ref.partitions.values())).replicas) if parts and ref is not None else -1
    config = {"cleanup.policy": "delete", "retention.ms": str(RETENTION_MS),
              "message.timestamp.type": "LogAppendTime"}  # fmt: skip
    fut = admin.create_topics([NewTopic(topic, 1, rf, config=config)])[topic]
    try:
        fut.result(30)
    except Exception as e:  # created meanwhile by another replica: fine
        if "TOPIC_ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
            raise
    return parts


class ProgressFeed:
    """Background reader of the progress topic into ``view``."""

    def __init__(
        self, conf: dict[str, Any], topic: str, view: ProgressView, lookback_s: float
    ) -> None:
        self._conf, self.topic, self.view, self.lookback_s = conf, topic, view, lookback_s
        self._caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"records": 0, "bad": 0}
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="progress-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def wait_caught_up(self, timeout: float = 60.0) -> bool:
        return self._caught_up.wait(timeout)

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # surfaced by the runner (detect stops non-zero)
            self.error = e
            log.exception("progress feed failed")

    def _follow(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

        c = Consumer({**self._conf, **LIBRDKAFKA_CONSUMER_BOUNDS,
                      "group.id": f"{self.topic}-feed", "enable.auto.commit": False,
                      "auto.offset.reset": "earliest"})  # fmt: skip
        tp = TopicPartition(self.topic, 0, int((time.time() - self.lookback_s) * 1000))
        start = c.offsets_for_times([tp], timeout=30)[0]
        end = c.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=30)[1]
        c.assign([TopicPartition(self.topic, 0, end if start.offset < 0 else start.offset)])
        if start.offset < 0 or start.offset >= end:
            self._caught_up.set()
        while not self._stop.is_set():
            for m in c.consume(500, 0.2):
                if m.error() is not None:
                    continue
                self._apply(m.value())
                if (m.offset() or 0) >= end - 1:
                    self._caught_up.set()
        c.close()

    def _apply(self, value: bytes | None) -> None:
        try:
            marker = Marker.from_json(value or b"")
        except (ValueError, TypeError, KeyError) as e:
            self.stats["bad"] += 1
            log.warning("progress record not understood: %s", e)
            return
        self.stats["records"] += 1
        if marker.replica != self.view.replica:
            self.view.apply(marker)
