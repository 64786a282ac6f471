"""The node exporter's publish path against a real broker: what `refinery export node --once`
publishes is what a consumer decodes, with the broker's arrival time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from schemas.codec import ARROW, content_type_of, decode
from schemas.wire import SAMPLES_SCHEMA
from tests.integration.worker_helpers import read_all

pytestmark = pytest.mark.kafka


def test_export_node_once_round_trip(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("exp", config={"message.timestamp.type": "LogAppendTime"})
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "export",
            "node",
            "--once",
            "--no-gpu",
            "--no-clock",
            "--node",
            "roundtrip-node",
            "--topic",
            topic,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 0, p.stderr
    rows = read_all(kafka_bootstrap, topic, until=2, timeout=30)
    assert len(rows) == 2
    # first a batch with no rows (BatchProducer.greet), then the scrape, which carries the
    # first one's exchange with the broker: this host's clock is the broker's, so the
    # offset 0 is inside it
    hello = decode(rows[0][1], content_type_of(rows[0][2]))
    assert hello.table.num_rows == 0
    key, value, headers = rows[1]
    assert key == b"roundtrip-node"
    assert content_type_of(headers) == ARROW
    batch = decode(value, ARROW)
    assert batch.envelope.seq == hello.envelope.seq + 1
    assert batch.envelope.source == hello.envelope.source
    assert batch.envelope.clock is not None and batch.envelope.clock.exchanges
    for sent, append_ms, ack, _ in batch.envelope.clock.exchanges:
        assert sent - append_ms * 1_000_000 - 1_000_000 <= 0 <= ack - append_ms * 1_000_000
    assert batch.envelope.source.node == "roundtrip-node"
    assert batch.envelope.source.exporter == "node"
    assert batch.table.schema.equals(SAMPLES_SCHEMA)
    metrics = set(batch.table.column("metric").to_pylist())
    assert "cpu.user_seconds" in metrics and "mem.available_bytes" in metrics
