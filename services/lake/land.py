"""The landing service: Kafka topics → lake, exactly once.

One loop: ``poll`` → decode to rows (:mod:`services.lake.decode`) → accumulate per source
partition → on size or age, :meth:`LakeWriter.land` (durable, renamed) → commit ``last + 1``
synchronously. Offsets are committed only after the files are visible, and on assignment each
partition is sought to ``max(committed, landed high-water + 1)`` read from the lake, so a crash
at any point neither loses nor duplicates a record. Refined rows whose lineage
``(raw_partition, raw_offset)`` already landed from this source partition are replays by the
refiner and are skipped (a refined record holds the rows of one or more raw records of one
node).

Records that cannot be decoded are counted and logged (one line to stderr) and their offsets
committed with the flush that passes them. Anything else (disk full, broker fatal error)
raises out of :meth:`LandingService.run` so the supervisor restarts the process.

Test seam: ``crash_at`` ``after_rename`` / ``after_commit`` (plus the writer's
``before_rename`` / ``mid_rename``), optionally ``@N``: the process exits with status 137 there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, KafkaException, TopicPartition

from schemas.codec import content_type_of
from schemas.errors import RejectedInput
from services.lake.compact import Compactor
from services.lake.decode import rows_of
from services.lake.writer import CrashSeam, LakeWriter

TP = tuple[str, int]


LINEAGE_WINDOW = 50_000  # raw offsets below a raw partition's newest landed one, remembered


class _Landed:
    """Landed offsets of one raw partition: exact within :data:`LINEAGE_WINDOW` of the
    highest; anything older counts as landed (a resend arrives within seconds, not hours)."""

    def __init__(self) -> None:
        self.high = -1
        self._recent: set[int] = set()

    def has(self, offset: int) -> bool:
        return offset <= self.high - LINEAGE_WINDOW or offset in self._recent

    def add(self, offset: int) -> None:
        self._recent.add(offset)
        if offset > self.high:
            self.high = offset
            if len(self._recent) > 2 * LINEAGE_WINDOW:
                floor = self.high - LINEAGE_WINDOW
                self._recent = {o for o in self._recent if o > floor}


@dataclass
class _Pending:
    tables: list[pa.Table] = field(default_factory=list)
    first: int = -1
    last: int = -1
    rows: int = 0
    since: float = 0.0


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
        writer: LakeWriter,
        topics: dict[str, str],
        *,
        max_rows: int = 500_000,
        max_age_s: float = 2.0,
        compactor: Compactor | None = None,
        compact_every_s: float = 300.0,
        crash_at: str | None = None,
        log: TextIO = sys.stderr,
    ) -> None:
        self.conf = {
            "auto.offset.reset": "earliest",
            **consumer_conf,
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
        self._landed: dict[TP, int] = {}
        self._lineage: dict[TP, dict[int, _Landed]] = {}
        self._consumer: Any = None
        self._assigned_at: float | None = None

    # --- assignment -----------------------------------------------------------------------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
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
            if ds == "samples":
                self._lineage[tp] = self._lineage_high_water(p.partition)
            start = max(committed.get(tp, -1), hw + 1)
            self._assigned_at = time.monotonic()
            if start > 0:
                p.offset = start
            self._pending.pop(tp, None)
        consumer.assign(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        for p in partitions:  # not committed: whoever gets the partition consumes them again
            self._pending.pop((p.topic, p.partition), None)

    def _lineage_high_water(self, partition: int) -> dict[int, _Landed]:
        """The raw positions already landed in this refined partition's files: per raw
        partition, its highest offset and every landed offset within the window below it."""
        files = [str(p) for p in self.writer.live_paths("samples", partition)]
        if not files:
            return {}
        rows = duckdb.execute(
            """
            WITH t AS (SELECT DISTINCT raw_partition AS rp, raw_offset AS o
                       FROM read_parquet(?) WHERE raw_partition IS NOT NULL),
                 m AS (SELECT rp, max(o) AS hw FROM t GROUP BY rp)
            SELECT t.rp, t.o FROM t JOIN m USING (rp) WHERE t.o > m.hw - ?
            """,
            [files, LINEAGE_WINDOW],
        ).fetchall()
        out: dict[int, _Landed] = {}
        for rp, off in rows:
            out.setdefault(int(rp), _Landed()).add(int(off))
        return out

    # --- the loop -------------------------------------------------------------------------

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
                        continue
                    last_msg = now
                    self._accept(msg)
                for tp, pend in list(self._pending.items()):
                    if pend.rows >= self.max_rows or now - pend.since >= self.max_age_s:
                        self._flush(tp)
                if self.compactor is not None and now >= next_compact:
                    self.compactor.compact_closed(list(set(self.topics.values())))
                    next_compact = now + self.compact_every_s
                if (
                    once_idle_s is not None
                    and self._assigned_at is not None  # idle counts once we own partitions
                    and now - max(last_msg, self._assigned_at) >= once_idle_s
                ):
                    break
            for tp in list(self._pending):
                self._flush(tp)
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
        if table is not None and ds == "samples" and table.num_rows:
            table = self._drop_replayed(tp, table)
        pend = self._pending.setdefault(tp, _Pending(since=time.monotonic()))
        if pend.first < 0:
            pend.first, pend.since = offset, time.monotonic()
        pend.last = offset
        if table is not None and table.num_rows:
            pend.tables.append(table)
            pend.rows += table.num_rows

    def _drop_replayed(self, tp: TP, table: pa.Table) -> pa.Table:
        """Rows whose raw position (partition, offset) already landed: a replay after a crash
        or a resend. Exact positions, not a high-water mark: a record resent after a later one
        of the same raw partition (a produce retry) still lands."""
        seen = self._lineage.setdefault(tp, {})
        dup_pairs = []
        for rp, off in _positions(table):
            if rp is None or off is None:
                continue
            landed = seen.setdefault(int(rp), _Landed())
            if landed.has(int(off)):
                dup_pairs.append((int(rp), int(off)))
            else:
                landed.add(int(off))
        if not dup_pairs:
            return table
        keep = None
        for rp, off in dup_pairs:
            hit = pc.and_(
                pc.equal(table.column("raw_partition"), rp),
                pc.equal(table.column("raw_offset"), off),
            )
            keep = pc.invert(hit) if keep is None else pc.and_(keep, pc.invert(hit))
        kept = table.filter(keep)
        self.stats.skipped_replayed_rows += table.num_rows - kept.num_rows
        return kept

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


def _positions(table: pa.Table) -> list[tuple[int | None, int | None]]:
    """The distinct raw positions (partition, offset) of a refined table's rows. A refined
    record holds one node's raw records, all of one raw partition: one min/max pass settles
    the partition, and the offsets are hashed alone (or not at all when there is one)."""
    part, off = table.column("raw_partition"), table.column("raw_offset")
    if part.null_count == 0 and off.null_count == 0:
        p, o = pc.min_max(part), pc.min_max(off)
        if p["min"] == p["max"]:
            rp = p["min"].as_py()
            if o["min"] == o["max"]:
                return [(rp, o["min"].as_py())]
            return [(rp, x) for x in pc.unique(off).to_pylist()]
    pairs = table.group_by(["raw_partition", "raw_offset"]).aggregate([])
    return list(
        zip(
            pairs.column("raw_partition").to_pylist(),
            pairs.column("raw_offset").to_pylist(),
            strict=True,
        )
    )
