"""Local copies of small lake objects, fetched from an obstore memory store."""

from __future__ import annotations

from pathlib import Path

import duckdb
import obstore as obs
import pyarrow as pa
import pyarrow.parquet as pq
from obstore.store import MemoryStore

from services.lake.s3mirror import ObjectMirror
from services.lake.store import ObjectInfo

H = "samples/date=2026-01-01/hour=00"


def _store(sizes: dict[str, int]) -> MemoryStore:
    store = MemoryStore()
    for key, n in sizes.items():
        obs.put(store, key, bytes([len(key) % 251]) * n)
    return store


def _listing(store: MemoryStore) -> list[ObjectInfo]:
    got = obs.list(store).collect()
    return sorted(
        (ObjectInfo(str(m["path"]), int(m["size"]), 0.0, str(m["e_tag"])) for m in got),
        key=lambda o: o.key,
    )


def _mirror(store: MemoryStore, tmp: Path, **kw: int) -> tuple[ObjectMirror, list[str]]:
    keys: list[str] = []

    def fetch(bucket: str, key: str) -> tuple[bytes, str]:
        keys.append(key)
        got = obs.get(store, key)
        return bytes(got.bytes()), str(got.meta["e_tag"])

    return ObjectMirror(fetch, parent=str(tmp), **kw), keys


def test_small_objects_read_locally_large_and_over_capacity_ones_from_the_store(
    tmp_path: Path,
) -> None:
    store = _store({f"{H}/a.parquet": 100, f"{H}/b.parquet": 5000, f"{H}/c.parquet": 300,
                    f"{H}/d.parquet": 300})  # fmt: skip
    m, fetched = _mirror(store, tmp_path, max_object=1000, capacity=600)
    got = m.paths("samples", "bkt", _listing(store))
    local = [p for p in got if not p.startswith("s3://")]
    # a (100) and c (300) fit; b is larger than an object may be; d would pass the capacity
    assert got[1] == f"s3://bkt/{H}/b.parquet" and got[3] == f"s3://bkt/{H}/d.parquet"
    assert local == [str(m.root / f"bkt/{H}/a.parquet"), str(m.root / f"bkt/{H}/c.parquet")]
    for p in local:
        key = p.split("/bkt/", 1)[1]
        assert Path(p).read_bytes() == bytes(obs.get(store, key).bytes())
    assert m.size() == 400 and sorted(fetched) == [f"{H}/a.parquet", f"{H}/c.parquet"]
    # listed again, unchanged: nothing fetched again
    assert m.paths("samples", "bkt", _listing(store)) == got
    assert len(fetched) == 2


def test_a_copy_goes_with_its_object_and_a_replaced_object_is_fetched_again(
    tmp_path: Path,
) -> None:
    store = _store({f"{H}/p0-0-2.parquet": 10, "samples/date=1970-01-01/hour=00/seed.parquet": 10})
    m, fetched = _mirror(store, tmp_path)
    first = m.paths("samples", "bkt", _listing(store))
    assert all(Path(p).exists() for p in first)
    obs.delete(store, f"{H}/p0-0-2.parquet")  # a compacted input, deleted
    obs.put(store, "samples/date=1970-01-01/hour=00/seed.parquet", b"x" * 20)  # a new seed
    second = m.paths("samples", "bkt", _listing(store))
    assert not Path(first[1]).exists()  # no listing holds it: its copy is removed
    assert Path(second[0]).read_bytes() == b"x" * 20
    assert fetched.count("samples/date=1970-01-01/hour=00/seed.parquet") == 2
    assert m.size() == 20


def test_an_object_deleted_after_its_listing_keeps_its_store_path(tmp_path: Path) -> None:
    store = _store({f"{H}/p0-0-2.parquet": 10, f"{H}/p0-3-5.parquet": 10})
    listing = _listing(store)
    obs.delete(store, f"{H}/p0-0-2.parquet")
    m, _ = _mirror(store, tmp_path)
    got = m.paths("samples", "bkt", listing)
    assert got[0] == f"s3://bkt/{H}/p0-0-2.parquet"  # read as it would have been, unmirrored
    assert Path(got[1]).exists()


def test_another_listings_copies_stay_and_count_against_the_capacity(tmp_path: Path) -> None:
    store = _store({f"{H}/a.parquet": 400, "events/date=2026-01-01/hour=00/a.parquet": 400})
    listing = _listing(store)
    m, _ = _mirror(store, tmp_path, capacity=500)
    ev = m.paths("events", "bkt", [o for o in listing if o.key.startswith("events/")])
    sa = m.paths("samples", "bkt", [o for o in listing if o.key.startswith("samples/")])
    assert not ev[0].startswith("s3://") and sa[0].startswith("s3://")
    assert m.paths("samples", "bkt", []) == [] and Path(ev[0]).exists()


def test_duckdb_reads_the_copies_with_their_hive_partitions(tmp_path: Path) -> None:
    store = MemoryStore()
    for i in range(3):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"v": [i, i + 10]}), sink)
        obs.put(store, f"{H}/p0-{i}-{i}.parquet", sink.getvalue().to_pybytes())
    m, _ = _mirror(store, tmp_path)
    paths = m.paths("samples", "bkt", _listing(store))
    got = duckdb.execute(
        f"SELECT hour, sum(v) FROM read_parquet({paths!r}, hive_partitioning = true) GROUP BY 1"
    ).fetchall()
    assert got == [("00", 36)]
    m.close()
    assert not m.root.exists()


def test_an_object_listed_without_an_etag_is_fetched_once(tmp_path: Path) -> None:
    store = _store({f"{H}/data-1.parquet": 10})
    m, fetched = _mirror(store, tmp_path)
    unversioned = [ObjectInfo(f"{H}/data-1.parquet", 10, 0.0, "")]  # an Iceberg data file
    first = m.paths("samples@bkt", "bkt", unversioned)
    assert m.paths("samples@bkt", "bkt", unversioned) == first and len(fetched) == 1
