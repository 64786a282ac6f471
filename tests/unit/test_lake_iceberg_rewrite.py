"""Compaction of an Iceberg lake (pyiceberg 0.12, a real SQLite catalog, real files): a
closed hour's small files become one file per source partition in one snapshot with the same
rows and the lander's offsets; an append or a second compactor racing the commit loses
nothing; expiry afterwards keeps the offsets and deletes the replaced files; a crash before
the commit leaves the table as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from pydantic import SecretStr

from services.lake.backend import Flush, open_compactor, open_writer
from services.lake.iceberg import (
    COMPACTED_KEY,
    OFFSETS_KEY,
    IcebergSettings,
    expire_snapshots,
    landed_offsets,
)
from services.lake.iceberg_maint import IcebergMaintenance
from services.lake.iceberg_rewrite import IcebergRewriter, source_range
from services.lake.iceberg_sink import IcebergLakeSink
from tests.unit.test_lake_iceberg import _acc
from tests.unit.test_lake_s3_store import _samples

REPO = Path(__file__).resolve().parents[2]
NOW_NS = int(time.time()) * 10**9  # an open hour: never compacted by compact_closed


def _ice(tmp: Path) -> IcebergSettings:
    url = SecretStr(f"sqlite:///{tmp}/catalog.db")
    return IcebergSettings(lake_format="iceberg", iceberg_catalog=url)


def _sink(tmp: Path, **kw: Any) -> IcebergLakeSink:
    sink = open_writer(tmp / "lake", iceberg=_ice(tmp), **kw)
    assert isinstance(sink, IcebergLakeSink)
    return sink


def _maint(tmp: Path) -> IcebergMaintenance:
    c = open_compactor(tmp / "lake", iceberg=_ice(tmp))
    assert isinstance(c, IcebergMaintenance)
    return c


def _content(sink: IcebergLakeSink, dataset: str) -> list[tuple[object, ...]]:
    """Every row of the table, every column, in one order."""
    files = sink.live_paths(dataset)
    return duckdb.execute("SELECT * FROM read_parquet(?) ORDER BY ALL", [files]).fetchall()


def _flush(first: int, partition: int = 0) -> Flush:
    t = _samples(first)  # 3 records of 100 rows, 00:59 to 01:01 of 2024-01-01
    offsets = np.asarray(t.column("raw_offset").to_numpy(), np.int64)
    return Flush(partition, first, first + 2, t, offsets)


def _land_small_files(sink: IcebergLakeSink) -> None:
    for i in range(4):  # two partitions, four flushes each: eight files an hour
        sink.land_flushes("samples", [_flush(3 * i, 0), _flush(3 * i, 1)])
        sink.land_flushes("accounting", [_acc([2 * i, 2 * i + 1])])
    sink.land_flushes("accounting", [_acc([8, 9], ts0=NOW_NS)])  # this hour: left alone


def _hour_files(sink: IcebergLakeSink, dataset: str, hour: str) -> list[str]:
    return [p for p in sink.live_paths(dataset) if f"/hour={hour}/" in p]


def test_a_closed_hour_becomes_one_file_per_partition_in_one_snapshot(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    _land_small_files(sink)
    before = {ds: _content(sink, ds) for ds in ("samples", "accounting")}
    offsets = {ds: sink.landed_high_water(ds) for ds in ("samples", "accounting")}
    snaps = len(sink.table("samples").metadata.snapshots)
    assert len(_hour_files(sink, "samples", "00")) == 8
    report = _maint(tmp_path).compact_closed(["samples", "accounting"])
    assert report.merged == 8 + 8 + 4 and not report.skipped  # samples 00 and 01, accounting
    for ds in ("samples", "accounting"):
        assert _content(sink, ds) == before[ds]  # the same rows, every column
        assert sink.landed_high_water(ds) == offsets[ds]
    table = sink.table("samples")
    table.refresh()
    assert len(table.metadata.snapshots) == snaps + 2  # one per hour
    snap = table.current_snapshot()
    assert snap is not None and snap.summary is not None
    assert snap.summary.additional_properties[COMPACTED_KEY] == "2024-01-01T01"
    assert OFFSETS_KEY in snap.summary.additional_properties
    names = sorted(p.rsplit("/", 1)[1] for p in _hour_files(sink, "samples", "00"))
    assert [source_range(n) for n in names] == [(0, 0, 11), (1, 0, 11)]
    assert len(_hour_files(sink, "accounting", "00")) == 1
    assert any(f"hour={NOW_NS // 3_600_000_000_000 % 24:02d}" in p
               for p in sink.live_paths("accounting"))  # fmt: skip
    again = _maint(tmp_path).compact_closed(["samples", "accounting"])
    assert again.merged == 0 and again.written == []


def test_an_append_racing_the_commit_is_kept_and_the_hour_planned_again(tmp_path: Path) -> None:
    """The rewrite is held before its commit; the lander lands late rows into the same hour
    and rows into another: the commit fails, the hour is read again with the late file, and
    the offsets the lander committed are carried forward."""
    sink = _sink(tmp_path)
    _land_small_files(sink)
    held, go = threading.Event(), threading.Event()

    def pause() -> None:
        if not held.is_set():
            held.set()
            assert go.wait(30)

    rw = IcebergRewriter(sink.catalog, "refinery", pause=pause)
    t = threading.Thread(target=rw.compact_hour, args=("samples", "2024-01-01", "00"))
    t.start()
    assert held.wait(30)
    sink.land_flushes("samples", [_flush(100, 0), _flush(40, 2)])  # late rows, a new partition
    want = _content(sink, "samples")
    go.set()
    t.join(60)
    assert rw.conflicts == 1
    assert _content(sink, "samples") == want
    assert sink.landed_high_water("samples") == {0: 102, 1: 11, 2: 42}
    names = [p.rsplit("/", 1)[1] for p in _hour_files(sink, "samples", "00")]
    assert sorted(source_range(n) for n in names) == [(0, 0, 102), (1, 0, 11), (2, 40, 42)]


def test_of_two_compactors_one_commits_and_the_other_leaves_no_file(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    _land_small_files(sink)
    want = _content(sink, "samples")
    held, go = threading.Event(), threading.Event()

    def pause() -> None:
        held.set()
        assert go.wait(30)

    slow = IcebergRewriter(sink.catalog, "refinery", pause=pause)
    out: list[Any] = []
    t = threading.Thread(
        target=lambda: out.append(slow.compact_hour("samples", "2024-01-01", "00"))
    )
    t.start()
    assert held.wait(30)
    fast = IcebergRewriter(_sink(tmp_path).catalog, "refinery")
    assert fast.compact_hour("samples", "2024-01-01", "00").merged == 8
    go.set()
    t.join(60)
    assert slow.conflicts == 1 and out[0].merged == 0 and out[0].written == []
    assert _content(sink, "samples") == want
    hour_dir = next((tmp_path / "lake").rglob("samples/data/date=2024-01-01/hour=00"))
    on_disk = {p.name for p in hour_dir.glob("*.parquet")}
    live = {p.rsplit("/", 1)[1] for p in _hour_files(sink, "samples", "00")}
    assert len(on_disk) == 8 + 2 and live <= on_disk  # the inputs (until expiry) and fast's


def test_expiry_after_compaction_keeps_the_offsets_and_deletes_replaced_files(
    tmp_path: Path,
) -> None:
    sink = _sink(tmp_path)
    _land_small_files(sink)
    want, offsets = _content(sink, "samples"), sink.landed_high_water("samples")
    _maint(tmp_path).compact_closed(["samples"])
    table = sink.table("samples")
    table.refresh()
    assert expire_snapshots(table, keep_s=0.0) > 0
    table.refresh()
    assert len(table.metadata.snapshots) == 1
    assert landed_offsets(table) == offsets
    assert _content(sink, "samples") == want
    on_disk = {str(p) for p in (tmp_path / "lake").rglob("samples/data/**/*.parquet")}
    assert on_disk == set(sink.live_paths("samples"))  # the eight small files of each hour gone
    sink.land_flushes("samples", [_flush(12, 0)])  # the lander carries on from the offsets
    sink.land_flushes("samples", [_flush(0, 0)])  # a replay of landed offsets: dropped
    assert sink.landed_high_water("samples") == {0: 14, 1: 11}
    assert len(_content(sink, "samples")) == len(want) + 300


@pytest.mark.parametrize("seam", ["rewrite_before_commit"])
def test_a_crash_before_the_commit_leaves_the_table_as_it_was(tmp_path: Path, seam: str) -> None:
    sink = _sink(tmp_path)
    _land_small_files(sink)
    want, files = _content(sink, "samples"), sorted(sink.live_paths("samples"))
    env = {
        **os.environ,
        "REFINERY_LAKE": str(tmp_path / "lake"),
        "REFINERY_LAKE_FORMAT": "iceberg",
        "REFINERY_ICEBERG_CATALOG": f"sqlite:///{tmp_path}/catalog.db",
    }
    args = [sys.executable, "-m", "services.cli", "lake", "compact", "--all-closed"]
    args += ["--dataset", "samples"]
    crashed = subprocess.run([*args, "--crash-at", seam], cwd=REPO, env=env, capture_output=True)
    assert crashed.returncode == 137, crashed.stderr.decode()[-2000:]
    assert sorted(sink.live_paths("samples")) == files
    assert _content(sink, "samples") == want
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"merged": 16' in done.stdout  # eight files of each of two hours
    assert _content(sink, "samples") == want  # the crashed run's orphans are never read
