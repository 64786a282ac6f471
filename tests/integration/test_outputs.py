"""The agents' output producer against a real broker: keyed messages land where the Java client
and aiokafka put them (murmur2), a message the broker refuses fails the wait naming the broker's
error (the broker refuses the whole record batch it came in, so its neighbours may fail with it:
the group is replayed either way), and a wait returns once its own messages are acknowledged
even while another agent keeps the producer's queue busy."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer

from services.kafka.outputs import OutMessage, OutputError, OutputProducer
from services.settings import KafkaSettings


def _read(conf: dict[str, object], topic: str, n: int) -> list[tuple[bytes, int]]:
    """(key, partition) of the first ``n`` records of ``topic``."""
    c = Consumer({**conf, "group.id": f"read-{topic}", "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    got: list[tuple[bytes, int]] = []
    try:
        for _ in range(120):
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    got.append((m.key() or b"", m.partition() or 0))
            if len(got) >= n:
                break
    finally:
        c.close()
    return got


def test_keys_land_on_the_murmur2_partition_and_every_message_is_acked(
    kafka_conf: dict[str, object], kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("out", partitions=8)
    out = OutputProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), "test-outputs")
    keys = [f"node{i:04d}".encode() for i in range(200)]
    msgs = [OutMessage(topic, k, b"v", [("content-type", b"x")]) for k in keys]
    asyncio.run(out.publish(msgs))
    got = _read(kafka_conf, topic, len(keys))
    assert sorted(k for k, _ in got) == sorted(keys)
    for key, partition in got:
        assert partition == (murmur2(key) & 0x7FFFFFFF) % 8, key


def test_a_refused_message_fails_the_wait_naming_the_broker_error(
    kafka_conf: dict[str, object], kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("small", config={"max.message.bytes": "512"})
    out = OutputProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), "test-outputs")
    asyncio.run(out.publish([OutMessage(topic, b"k", b"x" * 10, [])]))  # a small one passes
    msgs = [OutMessage(topic, b"k", b"x" * 10, []) for _ in range(5)]
    # incompressible: the outputs are lz4-compressed, 4 KiB of one byte would fit in 512
    msgs.insert(2, OutMessage(topic, b"k", random.Random(7).randbytes(4096), []))

    async def run() -> None:
        await out.wait([await out.enqueue(msgs)])

    with pytest.raises(OutputError, match=r"\d of 6 outputs not acknowledged.*MSG_SIZE_TOO_LARGE"):
        asyncio.run(run())
    assert len(_read(kafka_conf, topic, 1)) >= 1


def test_outputs_travel_compressed(
    kafka_conf: dict[str, object], kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    """Refined Arrow repeats each record's strings per row; the broker stores what the
    producer compressed. A 64 KiB value of such rows fits a topic that refuses messages over
    16 KiB only if it is compressed on the way."""
    topic = unique_topic("compressed", config={"max.message.bytes": "16384"})
    out = OutputProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), "test-outputs")
    row = b"node0042|gpu3|gpu.sm_clock|MHz|d465fa88-c663-2a13-b682-b4521eb6456e|no_job;"
    value = (row * (65536 // len(row) + 1))[:65536]
    asyncio.run(out.publish([OutMessage(topic, b"node0042", value, [])]))
    c = Consumer({**kafka_conf, "group.id": f"read-{topic}", "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    got: list[bytes] = []
    try:
        for _ in range(120):
            got += [m.value() or b"" for m in c.consume(10, 0.5) if m.error() is None]
            if got:
                break
    finally:
        c.close()
    assert got == [value]


def test_a_wait_ends_with_its_own_messages_while_another_agent_keeps_sending(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("busy")
    out = OutputProducer(KafkaSettings(bootstrap_servers=kafka_bootstrap), "test-outputs")
    stop = asyncio.Event()

    async def other_agent() -> None:  # never lets the queue run empty
        while not stop.is_set():
            await out.enqueue([OutMessage(topic, b"o", b"z" * 100, []) for _ in range(200)])
            await asyncio.sleep(0)

    async def run() -> float:
        busy = asyncio.create_task(other_agent())
        await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await out.wait([await out.enqueue([OutMessage(topic, b"m", b"mine", [])])])
        took = loop.time() - t0
        stop.set()
        await busy
        return took

    assert asyncio.run(run()) < 5.0
