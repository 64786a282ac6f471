"""The landing service: Kafka topics → lake, exactly once.

One loop: ``poll`` → decode to rows (:mod:`services.lake.decode`) → accumulate per source
partition → on size or age, :meth:`LakeWriter.land` (durable, renamed) → commit ``last + 1``
synchronously. Offsets are committed only after the files are visible, and on assignment each
partition is sought to ``max(committed, landed high-water + 1)`` read from the lake, so a crash
at any point neither loses nor duplicates a record. Rows whose identity already landed from
this source partition — the lineage ``(raw_partition, raw_offset)`` of refined samples, events
and collectives, a dead letter's or accounting row's raw position, an alert's or episode's
``(id, state)``, a rollup's window — are copies their producer published again after a crash
and are skipped (:mod:`services.lake.lineage`).

Records that cannot be decoded are counted and logged (one line to stderr) and their offsets
committed with the flush that passes them. Anything else (disk full, broker fatal error)
raises out of :meth:`LandingService.run` so the supervisor restarts the process.

A :class:`~services.lake.backend.BatchLakeSink` (the Iceberg lake) is handed every pending
partition of a dataset at once when one of them is due, with each row's Kafka offset, and
commits them as one snapshot; the offsets of all those partitions are then committed together.

Test seam: ``crash_at`` ``after_rename`` / ``after_commit`` (plus the writer's
``before_rename`` / ``mid_rename``), optionally ``@N``: the process exits with status 137 there.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaException, TopicPartition

from schemas.codec import content_type_of
from schemas.errors import RejectedInput
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS
from services.lake.backend import BatchLakeSink, Flush, LakeCompaction, LakeSink
from services.lake.decode import rows_of
from services.lake.lineage import IDENTITIES, LineageIndex
from services.lake.writer import CrashSeam

log = logging.getLogger(__name__)

TP = tuple[str, int]


@dataclass
class _Pending:
    tables: list[pa.Table] = field(default_factory=list)
    first: int = -1
    last: int = -1
    rows: int = 0
    since: float = 0.0
    offsets: list[int] = field(default_factory=list)  # the record of each table, for a
    counts: list[int] = field(default_factory=list)  # BatchLakeSink: each row's offset


@dataclass
class LandingStats:
    """Counters of one run, for the caller's report and the tests."""

    records: int = 0
    rows: int = 0
    files: int = 0
    flushes: int = 0
    skipped_landed: int = 0
    skipped_replayed_rows: int = 0
    rejected: int = 0


class LandingService:
    """Consumes ``topics`` (topic → dataset) into ``writer``'s lake.

    ``consumer_conf`` is librdkafka configuration (bootstrap, security, ``group.id``); auto
    commit is forced off and isolation to read_committed. ``max_rows`` and ``max_age_s`` bound
    a partition's buffer. ``compactor`` (optional) compacts closed hours every
    ``compact_every_s`` from inside the loop.
    """

    def __init__(
        self,
        consumer_conf: dict[str, Any],
        writer: LakeSink,
        topics: dict[str, str],
        *,
        max_rows: int = 500_000,
        max_age_s: float = 2.0,
        compactor: LakeCompaction | None = None,
        compact_every_s: float = 300.0,
        crash_at: str | None = None,
        log: TextIO = sys.stderr,
    ) -> None:
        self.conf = {
            "auto.offset.reset": "earliest",
            **consumer_conf,
            **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
        }
        self.writer = writer
        self.topics = topics
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.compactor = compactor
        self.compact_every_s = compact_every_s
        self.seam = CrashSeam(crash_at)
        writer.seam = self.seam  # one countdown across the writer's and our crash points
        self.log = log
        self.stats = LandingStats()
        self._pending: dict[TP, _Pending] = {}
        self._last_error: tuple[str, float] = ("", 0.0)  # the last consumer error logged, when
        self._landed: dict[TP, int] = {}
        self._lineage: dict[TP, LineageIndex] = {}
        self._consumer: Any = None
        self._assigned_at: float | None = None

    # --- assignment -----------------------------------------------------------------------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        shown = ", ".join(sorted(f"{p.topic}:{p.partition}" for p in partitions))
        log.info("land: group %s assigned %s", self.conf.get("group.id"), shown or "no partitions")
        committed = {(p.topic, p.partition): p.offset for p in consumer.committed(partitions, 30)}
        by_ds: dict[str, set[int]] = {}
        for p in partitions:
            by_ds.setdefault(self.topics[p.topic], set()).add(p.partition)
        for ds, parts in by_ds.items():
            self.writer.recover(ds, parts)
        for p in partitions:
            ds = self.topics[p.topic]
            tp = (p.topic, p.partition)
            hw = self.writer.landed_high_water(ds).get(p.partition, -1)
            self._landed[tp] = hw
            spec = IDENTITIES.get(ds)
            if spec is not None:
                files = [str(f) for f in self.writer.live_paths(ds, p.partition)]
                self._lineage[tp] = LineageIndex.from_files(spec, files, self.writer.reader())
            start = max(committed.get(tp, -1), hw + 1)
            self._assigned_at = time.monotonic()
            if start > 0:
                p.offset = start
            self._pending.pop(tp, None)
        consumer.assign(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        for p in partitions:  # not committed: whoever gets the partition consumes them again
            self._pending.pop((p.topic, p.partition), None)

    # --- the loop -------------------------------------------------------------------------

    def _consumer_error(self, msg: Any, err: Any) -> None:
        """Log a non-fatal consumer error (not authorized on a topic, unknown topic, ...): a
        dataset that stays empty says why. One line per distinct error a minute at most."""
        text = f"{msg.topic() or 'consumer'}: {err.str()}"
        now = time.monotonic()
        if text != self._last_error[0] or now - self._last_error[1] >= 60.0:
            log.warning("land: %s", text)
            self._last_error = (text, now)

    def run(
        self,
        *,
        once_idle_s: float | None = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> LandingStats:
        """Land until ``stop()`` is true or, with ``once_idle_s``, nothing has arrived for that
        long and everything is landed. Flushes what it holds before returning. Blocks."""
        for ds in set(self.topics.values()):
            self.writer.ensure_seed(ds)
        if self.compactor is not None:
            for ds in set(self.topics.values()):
                self.compactor.recover(ds)
        consumer = Consumer(self.conf)
        self._consumer = consumer
        consumer.subscribe(list(self.topics), on_assign=self._on_assign, on_revoke=self._on_revoke)
        log.info("land: subscribed to %s as group %s", ", ".join(sorted(self.topics)),
                 self.conf.get("group.id"))  # fmt: skip
        last_msg = time.monotonic()
        next_compact = time.monotonic() + self.compact_every_s
        try:
            while not stop():
                msgs = consumer.consume(num_messages=1000, timeout=0.2)
                now = time.monotonic()
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.fatal():
                            raise KafkaException(err)
                        self._consumer_error(msg, err)
                        continue
                    last_msg = now
                    self._accept(msg)
                self._flush_due(now)
                if self.compactor is not None and now >= next_compact:
                    self.compactor.compact_closed(list(set(self.topics.values())))
                    next_compact = now + self.compact_every_s
                if (
                    once_idle_s is not None
                    and self._assigned_at is not None  # idle counts once we own partitions
                    and now - max(last_msg, self._assigned_at) >= once_idle_s
                ):
                    break
            self._flush_due(None)
        finally:
            consumer.close()
        return self.stats

    def _accept(self, msg: Any) -> None:
        tp = (msg.topic(), msg.partition())
        offset = msg.offset()
        if offset <= self._landed.get(tp, -1):
            self.stats.skipped_landed += 1
            return
        ds = self.topics[tp[0]]
        self.stats.records += 1
        _, ts_ms = msg.timestamp()
        try:
            table = rows_of(
                ds,
                msg.value(),
                content_type_of(msg.headers()),
                partition=tp[1],
                offset=offset,
                timestamp_ns=max(ts_ms, 0) * 1_000_000,
            )
        except RejectedInput as e:
            self.stats.rejected += 1
            print(f"land: {tp[0]}[{tp[1]}]@{offset} rejected: {e}", file=self.log)
            table = None
        if table is not None and table.num_rows and ds in IDENTITIES:
            table = self._drop_replayed(tp, ds, table)
        pend = self._pending.setdefault(tp, _Pending(since=time.monotonic()))
        if pend.first < 0:
            pend.first, pend.since = offset, time.monotonic()
        pend.last = offset
        if table is not None and table.num_rows:
            pend.tables.append(table)
            pend.rows += table.num_rows
            pend.offsets.append(offset)
            pend.counts.append(table.num_rows)

    def _drop_replayed(self, tp: TP, ds: str, table: pa.Table) -> pa.Table:
        """Rows whose identity already landed from this partition: a copy its producer
        published again after a crash (:mod:`services.lake.lineage`). Exact identities, not a
        high-water mark: a record resent after a later one of its stream still lands."""
        index = self._lineage.get(tp)
        if index is None:
            index = self._lineage[tp] = LineageIndex(IDENTITIES[ds])
        kept = index.drop_landed(table)
        self.stats.skipped_replayed_rows += table.num_rows - kept.num_rows
        return kept

    def _flush_due(self, now: float | None) -> None:
        """Flush the partitions due at ``now`` (every one when None); a BatchLakeSink gets
        every pending partition of a dataset one of whose partitions is due."""
        due = [
            tp
            for tp, p in self._pending.items()
            if now is None or p.rows >= self.max_rows or now - p.since >= self.max_age_s
        ]
        if not isinstance(self.writer, BatchLakeSink):
            for tp in due:
                self._flush(tp)
            return
        for ds in sorted({self.topics[tp[0]] for tp in due}):
            self._flush_dataset(self.writer, ds)

    def _flush_dataset(self, writer: BatchLakeSink, ds: str) -> None:
        """Land every pending partition of ``ds`` as one commit, then commit their offsets."""
        tps = [tp for tp in self._pending if self.topics[tp[0]] == ds]
        pends = [self._pending.pop(tp) for tp in tps]
        flushes = [
            Flush(
                tp[1],
                p.first,
                p.last,
                pa.concat_tables(p.tables) if p.tables else None,
                np.repeat(np.asarray(p.offsets, np.int64), np.asarray(p.counts, np.int64)),
            )
            for tp, p in zip(tps, pends, strict=True)
        ]
        files = writer.land_flushes(ds, flushes)
        self.stats.files += len(files)
        self.stats.rows += sum(p.rows for p in pends)
        self.seam.reach("after_rename")
        self._consumer.commit(
            offsets=[
                TopicPartition(t, part, p.last + 1) for (t, part), p in zip(tps, pends, strict=True)
            ],
            asynchronous=False,
        )
        self.seam.reach("after_commit")
        for tp, p in zip(tps, pends, strict=True):
            self._landed[tp] = p.last
        self.stats.flushes += 1

    def _flush(self, tp: TP) -> None:
        pend = self._pending.pop(tp)
        topic, part = tp
        if pend.tables:
            table = pa.concat_tables(pend.tables)
            files = self.writer.land(
                self.topics[topic], table, partition=part, first=pend.first, last=pend.last
            )
            self.stats.files += len(files)
            self.stats.rows += table.num_rows
        self.seam.reach("after_rename")
        self._consumer.commit(
            offsets=[TopicPartition(topic, part, pend.last + 1)], asynchronous=False
        )
        self.seam.reach("after_commit")
        self._landed[tp] = pend.last
        self.stats.flushes += 1
