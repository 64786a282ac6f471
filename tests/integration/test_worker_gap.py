"""The worker's gap re-fetch (``services.kafka.watch.fetch_range``) against the real broker:
a range is returned whole (offsets deleted by retention count as read) or not at all, so the
worker never declares offsets handled that it did not refine."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from services.kafka.watch import IncompleteFetch, fetch_range

pytestmark = [pytest.mark.kafka]


@pytest.fixture
def topic_with_records(kafka_bootstrap: str) -> tuple[str, str]:
    bootstrap = kafka_bootstrap
    topic = f"gap-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(50):
        p.produce(topic, value=f"v{i}".encode(), partition=0)
    assert p.flush(30) == 0
    return bootstrap, topic


def test_a_range_is_read_whole(topic_with_records: tuple[str, str]) -> None:
    bootstrap, topic = topic_with_records
    got = fetch_range({"bootstrap.servers": bootstrap}, topic, 0, 10, 40)
    assert [m.offset() for m in got] == list(range(10, 40))
    assert got[0].value() == b"v10"


def test_a_range_past_the_end_of_the_log_is_refused_not_returned_in_part(
    topic_with_records: tuple[str, str],
) -> None:
    """Offsets 45..59 of a log of 50: the 5 that exist are not returned as if they were all
    (the worker would commit past 50..59, never refined)."""
    bootstrap, topic = topic_with_records
    t0 = time.monotonic()
    with pytest.raises(IncompleteFetch, match=r"read offsets 45\.\.49 of 45\.\.59"):
        fetch_range({"bootstrap.servers": bootstrap}, topic, 0, 45, 60, timeout_s=3)
    assert time.monotonic() - t0 < 15


def test_offsets_deleted_by_retention_count_as_read(topic_with_records: tuple[str, str]) -> None:
    bootstrap, topic = topic_with_records
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 0, 20)]).values():
        f.result(30)
    got = fetch_range({"bootstrap.servers": bootstrap}, topic, 0, 5, 30)
    assert [m.offset() for m in got] == list(range(20, 30))


def test_a_batch_librdkafka_will_not_inflate_is_handed_over_refused(
    topic_with_records: tuple[str, str],
) -> None:
    """A zstd bomb in the range: librdkafka repeats its error at that offset for good; the
    range still comes back whole, the bomb's offset as a refused record."""
    from services.kafka.internals import REFUSED_HEADER

    bootstrap, topic = topic_with_records
    p = Producer({"bootstrap.servers": bootstrap, "compression.type": "zstd",
                  "message.max.bytes": 100_000_000, "linger.ms": 0})  # fmt: skip
    p.produce(topic, b"\0" * (80 << 20), partition=0)
    p.flush(30)
    p.produce(topic, b"after", partition=0)
    assert p.flush(30) == 0
    got = fetch_range({"bootstrap.servers": bootstrap}, topic, 0, 48, 52, timeout_s=20)
    assert [m.offset() for m in got] == [48, 49, 50, 51]
    bomb = got[2]
    assert bomb.value() == b"" and bomb.headers()[0][0] == REFUSED_HEADER
    assert got[3].value() == b"after"
