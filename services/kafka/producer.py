"""The producer path shared by every exporter, the importers and the simulator.

:class:`BatchProducer` wraps a confluent-kafka ``Producer`` with idempotence and ``acks=all``,
compression and batching. It encodes each batch (Arrow IPC by default) with its
``content-type`` header and the source node as key.

When Kafka is unreachable, librdkafka keeps retrying messages in its own queue until
``message.timeout.ms`` (default here: 5 minutes, so a broker restart costs nothing). Beyond that
queue, batches wait in a bounded spool (memory, or ``spool_dir`` on disk) and are re-sent when the
broker is back. A batch that timed out in librdkafka's queue goes back into the spool, behind
newer ones (the refiner deduplicates by source and seq, however late a first delivery comes).

Bounds and what they drop: librdkafka's queue holds at most ``queue.buffering.max.messages``
batches and ``queue.buffering.max.kbytes``; beyond it the spool holds ``spool_max_batches``
batches and ``spool_max_bytes`` encoded bytes. When the spool is full the OLDEST batch is
dropped — a node exporter prefers fresh data to a stale backlog. A drop is never silent: it is
counted in ``stats.dropped_overflow`` (batches) and ``stats.dropped_samples`` (their rows),
handed to ``on_drop(tag, samples)`` when given, and logged as a warning at the first drop and
then at most once per ``drop_log_every_s`` while drops go on (served by :meth:`poll`, and at
:meth:`close`). Downstream the dropped batch leaves a gap in its source's ``seq`` numbers.

Delivery reports go to ``on_delivery(envelope_key, error, partition, offset)`` when given, so a
caller (the simulator) can record exactly which batches were acknowledged.

Exchanges with the broker: on a topic with ``LogAppendTime`` each delivery report carries the
broker's append time ``A`` of the record. With the wall clock read just before ``produce()``
(``S``) and when the report is served (``R``) it bounds this host's clock offset to the
partition leader's (:mod:`pipelines.refine.clock_bounds`). The producer keeps its recent exchanges
(:attr:`BatchProducer.exchanges`) and :meth:`BatchProducer.send` carries them in each batch's
clock block. Reports are served by :meth:`poll`/:meth:`send`: an exporter that polls often
keeps ``R - S`` (and so the bound) small. ``on_exchange(tag, exchange, mono_sent, mono_ack)``
hands each one to a caller that keeps its own (the simulator, whose clocks are simulated).

Example::

    p = BatchProducer(KafkaSettings(), topic="telemetry.raw")
    p.send(envelope, table)
    p.close()   # flushes
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    KafkaError,
    KafkaException,
    Message,
    Producer,
)

from pipelines.refine.clock_bounds import Exchange, ExchangeLog
from schemas.codec import ARROW, encode
from schemas.wire import PAYLOAD_SCHEMAS, ClockBlock, Envelope
from services.settings import KafkaSettings

log = logging.getLogger(__name__)

DeliveryCallback = Callable[[str, "KafkaError | None", int, int], None]
DropCallback = Callable[[str, int], None]
ExchangeCallback = Callable[[str, Exchange, int, int], None]


@dataclass
class ProducerStats:
    sent: int = 0
    acked: int = 0
    failed: int = 0
    spooled: int = 0
    resent: int = 0
    dropped_overflow: int = 0  # batches the spool's bounds dropped (oldest first)
    dropped_samples: int = 0  # rows of those batches (0 for pre-encoded bytes)


@dataclass(frozen=True)
class _Pending:
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    tag: str
    timestamp_ms: int = 0  # the record's CreateTime; 0: now
    samples: int = 0  # rows of the batch (0: not known, pre-encoded bytes)


def initial_seq() -> int:
    """Where a source process starts numbering its batches.

    ``seq`` must keep increasing across restarts of an exporter within one ``boot_id``, or
    the refiner takes the new process's batches for resends of the old one's. Starting from
    the wall clock in microseconds does that without a state file, as long as a source sends
    fewer than a million batches per second and its clock does not step back by more than
    the previous process's lifetime.
    """
    return time.time_ns() // 1_000


def _raw_ns() -> int:
    """The raw monotonic clock (``CLOCK_MONOTONIC_RAW``: the oscillator, never stepped nor
    slewed by a time daemon); the monotonic clock where the platform has none."""
    return time.clock_gettime_ns(_RAW)


_RAW = getattr(time, "CLOCK_MONOTONIC_RAW", time.CLOCK_MONOTONIC)


def clock_pair(tries: int = 4) -> tuple[int, int]:
    """(wall, raw monotonic) ns read together. Of a few tries, the wall reading whose raw
    readings either side are closest, with their midpoint: a process preempted between two
    reads (a loaded host) must not look like a step of its wall clock (``ExchangeLog``
    tolerates 50 µs)."""
    best = (0, 0, 0)
    for i in range(tries):
        m0 = _raw_ns()
        wall = time.time_ns()
        m1 = _raw_ns()
        if i == 0 or m1 - m0 < best[0]:
            best = (m1 - m0, wall, (m0 + m1) // 2)
        if m1 - m0 < 5_000:
            break
    return best[1], best[2]


class BatchProducer:
    """Publish encoded batches to one topic. Not thread-safe; call :meth:`poll` or
    :meth:`send` regularly so delivery callbacks run. :meth:`close` flushes."""

    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        topic: str,
        content_type: str = ARROW,
        spool_dir: Path | None = None,
        spool_max_batches: int = 10_000,
        on_delivery: DeliveryCallback | None = None,
        extra_conf: dict[str, Any] | None = None,
        on_exchange: ExchangeCallback | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        on_drop: DropCallback | None = None,
        drop_log_every_s: float = 10.0,
    ) -> None:
        conf: dict[str, Any] = {
            **kafka.librdkafka(),
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "zstd",
            "linger.ms": 2,  # sent_ns is stamped before the queue: keep the delay small
            "batch.size": 1_000_000,
            "message.max.bytes": 8_000_000,
            "queue.buffering.max.kbytes": 512 * 1024,
            "message.timeout.ms": 300_000,
        }
        conf.update(extra_conf or {})
        self._producer = Producer(conf)
        self.topic = topic
        self.content_type = content_type
        self.stats = ProducerStats()
        self._on_delivery = on_delivery
        self._on_exchange = on_exchange
        self.exchanges = ExchangeLog()
        self._produce_failures: set[str] = set()
        # the error of the last report that refused a batch for good (not authorized...)
        self.refused: KafkaError | None = None
        self._spool: collections.deque[_Pending] = collections.deque()
        self._spool_max = spool_max_batches
        self._spool_max_bytes = spool_max_bytes
        self._spool_bytes = 0
        self._on_drop = on_drop
        self._drop_log_every_s = drop_log_every_s
        self._drops_logged = (0, 0)  # (batches, samples) in the last warning
        self._drop_logged_at = -float("inf")
        self._spool_dir = spool_dir
        if spool_dir is not None:
            spool_dir.mkdir(parents=True, exist_ok=True)
            self._load_spool()

    # -- sending ----------------------------------------------------------------------------

    def send(self, envelope: Envelope, table: pa.Table, *, key: str | None = None) -> None:
        """Encode and enqueue one batch, its clock block carrying the producer's recent
        exchanges; never blocks for long (it spools instead)."""
        envelope = self.with_exchanges(envelope)
        ct, body = encode(envelope, table, self.content_type)
        tag = f"{envelope.source.key()}|{envelope.seq}"
        self.send_encoded(
            (key or envelope.source.node).encode(),
            body,
            (("content-type", ct.encode()),),
            tag,
            samples=table.num_rows,
        )

    def greet(self, envelope: Envelope, *, key: str | None = None, timeout_s: float = 5.0) -> bool:
        """Send a batch of ``envelope`` (its kind, source and seq) with no rows, and serve
        reports for up to ``timeout_s`` until its report is back; True once the producer has
        an exchange with the broker. A source's first batch with rows then carries it:
        without it, that batch's bound rests on an assumed minimum delay, which a producer
        still connecting (metadata, a new connection to the leader, SASL/TLS) breaks by tens
        of ms. False (the broker did not answer in time, or a CreateTime topic, whose reports
        bound nothing) costs nothing but that first bound; the greeting refused for good
        (:attr:`refused`: the principal may not write the topic) says the batches will be
        too."""
        table = PAYLOAD_SCHEMAS[envelope.kind].empty_table()
        reports = self.stats.acked + self.stats.failed
        self.send(envelope, table, key=key)
        deadline = time.monotonic() + timeout_s
        while not self.exchanges.carried():
            left = deadline - time.monotonic()
            if left <= 0 or self.stats.acked + self.stats.failed > reports:
                return bool(self.exchanges.carried())
            self.poll(min(left, 0.05))
        return True

    def with_exchanges(self, envelope: Envelope) -> Envelope:
        """``envelope`` whose clock block (one with source ``none`` when it has none) carries
        the recent exchanges; as it is while there are none."""
        self.exchanges.check(*clock_pair())
        carried = self.exchanges.for_batch(envelope.source.key())
        if not carried:
            return envelope
        clock = envelope.clock or ClockBlock(source="none")
        update: dict[str, Any] = {"exchanges": [tuple(e.as_list()) for e in carried]}
        if self.exchanges.last_stamps != (0, 0):
            update["stamps_ns"] = self.exchanges.last_stamps
        return envelope.model_copy(update={"clock": clock.model_copy(update=update)})

    def stamp(self) -> int:
        """The wall clock now (ns), to stamp rows with: the setting it was read on is noted,
        so the batch that carries them is bounded over every setting its rows had (a step
        or a slew of the time daemon between stamps; see ``ExchangeLog``)."""
        wall, raw = clock_pair()
        self.exchanges.check(wall, raw)
        return wall

    def send_encoded(
        self,
        key: bytes,
        value: bytes,
        headers: tuple[tuple[str, bytes], ...] = (),
        tag: str = "",
        timestamp_ms: int = 0,
        *,
        samples: int = 0,
    ) -> None:
        """Enqueue pre-encoded bytes (importers, the simulator's malformed records).
        ``timestamp_ms`` sets the record's CreateTime (0: now); a topic with LogAppendTime
        replaces it with the broker's append time."""
        self._drain_spool()
        item = _Pending(key, value, headers, tag, timestamp_ms, samples)
        if self._spool or not self._produce(item):
            self._to_spool(item)
        self._producer.poll(0)

    def _produce(self, item: _Pending) -> bool:
        try:
            self._producer.produce(
                self.topic,
                value=item.value,
                key=item.key,
                headers=list(item.headers),
                timestamp=item.timestamp_ms,
                # read last: the append happens after them (pipelines.refine.clock_bounds)
                on_delivery=self._delivered(item, *clock_pair()),
            )
        except BufferError:
            return False
        except KafkaException as e:
            said = str(e)
            if said not in self._produce_failures:  # once per reason, however often retried
                self._produce_failures.add(said)
                log.warning("produce failed, spooling: %s", said)
            return False
        self.stats.sent += 1
        return True

    def _delivered(
        self, item: _Pending, sent_ns: int, mono_sent: int
    ) -> Callable[[KafkaError | None, Message], None]:
        def cb(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                self.stats.acked += 1
                self._exchanged(item, msg, sent_ns, mono_sent)
            else:
                self.stats.failed += 1
                # a timed-out batch is kept: back into the spool for another try. It may
                # have been written after all; the refiner drops such a resend as a
                # transport duplicate (same source and seq), so nothing doubles downstream.
                if err.retriable() or err.code() == KafkaError._MSG_TIMED_OUT:
                    self._to_spool(item)
                else:
                    self.refused = err
            if self._on_delivery is not None:
                part = msg.partition() if err is None else -1
                off = msg.offset() if err is None else -1
                self._on_delivery(
                    item.tag,
                    err,
                    part if part is not None else -1,
                    off if off is not None else -1,
                )

        return cb

    def _exchanged(self, item: _Pending, msg: Message, sent_ns: int, mono_sent: int) -> None:
        ack_ns, mono_ack = clock_pair()
        kind, append_ms = msg.timestamp()
        part = msg.partition()
        if kind != TIMESTAMP_LOG_APPEND_TIME or part is None:
            return  # a CreateTime topic: the stamp is ours, it bounds nothing
        ex = Exchange(sent_ns, append_ms, ack_ns, part)
        self.exchanges.add(ex, mono_sent, mono_ack)
        if self._on_exchange is not None:
            self._on_exchange(item.tag, ex, mono_sent, mono_ack)

    # -- spool ------------------------------------------------------------------------------

    def _to_spool(self, item: _Pending) -> None:
        while self._spool and (
            len(self._spool) >= self._spool_max
            or self._spool_bytes + len(item.value) > self._spool_max_bytes
        ):
            self._dropped(self._pop_spool())
        self._spool.append(item)
        self._spool_bytes += len(item.value)
        self.stats.spooled += 1

    def _pop_spool(self) -> _Pending:
        item = self._spool.popleft()
        self._spool_bytes -= len(item.value)
        return item

    def _dropped(self, item: _Pending) -> None:
        """Count, report and (rate-limited) log a batch the spool's bounds dropped."""
        self.stats.dropped_overflow += 1
        self.stats.dropped_samples += item.samples
        if self._on_drop is not None:
            self._on_drop(item.tag, item.samples)
        self._log_drops_due()

    def _log_drops_due(self) -> None:
        """Log the drops not yet said, unless the last warning is more recent than the
        interval."""
        if time.monotonic() - self._drop_logged_at >= self._drop_log_every_s:
            self._log_drops()

    def _log_drops(self) -> None:
        s = self.stats
        new = (
            s.dropped_overflow - self._drops_logged[0],
            s.dropped_samples - self._drops_logged[1],
        )
        if new[0] == 0:
            return
        log.warning(
            "%s: spool full (%d batches, %d bytes at most) while the broker is unreachable: "
            "dropped %d oldest batches (%d samples), %d batches (%d samples) in all",
            self.topic, self._spool_max, self._spool_max_bytes, new[0], new[1],
            s.dropped_overflow, s.dropped_samples,
        )  # fmt: skip
        self._drops_logged = (s.dropped_overflow, s.dropped_samples)
        self._drop_logged_at = time.monotonic()

    def _drain_spool(self) -> None:
        while self._spool:
            if not self._produce(self._spool[0]):
                return
            self._pop_spool()
            self.stats.resent += 1

    def _spool_path(self) -> Path:
        assert self._spool_dir is not None
        return self._spool_dir / "spool.arrow"

    def _save_spool(self) -> None:
        if self._spool_dir is None:
            return
        path = self._spool_path()
        if not self._spool:
            path.unlink(missing_ok=True)
            return
        t = pa.table(
            {
                "key": [p.key for p in self._spool],
                "value": [p.value for p in self._spool],
                "content_type": [dict(p.headers).get("content-type", b"") for p in self._spool],
                "tag": [p.tag for p in self._spool],
                "samples": pa.array([p.samples for p in self._spool], pa.int64()),
            }
        )
        tmp = path.with_suffix(".tmp")
        with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
            w.write_table(t)
        os.replace(tmp, path)

    def _load_spool(self) -> None:
        path = self._spool_path()
        if not path.exists():
            return
        t = pa.ipc.open_file(str(path)).read_all().to_pylist()
        for row in t:
            hdr = (("content-type", row["content_type"]),) if row["content_type"] else ()
            samples = int(row.get("samples") or 0)  # a spool saved before it was kept: 0
            self._spool.append(_Pending(row["key"], row["value"], hdr, row["tag"], 0, samples))
            self._spool_bytes += len(row["value"])
        path.unlink()

    # -- lifecycle --------------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery callbacks and retry spooled batches for ``timeout`` seconds, each
        report as it arrives (its exchange's ack time is then when it came, not when the
        wait ended)."""
        deadline = time.monotonic() + timeout
        while True:
            self._producer.poll(max(0.0, deadline - time.monotonic()))
            self._drain_spool()
            if time.monotonic() >= deadline:
                self._log_drops_due()  # drops that came after the last warning
                return

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for outstanding deliveries; returns how many remain unacknowledged."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain_spool()
            left = self._producer.flush(max(0.0, min(1.0, deadline - time.monotonic())))
            if (left == 0 and not self._spool) or time.monotonic() >= deadline:
                return left + len(self._spool)
            if left == 0:  # the spool could not be handed over: wait, do not spin
                self._producer.poll(max(0.0, min(0.2, deadline - time.monotonic())))

    def close(self, timeout: float = 30.0) -> int:
        """Flush, persist what is still unsent to the spool directory if any; returns it."""
        left = self.flush(timeout)
        self._log_drops()
        self._save_spool()
        return left
