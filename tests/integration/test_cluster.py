"""Three-node cluster: acks=all producing survives kill -9 of one broker; it rejoins."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from lab.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    k = LocalKafka(Path(tmp_path_factory.mktemp("kafka3")), heap="384m")
    k.start(nodes=3, base_port=0, timeout=180)
    try:
        yield k
    finally:
        k.stop()


def test_kill_one_of_three_loses_nothing_and_it_rejoins(cluster: LocalKafka) -> None:
    state = cluster.state()
    assert state is not None and len(state.nodes) == 3
    bootstrap = state.bootstrap
    topic = f"test.rf3.{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics(
        [
            NewTopic(
                topic, num_partitions=3, replication_factor=3, config={"min.insync.replicas": "2"}
            )
        ]
    )[topic].result(60)

    acked: set[int] = set()
    failed: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: object) -> None:
        if err is None:
            acked.add(int(msg.value()))  # type: ignore[attr-defined]
        else:
            failed.append(err)

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.timeout.ms": 120_000,
        }
    )
    n = 0

    def produce(count: int) -> None:
        nonlocal n
        for _ in range(count):
            p.produce(topic, str(n).encode(), key=str(n % 7).encode(), on_delivery=on_delivery)
            n += 1
            p.poll(0)
        p.flush(60)

    produce(2000)
    victim = state.nodes[1].node_id
    cluster.kill_node(victim)
    t_kill = time.monotonic()
    produce(3000)  # the cluster keeps serving with two of three (min.insync.replicas 2)
    assert not failed, failed[:3]
    assert len(acked) == n == 5000

    cluster.restart_node(victim, timeout=120)
    rejoin_s = time.monotonic() - t_kill
    produce(1000)
    assert len(acked) == n == 6000

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        m = c.poll(1.0)
        if m is not None and not m.error():
            seen.append(int(m.value()))
    c.close()
    assert sorted(seen) == sorted(acked), "lost or duplicated acknowledged records"

    # it rejoined: back in metadata and in every partition's ISR
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        md = admin.list_topics(topic, timeout=10)
        isr_ok = all(len(pm.isrs) == 3 for pm in md.topics[topic].partitions.values())
        if len(md.brokers) == 3 and isr_ok:
            break
        time.sleep(1)
    assert len(md.brokers) == 3 and isr_ok
    print(f"three-node: victim {victim} killed; rejoined and answering in {rejoin_s:.1f}s")
