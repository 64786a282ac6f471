"""Exactly-once landing against a real broker: the landing service runs as a subprocess and is
killed (os._exit(137), as kill -9) at every critical point, over and over, then restarted; the
lake must hold every produced row exactly once (lost 0, duplicated 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from confluent_kafka import Producer

from lab.lake import synth
from schemas.codec import ARROW

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
T0 = 1_704_067_200_000_000_000 + 60 * 10**9


class RefinedStream:
    """Produces refined batches (Arrow IPC of REFINED_SCHEMA) with lineage, and remembers them."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.topic = topic
        self.partitions = partitions
        self.source = synth.refined_samples(nodes=2, seconds=400, start_ns=T0)
        self.cursor = 0
        self.records = 0
        self.rows = 0
        self.raw_offset = [0] * partitions
        self.sent: list[tuple[int, bytes]] = []

    def produce(self, n: int, rows: int = 150) -> None:
        for part, body in self.build(n, rows):
            self._send(part, body)
        self.producer.flush(30)

    def build(self, n: int, rows: int = 150) -> list[tuple[int, bytes]]:
        """The next n records, remembered as sent but not sent: the caller sends them."""
        out = []
        for _ in range(n):
            part = self.records % self.partitions
            t = self.source.slice(self.cursor, rows)
            self.cursor += rows
            n_rows = t.num_rows
            t = t.set_column(
                t.schema.get_field_index("raw_partition"),
                "raw_partition",
                pa.array([part] * n_rows, pa.int32()),
            )
            t = t.set_column(
                t.schema.get_field_index("raw_offset"),
                "raw_offset",
                pa.array([self.raw_offset[part]] * n_rows, pa.int64()),
            )
            self.raw_offset[part] += 1
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, t.schema) as w:
                w.write_table(t)
            body = sink.getvalue().to_pybytes()
            out.append((part, body))
            self.sent.append((part, body))
            self.records += 1
            self.rows += n_rows
        return out

    def replay(self, k: int) -> None:
        """Re-publish the last k records as a refiner replaying after a crash would."""
        for part, body in self.sent[-k:]:
            self._send(part, body)
        self.producer.flush(30)

    def _send(self, part: int, body: bytes) -> None:
        self.producer.produce(
            self.topic, body, key=b"n", partition=part, headers=[("content-type", ARROW)]
        )


def _land(lake: Path, bootstrap: str, topic: str, group: str, crash_at: str | None) -> int:
    args = [
        sys.executable,
        "-m",
        "services.cli",
        "land",
        "--topics",
        f"{topic}=samples",
        "--group",
        group,
        "--instance-id",
        "lander-0",
        "--once-idle",
        "2",
        "--max-age",
        "0.2",
        "--max-rows",
        "300",
        "--no-compact",
    ]
    if crash_at:
        args += ["--crash-at", crash_at]
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_LAKE": str(lake)}
    return subprocess.run(args, cwd=REPO, env=env, timeout=180, capture_output=True).returncode


def _check(lake: Path) -> tuple[int, int, int]:
    glob = f"{lake}/samples/*/*/p*.parquet"
    from services.lake.writer import LakeWriter

    files = [str(p) for p in LakeWriter(lake).live_paths("samples")]
    assert len(files) == len(list(Path(lake).glob("samples/*/*/p*.parquet"))), glob
    row = duckdb.execute(
        "SELECT count(*), count(DISTINCT (raw_partition, raw_offset, node, device, metric, ts)),"
        " count(DISTINCT (raw_partition, raw_offset)) FROM read_parquet(?)",
        [files],
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_kill_at_every_critical_point_loses_and_duplicates_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topic = unique_topic("refined", partitions=2)
    lake = tmp_path / "lake"
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    points = ["before_rename", "after_rename", "after_commit"]
    crashes = 0
    for i in range(21):
        stream.produce(4)
        if i % 5 == 4:
            stream.replay(3)  # refiner replays: same lineage, new Kafka offsets
        point = points[i % 3]
        code = _land(lake, kafka_bootstrap, topic, unique_group, f"{point}@{1 + i % 2}")
        assert code in (0, 137), code
        crashes += code == 137
    assert _land(lake, kafka_bootstrap, topic, unique_group, None) == 0
    rows, distinct_rows, records = _check(lake)
    assert crashes >= 20
    assert rows == stream.rows  # lost 0
    assert distinct_rows == rows  # duplicated 0
    assert records == stream.records


def test_a_record_resent_after_later_ones_still_lands(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """A produce that failed and was sent again arrives after later records of its raw
    partition; it is not a replay and must land (a replay of an earlier one must not)."""
    topic = unique_topic("refined", partitions=1)
    lake = tmp_path / "lake"
    stream = RefinedStream(kafka_bootstrap, topic, partitions=1)
    items = stream.build(6)
    for part, body in [*items[:3], *items[4:], items[3], items[1]]:  # 3 late, 1 twice
        stream._send(part, body)
    stream.producer.flush(30)
    assert _land(lake, kafka_bootstrap, topic, unique_group, None) == 0
    rows, distinct_rows, records = _check(lake)
    assert (rows, distinct_rows, records) == (stream.rows, stream.rows, 6)
