"""Commit progress as the broker sees it: the worker's own liveness signal.

A worker can hold partitions, answer its web port and still refine nothing (a fetch that never
resumes after a rebalance, say). :class:`CommitWatch` asks the broker, from a thread, for the
group's committed offsets and the end offsets of the partitions this worker owns. Per partition:
while input waits there (lag > 0) and its committed offset does not move, its stall grows; the
worker's stall is the longest of them, so one partition the fetcher stopped feeding is seen even
while the others flow. The worker reports
itself unhealthy after ``stall_after_s`` and exits non-zero after twice that, so whatever
supervises it starts a fresh one; nothing is lost, since uncommitted input is replayed.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class CommitWatch:
    """Lag and commit progress of ``group`` over a set of partitions. Thread-safe."""

    def __init__(self, conf: dict[str, Any], group: str) -> None:
        self._conf = {**conf, "group.id": group, "enable.auto.commit": False}
        self._consumer: Any = None
        self._lock = threading.Lock()
        self._last: dict[tuple[str, int], int] = {}  # committed offset per partition
        self._since: dict[tuple[str, int], float] = {}  # waiting with that offset since
        self.lag = 0
        self.stalled_partition: tuple[str, int] | None = None  # the longest-stalled one

    def restart(self) -> None:
        """Partitions moved: measure every stall from now."""
        with self._lock:
            self._last.clear()
            self._since.clear()

    def check(self, partitions: list[tuple[str, int]]) -> float:
        """Query the broker (blocking, a few ms) and return the longest time, in seconds, any
        one partition has had input waiting with no commit progress (0 when none has)."""
        from confluent_kafka import TopicPartition

        with self._lock:
            now = time.monotonic()
            tps = [TopicPartition(t, p) for t, p in partitions]
            committed = (
                {
                    (tp.topic, tp.partition): tp.offset
                    for tp in self._client().committed(tps, timeout=10)
                }
                if tps
                else {}
            )
            lag, worst, worst_tp = 0, 0.0, None
            since: dict[tuple[str, int], float] = {}
            for t, p in partitions:
                lo, hi = self._watermarks(TopicPartition(t, p))
                pos = committed.get((t, p), -1)
                waiting = max(0, hi - max(pos, lo))
                lag += waiting
                key = (t, p)
                moved = self._last.get(key) != pos
                since[key] = now if waiting == 0 or moved else self._since.get(key, now)
                if now - since[key] > worst:
                    worst, worst_tp = now - since[key], key
            self.lag, self._since, self._last = lag, since, committed
            self.stalled_partition = worst_tp
            return worst

    def stalled(self, longer_than_s: float) -> list[tuple[str, int]]:
        """The partitions whose stall, as of the last :meth:`check`, is longer than
        ``longer_than_s``, longest first."""
        with self._lock:
            now = time.monotonic()
            late = [(now - t, tp) for tp, t in self._since.items() if now - t > longer_than_s]
        return [tp for _, tp in sorted(late, reverse=True)]

    def start_offsets(self, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Where a new owner of each partition starts reading: the group's committed offset,
        or the start of the log where there is none (``auto.offset.reset=earliest``) or it
        was deleted. The worker compares the first event of each newly assigned partition
        with it: Faust's consumer can commit past a record its stream never handed over (its
        gap check is off by one at the committed offset), so a first event beyond this
        offset means records to fetch. Blocking, a few ms."""
        from confluent_kafka import TopicPartition

        with self._lock:
            tps = [TopicPartition(t, p) for t, p in partitions]
            committed = self._client().committed(tps, timeout=10)
            return {
                (tp.topic, tp.partition): max(tp.offset, self._watermarks(tp)[0])
                for tp in committed
            }

    def _client(self) -> Any:
        """The watch's consumer (never subscribes: it only reads offsets); under the lock."""
        from confluent_kafka import Consumer

        if self._consumer is None:
            self._consumer = Consumer(self._conf)
        return self._consumer

    def _watermarks(self, tp: Any) -> tuple[int, int]:
        from confluent_kafka import KafkaError, KafkaException

        try:
            lo, hi = self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._UNKNOWN_PARTITION:
                raise
            # a topic newer than this client's metadata: refresh it once and ask again
            self._consumer.list_topics(tp.topic, timeout=10)
            lo, hi = self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)
        return int(lo), int(hi)

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


class RefusedMessage:
    """A record :func:`fetch_range` could not read because its batch would inflate past the
    consumer's bound, in the shape of a confluent-kafka ``Message``: no key, an empty value
    and the header that marks it refused (:data:`services.kafka.internals.REFUSED_HEADER`)."""

    def __init__(self, topic: str, partition: int, offset: int, why: str) -> None:
        from services.kafka.internals import REFUSED_HEADER

        self._at = (topic, partition, offset)
        self._read_ms = time.time_ns() // 1_000_000
        self._headers = [(REFUSED_HEADER, f"{why} (offset {offset})".encode())]

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]

    def key(self) -> None:
        return None

    def value(self) -> bytes:
        return b""

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        # the batch's own time was never read: when it was refused, as a broker time
        from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

        return (TIMESTAMP_LOG_APPEND_TIME, self._read_ms)

    def error(self) -> None:
        return None


class IncompleteFetch(RuntimeError):
    """A range of offsets could not be read whole: nothing past its start may be committed.
    Raised in a group, it fails the group (none of its records is acked) and the worker
    exits for its supervisor to restart it: a broker that does not serve a partition's
    records in half a minute is an infrastructure failure."""


def fetch_range(
    conf: dict[str, Any], topic: str, partition: int, start: int, end: int, timeout_s: float = 30
) -> list[Any]:
    """Every record at offsets ``[start, end)`` of one partition, read directly
    (confluent-kafka ``Message`` objects, in offset order). The worker uses it to refine
    records its Faust stream skipped: raw offsets are contiguous, so a gap between two
    consecutive events of a partition is a record that was never handed to the agent.

    The range is read whole or not at all: it is whole once a record at ``end - 1`` or
    beyond was read, or the consumer's position passed it (offsets in between that it never
    returned are gone: deleted by retention, compacted, or control records). Anything less
    by ``timeout_s`` raises :class:`IncompleteFetch`: returning part of the range, the caller
    would declare all of it handled and commit past records it never refined."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

    c = Consumer(
        {
            **conf,
            **LIBRDKAFKA_CONSUMER_BOUNDS,
            "group.id": "refinery-gap-fetch",
            "enable.auto.commit": False,
            # offsets deleted meanwhile: read from the log's start, not its end
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    out: list[Any] = []
    reached = start  # every offset below it is read or gone
    try:
        c.assign([TopicPartition(topic, partition, start)])
        deadline = time.monotonic() + timeout_s
        while reached < end and time.monotonic() < deadline:
            for m in c.consume(num_messages=max(1, min(end - reached, 10_000)), timeout=0.5):
                err = m.error()
                if err is not None and err.code() == KafkaError._BAD_COMPRESSION:
                    # a batch librdkafka would not inflate (over receive.message.max.bytes):
                    # it repeats the error at that offset for good; each offset is handed
                    # over as refused (the refiner dead-letters it) and reading goes on
                    off = int(m.offset() or 0)
                    if start <= off < end and off >= reached:
                        out.append(RefusedMessage(topic, partition, off, str(err)))
                        reached = off + 1
                    c.seek(TopicPartition(topic, partition, max(off + 1, reached)))
                    break
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    continue
                off = int(m.offset() or 0)
                if err is None and start <= off < end and off >= reached:
                    out.append(m)
                reached = max(reached, off + 1 if err is None else off)
    finally:
        c.close()
    if reached < end:
        raise IncompleteFetch(
            f"{topic}[{partition}]: read offsets {start}..{reached - 1} of {start}..{end - 1}"
            f" in {timeout_s:.0f} s"
        )
    return out
