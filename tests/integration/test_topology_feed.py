"""The worker's topology feed against a real broker: it catches up, follows changes, and a
record republished unchanged does not bump the version (which would make every worker
rebuild its join index and re-resolve every device)."""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Producer

from schemas.records import EntityKind, TopologyEntity
from services.kafka.feed import TopologyFeed


def _publish(conf: dict[str, object], topic: str, entities: list[TopologyEntity]) -> None:
    p = Producer(dict(conf))
    for e in entities:
        p.produce(topic, key=e.id.encode(), value=e.model_dump_json().encode())
    assert p.flush(30) == 0


def _nodes(n: int, racks: int = 7) -> list[TopologyEntity]:
    return [
        TopologyEntity(id=f"n{i}", kind=EntityKind.NODE, node=f"n{i}", rack=f"r{i % racks}")
        for i in range(n)
    ]


def _feed_over(
    conf: dict[str, object], topo: str, jobs: str, ents: list[TopologyEntity]
) -> TopologyFeed:
    """A feed (not started) over ``ents`` published to ``topo``."""
    _publish(conf, topo, ents)
    return TopologyFeed(dict(conf), topo, jobs)


def _wait(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_feed_versions_only_on_change(
    kafka_conf: dict[str, object], unique_topic: Callable[..., str]
) -> None:
    topo = unique_topic("topology")
    ents = _nodes(5, racks=2)
    feed = _feed_over(kafka_conf, topo, unique_topic("jobs"), ents)
    feed.start()
    try:
        assert feed.wait_caught_up(30)
        assert feed.error is None
        v0, got, _ = feed.snapshot()
        assert sorted(e.id for e in got) == [e.id for e in ents]
        assert v0 >= 1

        _publish(kafka_conf, topo, ents)  # the same facts again
        _wait(lambda: feed.stats["records"] >= 10)
        assert feed.version == v0

        moved = ents[0].model_copy(update={"rack": "r9"})
        _publish(kafka_conf, topo, [moved])
        _wait(lambda: feed.version > v0)
        _, got, _ = feed.snapshot()
        assert {e.id: e.rack for e in got}["n0"] == "r9"
    finally:
        feed.stop()


def test_first_load_moves_the_version_once(
    kafka_conf: dict[str, object], unique_topic: Callable[..., str]
) -> None:
    """A topology larger than one read (500 records) is loaded whole before the version
    moves: a reader never rebuilds its join index for a half-loaded view."""
    feed = _feed_over(kafka_conf, unique_topic("topology"), unique_topic("jobs"), _nodes(3000))
    seen: dict[int, int] = {}  # version -> entities in its snapshot
    feed.start()
    try:
        while not feed.wait_caught_up(0.001):
            version, got, _ = feed.snapshot()
            seen.setdefault(version, len(got))
        assert feed.error is None
        version, got, _ = feed.snapshot()
        seen.setdefault(version, len(got))
        assert version == 1
        assert seen[1] == 3000
        assert set(seen) <= {0, 1}
    finally:
        feed.stop()
