"""The stream processors' output producer: librdkafka (confluent-kafka) instead of the Faust
app's aiokafka producer.

Why not aiokafka: a worker's outputs are large (the refined samples are most of the bytes it
moves) and aiokafka builds record batches and writes sockets in Python on the event loop's
thread, the same thread that refines. librdkafka does both in its own threads, in C, without
the GIL, so the refining thread only enqueues. Measured with py-spy on ``refinery worker``
over a preloaded raw topic: aiokafka's send path took about a fifth of the refining thread.

The contract of :meth:`OutputProducer.publish`, on which the checkpoints
(``services/worker/checkpoint.py``, ``services/detect/checkpoint.py``) ack records: every
message is acknowledged by the broker (``acks=all``, idempotent, so librdkafka's own retries
never write a message twice) before it returns; anything not acknowledged raises
:class:`OutputError` and the agent crashes, its records stay uncommitted and the next owner
replays them. Keys go to partitions with murmur2, as the Java client and aiokafka do, so a
node's records land on the same partition as before and as every other Kafka client puts
them.

The worker's Faust tables' changelog records go through it too (explicit partition, the
partition of the input record that changed the key), after the group's outputs are
acknowledged: aiokafka would build the batches of megabytes of state per group in Python on
the refining thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import KafkaError, Message, Producer

from services.settings import KafkaSettings

_KEYED = -1  # librdkafka's RD_KAFKA_PARTITION_UA, produce()'s default: the partitioner picks


@dataclass(frozen=True)
class OutMessage:
    topic: str
    key: bytes
    value: bytes | pa.Buffer  # an Arrow value stays in its buffer (see schemas.codec.ipc_stream)
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    partition: int | None = None  # None: the key's partition (murmur2)


class OutputError(RuntimeError):
    """Outputs the broker did not acknowledge: the group they belong to must not be acked."""


class Delivery:
    """What became of the messages of one :meth:`OutputProducer.enqueue` call (filled in by
    librdkafka's delivery callbacks)."""

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.acked = 0
        self.failed: list[tuple[str, KafkaError]] = []

    def delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.acked += 1
        else:
            self.failed.append((str(msg.topic()), err))

    @property
    def done(self) -> bool:
        return self.acked + len(self.failed) >= self.messages


class OutputProducer:
    """One per process, shared by its agents (librdkafka's producer is thread-safe)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        client_id: str,
        deadline_s: float = 30.0,
    ) -> None:
        self.deadline_s = deadline_s
        conf: dict[str, Any] = {
            **kafka.librdkafka(),
            "client.id": client_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "batch.size": 4_000_000,
            # compressed in librdkafka's threads, off the refining thread: refined Arrow
            # repeats each record's strings per row (~300 bytes a sample, ~4x smaller in lz4),
            # and every byte not sent is one the broker does not append and no consumer reads
            "compression.type": "lz4",
            "message.max.bytes": 33_554_432,  # as the Faust producer's max request size
            "queue.buffering.max.kbytes": 1_048_576,
            "partitioner": "murmur2_random",  # keyed: murmur2, as Java and aiokafka
            # a message not acknowledged within the deadline fails (librdkafka retries a
            # moved leader or a broker restart until then)
            "message.timeout.ms": int(deadline_s * 1000),
            "log_level": 3,
        }
        self._producer = Producer(conf)

    async def publish(self, messages: Sequence[OutMessage]) -> None:
        """Send ``messages`` and return once every one is acknowledged; raise
        :class:`OutputError` naming the first failure otherwise."""
        await self.wait([await self.enqueue(messages)])

    async def enqueue(self, messages: Sequence[OutMessage]) -> Delivery:
        """Hand ``messages`` to librdkafka, which sends them from its own threads while the
        caller goes on; :meth:`wait` for the returned :class:`Delivery` before relying on
        them."""
        d = Delivery(len(messages))
        for m in messages:
            headers: list[tuple[str, str | bytes | None]] = list(m.headers)
            while True:
                try:
                    part = _KEYED if m.partition is None else m.partition
                    self._producer.produce(
                        m.topic, m.value, m.key, part, headers=headers, on_delivery=d.delivered
                    )
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    await asyncio.get_running_loop().run_in_executor(
                        None, self._producer.poll, 0.05
                    )
        return d

    async def wait(self, deliveries: Sequence[Delivery]) -> None:
        """Return once every message of ``deliveries`` is acknowledged; raise
        :class:`OutputError` naming the first failure otherwise."""
        total = sum(d.messages for d in deliveries)
        if not total:
            return
        done = await asyncio.get_running_loop().run_in_executor(
            None, self._serve, deliveries, time.monotonic() + self.deadline_s + 5.0
        )
        failed = [f for d in deliveries for f in d.failed]
        if failed:
            topic, err = failed[0]
            raise OutputError(
                f"{len(failed)} of {total} outputs not acknowledged; first: "
                f"{topic}: {err.name()}: {err.str()}"
            )
        if not done:
            left = sum(d.messages - d.acked for d in deliveries)
            raise OutputError(f"{left} outputs still unacknowledged after {self.deadline_s} s")

    def close(self) -> None:
        """Stop the producer (its threads, its connections); wait for what it holds first."""
        self._producer.close()

    def _serve(self, deliveries: Sequence[Delivery], until: float) -> bool:
        """Serve delivery reports (in this thread, the GIL released while librdkafka waits)
        until every one of ``deliveries`` has its report or ``until``. Not ``flush()``: a
        wait is for these messages, not for whatever other agents queued meanwhile."""
        while not all(d.done for d in deliveries):
            if time.monotonic() > until:
                return False
            self._producer.poll(0.05)
        return True
