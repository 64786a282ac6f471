"""The Iceberg lake without Kafka: a real pyiceberg SQL catalog (SQLite) and real files.

Landing commits one append per flush with the offsets in its summary; a stale (zombie) sink
and a sink that loses a commit race land only what is not in the table yet; expiry keeps the
snapshot that carries the offsets; every named query answers over the Iceberg tables exactly
what it answers over the Parquet lake holding the same rows.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
from pydantic import SecretStr

from lab.lake import synth
from services.lake import sqlload
from services.lake.backend import BatchLakeSink, Flush, open_writer
from services.lake.datasets import ACCOUNTING_SCHEMA, conform
from services.lake.iceberg import (
    OFFSETS_KEY,
    IcebergSettings,
    SnapshotFiles,
    expire_snapshots,
    landed_offsets,
)
from services.lake.iceberg_sink import IcebergLakeSink
from services.lake.writer import LakeWriter

HOUR = 3_600 * 10**9


def _sink(tmp: Path, **kw: Any) -> IcebergLakeSink:
    url = SecretStr(f"sqlite:///{tmp}/catalog.db")
    ice = IcebergSettings(lake_format="iceberg", iceberg_catalog=url)
    sink = open_writer(tmp / "lake", iceberg=ice, **kw)
    assert isinstance(sink, IcebergLakeSink) and isinstance(sink, BatchLakeSink)
    return sink


def _acc(offsets: list[int], partition: int = 0, ts0: int = 0) -> Flush:
    """Accounting rows, one per Kafka offset (raw_offset = the offset, for counting)."""
    n = len(offsets)
    t = conform(
        pa.table(
            {
                "ts": [ts0 + i * 10**9 for i in range(n)],
                "raw_partition": [partition] * n,
                "raw_offset": offsets,
                "input_samples": [1] * n,
                "refined_samples": [1] * n,
                "duplicate_samples": [0] * n,
                "quarantined_samples": [0] * n,
                "outcome": ["refined"] * n,
            }
        ),
        ACCOUNTING_SCHEMA,
    )
    return Flush(partition, offsets[0], offsets[-1], t, np.asarray(offsets, np.int64))


def _rows(sink: IcebergLakeSink) -> list[tuple[int, int]]:
    files = sink.live_paths("accounting")
    rows = duckdb.execute(
        "SELECT raw_partition, raw_offset FROM read_parquet(?) ORDER BY ALL", [files]
    ).fetchall()
    return [(int(a), int(b)) for a, b in rows]


def test_one_append_per_flush_carries_every_partitions_offsets(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    files = sink.land_flushes(
        "accounting", [_acc(list(range(10)), 0, ts0=HOUR - 5 * 10**9), _acc([3, 4], 1)]
    )
    assert len(files) == 3  # partition 0 spans two hours: one file each
    table = sink.table("accounting")
    assert len(table.metadata.snapshots) == 1
    snap = table.current_snapshot()
    assert snap is not None and snap.summary is not None
    summary = snap.summary.additional_properties
    assert json.loads(summary[OFFSETS_KEY]) == {"0": 9, "1": 4}
    sink.land_flushes("accounting", [_acc([5, 6], 1)])  # merged with what the table held
    assert sink.landed_high_water("accounting") == {0: 9, 1: 6}
    assert sink.table("accounting").properties["commit.retry.num-retries"] == "0"
    names = sorted(f.rsplit("/", 1)[1][:6] for f in sink.live_paths("accounting", 1))
    assert names == ["p1-3-4", "p1-5-6"]
    assert len(_rows(sink)) == 14


def test_a_zombie_lands_only_offsets_nobody_landed(tmp_path: Path) -> None:
    """The partition moved to ``owner``, which landed 0..150; the stale lander then commits
    0..200 it still held: 151..200 land once, nothing twice."""
    owner, zombie = _sink(tmp_path), _sink(tmp_path)
    owner.land_flushes("accounting", [_acc(list(range(151)))])
    zombie.land_flushes("accounting", [_acc(list(range(201)))])
    owner.land_flushes("accounting", [_acc(list(range(151, 260)))])  # it consumed on
    rows = _rows(owner)
    assert rows == [(0, o) for o in range(260)]
    assert owner.landed_high_water("accounting") == {0: 259}


def test_a_commit_lost_to_a_race_is_filtered_and_retried(tmp_path: Path) -> None:
    """The stale lander is held after writing its files, before its commit; the owner commits
    meanwhile. Its commit fails (retries off), it re-reads the offsets, drops what the owner
    landed and commits the rest."""
    owner = _sink(tmp_path)
    owner.land_flushes("accounting", [_acc([0, 1])])
    held, go = threading.Event(), threading.Event()
    calls = []

    def pause() -> None:
        calls.append(1)
        if len(calls) == 1:
            held.set()
            assert go.wait(30)

    zombie = _sink(tmp_path, pause=pause)
    t = threading.Thread(
        target=zombie.land_flushes, args=("accounting", [_acc(list(range(2, 40)))])
    )
    t.start()
    assert held.wait(30)
    owner.land_flushes("accounting", [_acc(list(range(2, 25))), _acc([7], partition=1)])
    go.set()
    t.join(30)
    assert zombie.conflicts == 1 and zombie.commits == 1
    assert _rows(owner) == sorted([(0, o) for o in range(40)] + [(1, 7)])
    assert owner.landed_high_water("accounting") == {0: 39, 1: 7}


def test_expiry_keeps_the_snapshot_that_holds_the_offsets(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    for i in range(5):
        sink.land_flushes("accounting", [_acc([2 * i, 2 * i + 1])])
    table = sink.table("accounting")
    # another writer (a Spark job, say) appends without offsets on top
    other = _acc([100], partition=3).table
    assert other is not None
    from services.lake.iceberg import table_schema, with_hour_columns

    table.append(with_hour_columns(other, table_schema("accounting"), "1970-01-01", "00"))
    assert len(table.metadata.snapshots) == 6
    gone = expire_snapshots(table, keep_s=0.0)
    table.refresh()
    assert gone == 4 and len(table.metadata.snapshots) == 2
    assert landed_offsets(table) == {0: 9}
    assert len(_rows(sink)) == 11


def _norm(rows: list[tuple[object, ...]]) -> list[str]:
    """Rows as sortable text, floats to 9 significant digits (sums add in file order)."""
    return sorted(
        repr(tuple(float(f"{v:.9g}") if isinstance(v, float) else v for v in r)) for r in rows
    )


def test_named_queries_answer_the_same_over_iceberg_as_over_parquet(tmp_path: Path) -> None:
    samples = synth.refined_samples(nodes=2, seconds=90, start_ns=synth.T0_NS)
    parquet = LakeWriter(tmp_path / "parquet")
    parquet.ensure_seeds()
    synth.land_lake(parquet, samples, chunk_rows=4_000, partitions=2)
    sink = _sink(tmp_path)
    sink.ensure_seeds()
    synth.land_lake(sink, samples, chunk_rows=4_000, partitions=2)
    files = SnapshotFiles(sink.catalog, "refinery", sink.seed_path)
    ice = sqlload.connect(tmp_path / "lake", iceberg=files)
    plain = sqlload.connect(tmp_path / "parquet")
    count = (
        "SELECT count(*), count(DISTINCT (node, metric, device, ts, value)), min(hour) FROM samples"
    )
    assert ice.execute(count).fetchall() == plain.execute(count).fetchall()
    assert ice.execute(count).fetchall()[0][0] == samples.num_rows
    checked = 0
    for name in sqlload.list_queries():
        got = sqlload.run_query(ice, name).fetchall()
        want = sqlload.run_query(plain, name).fetchall()
        assert _norm(got) == _norm(want), name
        checked += bool(want)
    assert checked >= 3  # queries that found rows to answer with
    # the DuckDB CLI script reads the same
    script = sqlload.iceberg_init_sql(str(tmp_path / "lake"), files)
    cli = duckdb.connect()
    for stmt in script.split(";\n"):
        if stmt.strip():
            cli.execute(stmt)
    assert cli.execute(count).fetchall() == plain.execute(count).fetchall()


def test_fresh_rows_are_seen_at_the_next_refresh(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    sink.ensure_seeds()
    con = sqlload.connect(
        tmp_path / "lake", iceberg=SnapshotFiles(sink.catalog, "refinery", sink.seed_path)
    )
    assert con.execute("SELECT count(*) FROM refine_accounting").fetchall() == [(0,)]
    sink.land_flushes("accounting", [_acc([0, 1, 2])])
    sqlload.refresh(con)
    assert con.execute("SELECT count(*) FROM refine_accounting").fetchall() == [(3,)]


def _open_and_seed(url: str, lake: str, ready: Any, failed: Any) -> None:
    from services.lake.backend import open_writer as _open_writer
    from services.lake.iceberg import IcebergSettings as _Settings

    ice = _Settings(lake_format="iceberg", iceberg_catalog=SecretStr(url))
    ready.wait()  # everyone imported: open at once
    try:
        _open_writer(lake, iceberg=ice).ensure_seeds()
    except Exception as e:
        failed.put(f"{type(e).__name__}: {e}")


def test_landers_starting_together_on_a_new_catalog_all_open_it(tmp_path: Path) -> None:
    """Each creates the catalog's tables, the namespace and the datasets' tables when absent:
    the ones that lose each race find them made and go on."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for i in range(2):  # a race is likely, not certain, in one round
        url, lake = f"sqlite:///{tmp_path / f'cat{i}.db'}", str(tmp_path / f"lake{i}")
        ready, failed = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_and_seed, args=(url, lake, ready, failed))
                 for _ in range(4)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        errors = [failed.get() for _ in range(failed.qsize())]
        assert errors == [] and [p.exitcode for p in procs] == [0, 0, 0, 0]
