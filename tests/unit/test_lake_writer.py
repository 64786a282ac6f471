"""Landing core on real files and real DuckDB: layout, durability protocol, high-water marks,
temp-file invisibility, multi-hour flush recovery and schema evolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from lab.lake import synth
from schemas.records import REFINED_SCHEMA
from services.lake.layout import HOUR_NS
from services.lake.writer import LakeWriter, encode_strings, sort_table

T0 = 1_704_067_200_000_000_000  # 2024-01-01T00:00:00Z


def _samples(n_seconds: int = 10, start: int = T0 + 60 * 10**9) -> pa.Table:
    return synth.refined_samples(nodes=1, seconds=n_seconds, start_ns=start)


def _count(glob: str) -> int:
    row = duckdb.execute(f"SELECT count(*) FROM read_parquet('{glob}')").fetchone()
    assert row is not None
    return int(row[0])


def test_land_writes_hive_layout_sorted_lz4_and_high_water(tmp_path: Path) -> None:
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
    assert md.row_group(0).column(0).compression in ("LZ4", "LZ4_RAW")  # compaction: zstd
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
        "import sys; from lab.lake import synth; from services.lake.writer import LakeWriter\n"
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


def test_recovery_leaves_another_landers_flush_alone(tmp_path: Path) -> None:
    """Landers sharing a lake recover only their own partitions' flushes: a flush of
    partition 0 still in flight (its manifest written) is not another lander's to move."""
    start = T0 + HOUR_NS - 10 * 10**9
    assert _land_in_child(tmp_path, "before_rename", start) == 137
    w = LakeWriter(tmp_path)
    assert w.recover("samples", {1, 2}) == 0
    assert w.landed_high_water("samples") == {}  # partition 0's flush is left as it was
    assert len(list((tmp_path / ".landing" / "samples").iterdir())) == 1
    assert w.recover("samples", {0}) == 2  # its owner rolls it forward
    assert w.landed_high_water("samples") == {0: 9}


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


def _reference_sort(t: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    return t.take(pc.sort_indices(t.select(list(keys)), [(k, "ascending") for k in keys]))


@pytest.mark.parametrize("seed", range(40))
def test_sort_table_is_the_stable_multi_key_sort(seed: int) -> None:
    """Whatever path sort_table takes (already in order, group sort then check, full sort,
    NULL keys, constant columns left in place), the rows come out as a stable sort."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    big = seed % 3 == 0
    t = pa.table(
        {
            "node": rng.choice(["n1", "n0", "n10"], n),
            "metric": rng.choice(["b", "a"], n),
            "ts": (rng.integers(0, 4, n) * (10**18 if big else 1)).astype(np.int64),
            "device": rng.choice(["d1", "d0"], n),
            "u": rng.integers(0, 2**64 - 1 if big else 3, n, dtype=np.uint64),
            "job": pa.array(["j"] * n),
            "spine": pa.nulls(n, pa.string()),
            "late": np.zeros(n, dtype=bool),
            "zero": np.where(rng.integers(0, 2, n) == 1, 0.0, -0.0),
            "maybe": pa.array([None if i % 3 else f"v{i % 2}" for i in range(n)]),
            "row": np.arange(n),
        }
    )
    if seed % 4 == 1:
        t = _reference_sort(t, ("node", "metric", "ts", "device"))
    elif seed % 4 == 2:
        t = _reference_sort(t, ("ts", "device"))  # each (node, metric) group in time order
    elif seed % 4 == 3:
        t = t.set_column(
            0, "node", pa.array([None if i % 5 else v for i, v in enumerate(t["node"].to_pylist())])
        )
    t = pa.concat_tables([t.slice(0, n // 3), t.slice(n // 3)])
    for keys in [("node", "metric", "ts", "device"), ("u", "ts"), ("ts", "node"), ("metric",)]:
        want = _reference_sort(t, keys)
        got = sort_table(t, keys)
        assert got.equals(want), keys
        assert (
            np.signbit(got["zero"].to_numpy()).tolist()
            == np.signbit(want["zero"].to_numpy()).tolist()
        )
        enc = sort_table(encode_strings(t), keys)
        assert enc["row"].equals(want["row"]) and enc["job"].to_pylist() == want["job"].to_pylist()


def test_encode_strings_keeps_values_and_gives_constant_columns_one_entry() -> None:
    t = pa.table(
        {
            "job": ["j"] * 50,
            "node": [f"n{i % 3}" for i in range(50)],
            "late_diff": ["a"] * 49 + ["b"],
            "none": pa.nulls(50, pa.string()),
            "some": [None, "x"] * 25,
            "n": list(range(50)),
        }
    )
    enc = encode_strings(t)
    for name in t.column_names:
        assert enc[name].to_pylist() == t[name].to_pylist(), name
    assert pa.types.is_dictionary(enc["job"].type) and len(enc["job"].chunk(0).dictionary) == 1
    assert len(enc["late_diff"].chunk(0).dictionary) == 2
    assert enc["none"].type == pa.string() and enc["n"].type == pa.int64()
