"""Landing core on real files and real DuckDB: layout, durability protocol, high-water marks,
temp-file invisibility, multi-hour flush recovery and schema evolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.records import REFINED_SCHEMA
from services.lake import synth
from services.lake.layout import HOUR_NS
from services.lake.writer import LakeWriter

T0 = 1_704_067_200_000_000_000  # 2024-01-01T00:00:00Z


def _samples(n_seconds: int = 10, start: int = T0 + 60 * 10**9) -> pa.Table:
    return synth.refined_samples(nodes=1, seconds=n_seconds, start_ns=start)


def _count(glob: str) -> int:
    row = duckdb.execute(f"SELECT count(*) FROM read_parquet('{glob}')").fetchone()
    assert row is not None
    return int(row[0])


def test_land_writes_hive_layout_sorted_zstd_and_high_water(tmp_path: Path) -> None:
    w = LakeWriter(tmp_path)
    t = _samples(start=T0 + 3600 * 10**9 + 10**9)  # well inside hour 01
    files = w.land("samples", t, partition=3, first=100, last=199)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "samples/date=2024-01-01/hour=01/p3-100-199.parquet"
    ]
    back = pq.read_table(files[0])
    assert back.num_rows == t.num_rows
    keys = back.select(["node", "metric", "ts", "device"]).to_pylist()
    assert keys == sorted(keys, key=lambda r: (r["node"], r["metric"], r["ts"], r["device"]))
    md = pq.ParquetFile(files[0]).metadata
    assert md.row_group(0).column(0).compression == "ZSTD"
    w.land("samples", t.slice(0, 5), partition=3, first=200, last=250)
    w.land("samples", t.slice(0, 5), partition=1, first=7, last=7)
    assert w.landed_high_water("samples") == {1: 7, 3: 250}
    assert w.landed_high_water("events") == {}
    assert w.land("samples", t.slice(0, 0), partition=3, first=251, last=260) == []


def test_table_spanning_hours_splits_into_unique_files_atomically(tmp_path: Path) -> None:
    w = LakeWriter(tmp_path)
    t = _samples(n_seconds=20, start=T0 + HOUR_NS - 10 * 10**9)  # 23:59:50 .. 00:00:10
    files = w.land("samples", t, partition=0, first=5, last=9)
    rel = sorted(f.relative_to(tmp_path).as_posix() for f in files)
    assert rel == [
        "samples/date=2024-01-01/hour=00/p0-5-9.parquet",
        "samples/date=2024-01-01/hour=01/p0-5-9.parquet",
    ]
    assert _count(f"{tmp_path}/samples/**/*.parquet") == t.num_rows
    assert w.landed_high_water("samples") == {0: 9}
    assert not (tmp_path / ".landing" / "samples").exists() or not any(
        (tmp_path / ".landing" / "samples").iterdir()
    )


def _land_in_child(root: Path, crash_at: str, start: int) -> int:
    code = (
        "import sys; from services.lake import synth; from services.lake.writer import LakeWriter\n"
        f"t = synth.refined_samples(nodes=1, seconds=20, start_ns={start})\n"
        f"LakeWriter({str(root)!r}, crash_at={crash_at!r}).land('samples', t, partition=0,"
        " first=5, last=9)\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode


@pytest.mark.parametrize("crash_at", ["before_rename", "mid_rename"])
def test_crash_in_multi_hour_flush_recovers_all_or_nothing(tmp_path: Path, crash_at: str) -> None:
    start = T0 + HOUR_NS - 10 * 10**9
    assert _land_in_child(tmp_path, crash_at, start) == 137
    w = LakeWriter(tmp_path)
    w.recover("samples")
    total = synth.refined_samples(nodes=1, seconds=20, start_ns=start).num_rows
    # the manifest was durable before the first rename: recovery rolls the flush forward
    assert _count(f"{tmp_path}/samples/**/*.parquet") == total
    assert w.landed_high_water("samples") == {0: 9}
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".partial")]
    assert leftovers == []


def test_crash_before_rename_of_single_file_leaves_nothing_visible(tmp_path: Path) -> None:
    start = T0 + 60 * 10**9
    assert _land_in_child(tmp_path, "before_rename", start) == 137
    partial = list(tmp_path.rglob(".land-*.parquet.partial"))
    assert len(partial) == 1  # durable temp left by the crash ...
    seed_rows = _count(f"{tmp_path}/samples/**/*.parquet")
    assert seed_rows == 0  # ... which DuckDB's glob does not match (only the empty seed does)
    w = LakeWriter(tmp_path)
    assert w.landed_high_water("samples") == {}
    assert w.recover("samples", {0}) == 1
    assert list(tmp_path.rglob("*.partial")) == []


def test_duckdb_glob_matches_dot_files_so_temps_must_not_end_in_parquet(tmp_path: Path) -> None:
    """Why temp names end in .partial: DuckDB's ** glob does match hidden *.parquet files."""
    d = tmp_path / "samples" / "date=2024-01-01" / "hour=00"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"a": [1]}), d / ".tmp-p0-0-0.parquet")
    pq.write_table(pa.table({"a": [1]}), d / ".land-p0-1-1.parquet.partial")
    assert _count(f"{tmp_path}/samples/**/*.parquet") == 1
    (d / ".tmp-p0-0-0.parquet").unlink()
    with pytest.raises(duckdb.IOException):
        _count(f"{tmp_path}/samples/**/*.parquet")  # the .partial file is never matched


def test_schema_evolution_old_files_read_new_columns_as_null(tmp_path: Path) -> None:
    from services.lake import sqlload

    w = LakeWriter(tmp_path)
    w.ensure_seeds()
    t = _samples()
    d = tmp_path / "samples" / "date=2024-01-01" / "hour=00"
    old = t.drop_columns(["nvlink_domain", "enrich_reason"])  # a file from before they existed
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(old, d / "p0-0-0.parquet")
    w.land("samples", t, partition=0, first=1, last=1)
    con = sqlload.connect(tmp_path)
    rows = con.execute(
        "SELECT count(*), count(nvlink_domain IS NULL OR NULL), count(DISTINCT node) FROM samples"
    ).fetchone()
    assert rows == (2 * t.num_rows, 2 * t.num_rows, 1)
    n_old = con.execute(
        "SELECT count(*) FROM samples WHERE enrich_reason IS NULL AND raw_offset >= 0"
    ).fetchone()
    assert n_old == (2 * t.num_rows,)
    cols = [r[0] for r in con.execute("DESCRIBE samples").fetchall()]
    assert set(REFINED_SCHEMA.names) <= set(cols)
