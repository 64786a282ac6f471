"""Against a real broker: librdkafka and aiokafka interoperate; topics apply idempotently."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from schemas.codec import ARROW, content_type_of, decode
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from services.kafka.producer import BatchProducer
from services.settings import KafkaSettings
from services.topics import apply_topics, load_topic_specs

pytestmark = pytest.mark.kafka


def _batch(seq: int, n: int = 100) -> tuple[Envelope, pa.Table]:
    env = Envelope(
        source=SourceId(node="n1", exporter="t", instance="0", boot_id="b"), seq=seq, sent_ns=seq
    )
    t = pa.table(
        {
            "ts_ns": list(range(n)),
            "metric": ["cpu.user_seconds"] * n,
            "device": [f"cpu{i}" for i in range(n)],
            "value": [float(i) for i in range(n)],
            "raw": pa.array(range(n), pa.uint64()),
            "text": pa.nulls(n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return env, t


def test_confluent_produces_aiokafka_consumes(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    from aiokafka import AIOKafkaConsumer

    topic = unique_topic("interop", partitions=2)
    acked: list[str] = []
    p = BatchProducer(
        KafkaSettings(bootstrap_servers=kafka_bootstrap),
        topic=topic,
        on_delivery=lambda tag, err, part, off: acked.append(tag) if err is None else None,
    )
    for seq in range(20):
        p.send(*_batch(seq))
    assert p.close(30) == 0
    assert len(acked) == 20

    async def consume() -> list[tuple[int, str | None, pa.Table]]:
        c = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_bootstrap,
            auto_offset_reset="earliest",
            group_id=f"g-{uuid.uuid4().hex[:8]}",
        )
        await c.start()
        out = []
        try:
            while len(out) < 20:
                batch = await c.getmany(timeout_ms=5000)
                if not batch:
                    break
                for msgs in batch.values():
                    for m in msgs:
                        b = decode(m.value, content_type_of(m.headers))
                        out.append((b.envelope.seq, content_type_of(m.headers), b.table))
        finally:
            await c.stop()
        return out

    got = asyncio.run(consume())
    assert sorted(s for s, _, _ in got) == list(range(20))
    assert all(ct == ARROW for _, ct, _ in got)
    assert all(t.equals(_batch(0)[1]) for _, _, t in got)


def test_topics_apply_is_idempotent(kafka_bootstrap: str) -> None:
    prefix = f"test{uuid.uuid4().hex[:6]}."
    specs = load_topic_specs(prefix=prefix)
    conf = {"bootstrap.servers": kafka_bootstrap}
    first = apply_topics(conf, specs)
    assert {c.topic for c in first if c.action == "create"} == {s.name for s in specs}
    assert apply_topics(conf, specs) == []
    # the raw topic carries broker arrival time
    from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

    res = ConfigResource("topic", prefix + "telemetry.raw")
    admin = AdminClient(conf)
    cfg = admin.describe_configs([res])[res].result()
    assert cfg["message.timestamp.type"].value == "LogAppendTime"


def test_watermarks_of_a_topic_created_a_moment_ago(kafka_bootstrap: str) -> None:
    """Asked right after the create returns, before leaders may be elected: every
    partition answers (0, 0) and unknown topics still fail."""
    from confluent_kafka import KafkaException

    from services.topics import watermarks

    prefix = f"test{uuid.uuid4().hex[:6]}."
    specs = [s for s in load_topic_specs(prefix=prefix) if s.name.endswith("telemetry.raw")]
    conf = {"bootstrap.servers": kafka_bootstrap}
    apply_topics(conf, specs)
    marks = watermarks(conf, specs[0].name)
    assert marks == {p: (0, 0) for p in range(specs[0].partitions)}
    with pytest.raises(KafkaException):
        watermarks({**conf, "allow.auto.create.topics": False}, prefix + "absent", deadline_s=3)


def test_log_append_time_is_broker_time(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    import time

    from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer

    topic = unique_topic("lat", config={"message.timestamp.type": "LogAppendTime"})
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    before = time.time_ns() // 1_000_000
    p.produce(topic, b"x", timestamp=1_000)  # a producer clock far in the past
    p.flush(10)
    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topic])
    m = None
    for _ in range(30):
        m = c.poll(1.0)
        if m is not None and not m.error():
            break
    c.close()
    assert m is not None
    ts_type, ts = m.timestamp()
    assert ts_type == TIMESTAMP_LOG_APPEND_TIME
    assert ts >= before - 1000
