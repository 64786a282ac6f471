"""A Kafka-level compression bomb: a producer zstd-compresses a 64 MiB message of zeros into a
few KiB, well under the broker's ``max.message.bytes`` (which bounds the *compressed* batch).

What bounds a consumer:
- ``fetch.max.bytes`` / ``max.partition.fetch.bytes`` bound the compressed bytes fetched;
- librdkafka (confluent-kafka: exporters' tools, the lander, alert consumers) refuses to
  decompress a message set beyond ``receive.message.max.bytes`` and reports an error for it,
  so setting that bound (here 8 MiB) caps the memory a bomb can take;
- aiokafka (the Faust worker) has no decompressed-size bound: there the defence is that only
  authenticated principals with Write on the raw topics (deploy/acls.yaml) can produce, and
  the worker's own decode() bounds (MAX_MESSAGE_BYTES) reject the decompressed record.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, Producer

pytestmark = pytest.mark.kafka
BOMB = 64 * 1024 * 1024


def test_librdkafka_consumer_refuses_to_inflate_a_bomb(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("bomb")
    p = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "compression.type": "zstd",
            "message.max.bytes": 100_000_000,  # the producer's own (uncompressed) limit
        }
    )
    acked: list[KafkaError | None] = []
    p.produce(topic, b"\0" * BOMB, on_delivery=lambda err, _m: acked.append(err))
    p.produce(topic, b"after the bomb", on_delivery=lambda err, _m: acked.append(err))
    p.flush(60)
    assert acked == [None, None]  # the broker took it: compressed, it is tiny
    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 4 * 1024 * 1024,
            "receive.message.max.bytes": 8 * 1024 * 1024,
        }
    )
    c.subscribe([topic])
    sizes: list[int] = []
    errors: list[str] = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not errors:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() != KafkaError._PARTITION_EOF:
                    errors.append(str(m.error()))
                continue
            sizes.append(len(m.value() or b""))
    finally:
        c.close()
    print(f"kafka bomb: consumer errors {errors[:1]}, message sizes {sizes}")
    assert BOMB not in sizes, "the consumer inflated the 64 MiB bomb"
    assert errors, "the consumer should report the message it refused to decompress"
