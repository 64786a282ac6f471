"""Exactly-once landing into Iceberg tables against a real broker and a real SQL catalog
(SQLite): the lander, a subprocess, is killed (exit 137 at a seam, or SIGKILL from outside
at a random moment) over and over while landing, then restarted; a stale lander whose
partitions moved commits after the new owner landed them. Every row lands exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
from pydantic import SecretStr

from services.lake.backend import open_writer
from services.lake.iceberg import IcebergSettings
from services.lake.iceberg_sink import IcebergLakeSink
from services.lake.land import LandingService
from tests.integration.test_lake_landing import RefinedStream

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]


def _settings(tmp: Path) -> IcebergSettings:
    url = SecretStr(f"sqlite:///{tmp}/catalog.db")
    return IcebergSettings(lake_format="iceberg", iceberg_catalog=url)


def _sink(tmp: Path, **kw: Any) -> IcebergLakeSink:
    sink = open_writer(tmp / "lake", iceberg=_settings(tmp), **kw)
    assert isinstance(sink, IcebergLakeSink)
    return sink


def _lander(tmp: Path, bootstrap: str, topic: str, group: str, crash_at: str | None) -> list[str]:
    args = [sys.executable, "-m", "services.cli", "land", "--topics", f"{topic}=samples"]
    args += ["--group", group, "--instance-id", "lander-0", "--once-idle", "2"]
    args += ["--max-age", "0.3", "--max-rows", "300", "--format", "iceberg"]
    return args + (["--crash-at", crash_at] if crash_at else [])


def _env(tmp: Path, bootstrap: str) -> dict[str, str]:
    return {
        **os.environ,
        "REFINERY_BOOTSTRAP_SERVERS": bootstrap,
        "REFINERY_LAKE": str(tmp / "lake"),
        "REFINERY_ICEBERG_CATALOG": f"sqlite:///{tmp}/catalog.db",
    }


def _check(sink: IcebergLakeSink) -> tuple[int, int, int]:
    files = sink.live_paths("samples")
    row = duckdb.execute(
        "SELECT count(*), count(DISTINCT (raw_partition, raw_offset, node, device, metric, ts)),"
        " count(DISTINCT (raw_partition, raw_offset)) FROM read_parquet(?)",
        [files],
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_kill_9_while_landing_iceberg_loses_and_duplicates_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    env = _env(tmp_path, kafka_bootstrap)
    points = ["mid_upload", "before_commit", "after_rename", "after_commit"]
    crashes = 0
    for i in range(8):  # at each seam: files half uploaded, uploaded, committed, acknowledged
        stream.produce(6)
        if i % 3 == 2:
            stream.replay(3)  # refiner replays: same lineage, new Kafka offsets
        args = _lander(tmp_path, kafka_bootstrap, topic, unique_group, f"{points[i % 4]}@1")
        code = subprocess.run(args, cwd=REPO, env=env, timeout=120, capture_output=True)
        assert code.returncode in (0, 137), code.stderr.decode()[-2000:]
        crashes += code.returncode == 137
    rng = random.Random(7)
    for _ in range(6):  # SIGKILL from outside, wherever it is
        stream.produce(8)
        args = _lander(tmp_path, kafka_bootstrap, topic, unique_group, None)
        proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 4.5))
        proc.send_signal(signal.SIGKILL)
        crashes += proc.wait(30) == -signal.SIGKILL
    final = _lander(tmp_path, kafka_bootstrap, topic, unique_group, None)
    assert subprocess.run(final, cwd=REPO, env=env, timeout=120).returncode == 0
    rows, distinct_rows, records = _check(_sink(tmp_path))
    assert crashes >= 10
    assert rows == stream.rows  # lost 0
    assert distinct_rows == rows  # duplicated 0
    assert records == stream.records


def test_a_stale_lander_committing_after_its_partitions_moved_duplicates_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """Lander A holds a flush before its commit until it has been thrown out of the group
    (max.poll.interval) and lander B has landed the same records; then A commits."""
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    stream.produce(10)
    held, release = threading.Event(), threading.Event()

    def pause() -> None:
        if not held.is_set():
            held.set()
            assert release.wait(120)

    conf = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": unique_group,
        "session.timeout.ms": 6000,
        "max.poll.interval.ms": 7000,
    }
    a = LandingService(conf, _sink(tmp_path, pause=pause), {topic: "samples"}, max_age_s=0.5)
    errors: list[BaseException] = []

    def run_a() -> None:
        try:
            a.run(once_idle_s=30)
        except BaseException as e:  # its Kafka commit after the move must fail
            errors.append(e)

    ta = threading.Thread(target=run_a)
    ta.start()
    assert held.wait(60)
    b_sink = _sink(tmp_path)
    b = LandingService(conf, b_sink, {topic: "samples"}, max_age_s=0.5)
    b.run(once_idle_s=12)  # A leaves the group after 7 s without a poll; B lands it all
    assert b.stats.rows == stream.rows
    release.set()
    ta.join(120)
    assert a.writer.landed_high_water("samples") == b_sink.landed_high_water("samples")
    assert isinstance(a.writer, IcebergLakeSink)
    assert (a.writer.conflicts, a.writer.commits) == (1, 0)  # lost its race, landed nothing
    assert errors, "A's Kafka commit after its partitions moved must fail"
    rows, distinct_rows, records = _check(b_sink)
    assert (rows, distinct_rows, records) == (stream.rows, stream.rows, stream.records)


def test_compaction_racing_the_lander_then_a_restart_loses_and_duplicates_nothing(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """A compactor rewrites the hour and expires every older snapshot (keep 0 s) in a loop
    while the lander lands into that hour; then the lander is restarted on more records (and
    replays) and resumes from the offsets the compaction snapshots carried forward."""
    from services.lake.iceberg_maint import IcebergMaintenance

    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    env = _env(tmp_path, kafka_bootstrap)
    sink = _sink(tmp_path)
    maint = IcebergMaintenance(sink.catalog, "refinery", keep_s=0.0)
    merged = 0
    for round_ in range(2):
        stream.produce(10)
        if round_:
            stream.replay(3)
        args = _lander(tmp_path, kafka_bootstrap, topic, unique_group, None)
        proc = subprocess.Popen(args, cwd=REPO, env=env, stderr=subprocess.PIPE)
        while proc.poll() is None:
            merged += maint.compact_closed(["samples"], close_after_s=0).merged
            time.sleep(0.2)
        assert proc.returncode == 0, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        rows, distinct_rows, records = _check(sink)
        assert (rows, distinct_rows, records) == (stream.rows, stream.rows, stream.records)
    merged += maint.compact_closed(["samples"], close_after_s=0).merged
    assert merged > 0
    files = sink.live_paths("samples")
    assert len(files) == 2  # one per source partition of the hour
    assert _check(sink) == (stream.rows, stream.rows, stream.records)
    assert sum(sink.landed_high_water("samples").values()) == stream.records + 3 - 2
