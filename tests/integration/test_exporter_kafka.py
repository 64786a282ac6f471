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
    rows = read_all(kafka_bootstrap, topic, until=1, timeout=30)
    assert len(rows) == 1
    key, value, headers = rows[0]
    assert key == b"roundtrip-node"
    assert content_type_of(headers) == ARROW
    batch = decode(value, ARROW)
    assert batch.envelope.source.node == "roundtrip-node"
    assert batch.envelope.source.exporter == "node"
    assert batch.table.schema.equals(SAMPLES_SCHEMA)
    metrics = set(batch.table.column("metric").to_pylist())
    assert "cpu.user_seconds" in metrics and "mem.available_bytes" in metrics
