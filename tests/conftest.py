"""Shared fixtures: one real Kafka broker per test session, unique topics and groups per test.

If ``REFINERY_TEST_BOOTSTRAP`` is set (``.ci/run`` sets it), tests use that broker; otherwise
the session starts a single-node broker of its own with :class:`lab.broker.LocalKafka`
on free loopback ports and stops it at the end.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
REAL_DATA = FIXTURES / "real-data"


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of a real broker ("127.0.0.1:PORT")."""
    given = os.environ.get("REFINERY_TEST_BOOTSTRAP")
    if given:
        yield given
        return
    from lab.broker import LocalKafka

    k = LocalKafka(tmp_path_factory.mktemp("kafka"))
    state = k.start(nodes=1, base_port=0)
    try:
        yield state.bootstrap
    finally:
        k.stop()


@pytest.fixture
def kafka_conf(kafka_bootstrap: str) -> dict[str, object]:
    return {"bootstrap.servers": kafka_bootstrap}


@pytest.fixture
def unique_topic(kafka_bootstrap: str) -> Callable[..., str]:
    """Factory: ``unique_topic("raw", partitions=2, config={...})`` creates a fresh topic."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def make(prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"test.{prefix}.{uuid.uuid4().hex[:10]}"
        fut = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})]
        )[name]
        fut.result(30)
        return name

    return make


@pytest.fixture
def unique_group() -> str:
    return f"test-group-{uuid.uuid4().hex[:10]}"
