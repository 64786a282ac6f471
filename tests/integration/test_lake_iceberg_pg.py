"""The Iceberg lake on a PostgreSQL catalog: a real server (Debian's binaries, initdb into a
temp directory, one free loopback port), restarted and stopped under a sink that is landing.

The sink lands through pyiceberg's SQL catalog on PostgreSQL and reads back what it landed;
while the database restarts (every connection dropped), or is down when a commit is tried, or
loses the connection after a commit reached it, the sink retries and every row lands once.
Skipped when the PostgreSQL server binaries are not installed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import sqlalchemy
from pydantic import SecretStr

from lab.lake import synth
from lab.postgres import LocalPostgres, PostgresUnavailable
from services.lake import sqlload
from services.lake.backend import Flush, open_writer
from services.lake.datasets import ACCOUNTING_SCHEMA, conform
from services.lake.iceberg import IcebergSettings, SnapshotFiles
from services.lake.iceberg_sink import IcebergLakeSink
from services.lake.store import StoreUnavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    try:
        pg = LocalPostgres.start()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server here: {e}")
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def catalog_url(postgres: LocalPostgres) -> Iterator[str]:
    """A database of its own; the server up again afterwards, whatever the test did."""
    yield postgres.create_database(f"t_{uuid.uuid4().hex[:10]}")
    if not postgres.running():
        postgres.start_server()


def _sink(tmp: Path, url: str, **kw: Any) -> IcebergLakeSink:
    ice = IcebergSettings(lake_format="iceberg", iceberg_catalog=SecretStr(url))
    sink = open_writer(tmp / "lake", iceberg=ice, **kw)
    assert isinstance(sink, IcebergLakeSink)
    return sink


def _acc(offsets: list[int], partition: int = 0) -> Flush:
    """Accounting rows, one per Kafka offset (raw_offset = the offset, for counting)."""
    n = len(offsets)
    cols = {
        "ts": [synth.T0_NS + o * 10**9 for o in offsets],
        "raw_partition": [partition] * n,
        "raw_offset": offsets,
        "input_samples": [1] * n,
        "refined_samples": [1] * n,
        "duplicate_samples": [0] * n,
        "quarantined_samples": [0] * n,
        "outcome": ["refined"] * n,
    }
    t = conform(pa.table(cols), ACCOUNTING_SCHEMA)
    return Flush(partition, offsets[0], offsets[-1], t, np.asarray(offsets, np.int64))


def _rows(sink: IcebergLakeSink) -> list[tuple[int, int]]:
    files = sink.live_paths("accounting")
    rows = duckdb.execute(
        "SELECT raw_partition, raw_offset FROM read_parquet(?) ORDER BY ALL", [files]
    ).fetchall()
    return [(int(a), int(b)) for a, b in rows]


def test_lands_through_a_postgresql_catalog_and_reads_back(
    tmp_path: Path, catalog_url: str
) -> None:
    samples = synth.refined_samples(nodes=2, seconds=30, start_ns=synth.T0_NS)
    sink = _sink(tmp_path, catalog_url)
    sink.ensure_seeds()
    synth.land_lake(sink, samples, chunk_rows=2_000, partitions=2)
    assert sink.landed_high_water("samples") == {0: 5, 1: 5}
    # a second process (fresh catalog, fresh engine) reads it back through the views
    reader = _sink(tmp_path, catalog_url)
    con = sqlload.connect(
        tmp_path / "lake", iceberg=SnapshotFiles(reader.catalog, "refinery", reader.seed_path)
    )
    row = con.execute("SELECT count(*), count(DISTINCT (node, device, metric, ts)) FROM samples")
    assert row.fetchall() == [(samples.num_rows, samples.num_rows)]
    assert sqlload.run_query(con, "job_busbw").fetchall()  # collectives landed too
    engine = sqlalchemy.create_engine(catalog_url)
    with engine.connect() as db:
        tables = db.execute(
            sqlalchemy.text("SELECT table_name FROM iceberg_tables WHERE catalog_name = 'refinery'")
        ).scalars()
        assert {"samples", "collectives", "topology", "accounting"} <= set(tables)
    engine.dispose()


def test_the_catalog_restarting_while_landing_loses_and_duplicates_nothing(
    tmp_path: Path, catalog_url: str, postgres: LocalPostgres
) -> None:
    """One thread lands 80 flushes of two partitions; meanwhile the server restarts three
    times and is down for two seconds once. No flush is lost or landed twice."""
    sink = _sink(tmp_path, catalog_url)
    errors: list[BaseException] = []
    done = threading.Event()

    def land() -> None:
        try:
            for i in range(80):
                first = 10 * i
                offsets = list(range(first, first + 10))
                sink.land_flushes("accounting", [_acc(offsets, 0), _acc(offsets[:5], 1)])
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=land)
    t.start()
    outages = 0
    for pause in (0.7, 1.0, 1.3):
        time.sleep(pause)
        if done.is_set():
            break
        postgres.restart()
        outages += 1
    if not done.is_set():
        postgres.stop_server()
        time.sleep(2.0)
        postgres.start_server()
        outages += 1
    t.join(180)
    assert not errors, errors
    assert outages >= 3, "landing finished before the database went away: make it longer"
    assert sink.reconnects >= 1
    want = sorted(
        [(0, o) for o in range(800)] + [(1, 10 * i + k) for i in range(80) for k in range(5)]
    )
    assert _rows(sink) == want
    assert sink.landed_high_water("accounting") == {0: 799, 1: 794}


def test_a_commit_tried_while_the_catalog_is_down_waits_and_lands_once(
    tmp_path: Path, catalog_url: str, postgres: LocalPostgres
) -> None:
    calls: list[int] = []
    restart = threading.Timer(2.0, postgres.start_server)

    def pause() -> None:  # before each commit attempt: the first finds the server stopped
        calls.append(1)
        if len(calls) == 1:
            postgres.stop_server()
            restart.start()

    sink = _sink(tmp_path, catalog_url, pause=pause)
    try:
        sink.land_flushes("accounting", [_acc(list(range(5)))])
    finally:
        if restart.ident is not None:  # started
            restart.join(30)
    sink.land_flushes("accounting", [_acc(list(range(5, 20)))])
    assert len(calls) == 3 and sink.reconnects >= 1 and sink.commits == 2
    assert _rows(sink) == [(0, o) for o in range(20)]


def test_a_commit_whose_acknowledgement_is_lost_is_not_landed_twice(
    tmp_path: Path, catalog_url: str
) -> None:
    """The connection breaks after the database committed, before the client heard: the
    sink cannot know it landed, re-reads the offsets, finds them and commits nothing more."""
    sink = _sink(tmp_path, catalog_url)
    sink.land_flushes("accounting", [_acc([0, 1])])
    broken: list[int] = []

    def commit_then_break(conn: sqlalchemy.Connection) -> None:
        if not broken:
            broken.append(1)
            conn.connection.dbapi_connection.commit()  # type: ignore[union-attr]
            raise sqlalchemy.exc.OperationalError("COMMIT", {}, Exception("connection lost"))

    sqlalchemy.event.listen(sink.catalog.engine, "commit", commit_then_break)
    try:
        assert sink.land_flushes("accounting", [_acc(list(range(2, 30)))]) == []
    finally:
        sqlalchemy.event.remove(sink.catalog.engine, "commit", commit_then_break)
    assert broken and sink.reconnects == 1 and sink.commits == 1
    assert _rows(sink) == [(0, o) for o in range(30)]
    assert len(sink.table("accounting").metadata.snapshots) == 2


def test_the_catalog_down_past_reconnect_s_raises_and_a_restart_lands_once(
    tmp_path: Path, catalog_url: str, postgres: LocalPostgres
) -> None:
    """Down longer than the sink waits: StoreUnavailable (the lander exits for its
    supervisor); the restarted lander lands the same flush once."""
    sink = _sink(tmp_path, catalog_url, reconnect_s=1.0)
    sink.land_flushes("accounting", [_acc(list(range(10)))])
    postgres.stop_server()
    try:
        with pytest.raises(StoreUnavailable):
            sink.land_flushes("accounting", [_acc(list(range(5, 25)))])
    finally:
        postgres.start_server()
    again = _sink(tmp_path, catalog_url)
    again.land_flushes("accounting", [_acc(list(range(5, 25)))])
    assert _rows(again) == [(0, o) for o in range(25)]
