"""CommitWatch against a real broker: a partition's stall grows only while input waits there
and its committed offset stands still; a commit or an empty backlog resets it; the watch
reports the longest stall, so one stuck partition shows while another makes progress."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, Producer, TopicPartition

from services.kafka.watch import CommitWatch


def test_stall_grows_while_input_waits_and_resets_on_commit(
    kafka_conf: dict[str, object], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("watch", partitions=2)
    group = f"watch-{uuid.uuid4().hex[:8]}"
    watch = CommitWatch(dict(kafka_conf), group)
    try:
        assert watch.check([(topic, 0), (topic, 1)]) == 0.0  # nothing waits
        p = Producer(dict(kafka_conf))
        for i in range(10):
            p.produce(topic, value=b"x", partition=i % 2)
        assert p.flush(30) == 0
        first = watch.check([(topic, 0), (topic, 1)])
        time.sleep(1.2)
        second = watch.check([(topic, 0), (topic, 1)])
        assert watch.lag == 10
        assert second >= first + 1.0
        # every partition stalled that long, not only the worst: each is read again
        assert sorted(watch.stalled(1.0)) == [(topic, 0), (topic, 1)]
        assert watch.stalled(second + 5) == []

        c = Consumer({**kafka_conf, "group.id": group, "enable.auto.commit": False})
        c.commit(offsets=[TopicPartition(topic, 0, 5)], asynchronous=False)
        # partition 0 moved, partition 1 still waits with its offset unchanged: still stalled
        assert watch.check([(topic, 0), (topic, 1)]) >= second
        assert watch.lag == 5
        assert watch.stalled_partition == (topic, 1)
        c.commit(offsets=[TopicPartition(topic, 1, 5)], asynchronous=False)
        c.close()
        time.sleep(0.5)
        assert watch.check([(topic, 0), (topic, 1)]) == 0.0
        assert watch.lag == 0
        watch.restart()
        assert watch.check([]) == 0.0
    finally:
        watch.close()


def test_fetch_range_reads_exactly_the_missing_offsets(
    kafka_conf: dict[str, object], unique_topic: Callable[..., str]
) -> None:
    from services.kafka.watch import fetch_range

    topic = unique_topic("gap")
    p = Producer(dict(kafka_conf))
    for i in range(6):
        p.produce(topic, value=f"r{i}".encode(), key=b"k", headers=[("content-type", b"x")])
    assert p.flush(30) == 0
    got = fetch_range(dict(kafka_conf), topic, 0, 2, 5)
    assert [m.offset() for m in got] == [2, 3, 4]
    assert [m.value() for m in got] == [b"r2", b"r3", b"r4"]


def test_start_offsets_are_the_committed_offset_or_the_log_start(
    kafka_conf: dict[str, object], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("start", partitions=2)
    p = Producer(dict(kafka_conf))
    for i in range(8):
        p.produce(topic, value=b"x", partition=i % 2)
    assert p.flush(30) == 0
    group = f"start-{uuid.uuid4().hex[:8]}"
    parts = [(topic, 0), (topic, 1)]
    watch = CommitWatch(dict(kafka_conf), group)
    try:
        assert watch.start_offsets(parts) == {(topic, 0): 0, (topic, 1): 0}
        c = Consumer({**kafka_conf, "group.id": group, "enable.auto.commit": False})
        c.commit(offsets=[TopicPartition(topic, 1, 3)], asynchronous=False)
        c.close()
        assert watch.start_offsets(parts) == {(topic, 0): 0, (topic, 1): 3}
    finally:
        watch.close()
