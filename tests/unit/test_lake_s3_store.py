"""The object-store seam and the object-lake protocol, on DirectoryObjectStore (S3's
conditional semantics in a local directory). The same protocol runs on a real s3proxy in
tests/integration/test_lake_s3.py."""

from __future__ import annotations

import json
import multiprocessing
import random
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from lab.lake import synth
from schemas.errors import ConfigError
from services.lake import sqlload
from services.lake.backend import open_writer
from services.lake.layout import HOUR_NS, LakeError, LakePaths
from services.lake.location import parse_location
from services.lake.objcompact import Lease, LeaseLost, ObjectCompactor
from services.lake.objwriter import ObjectLakeWriter
from services.lake.store import (
    DirectoryObjectStore,
    ObjectExists,
    ObjectInfo,
    ObjectMissing,
    PreconditionFailed,
)

T0 = 1_704_067_200_000_000_000 + 59 * 60 * 10**9  # 00:59, so 2 minutes span two hours


class ShuffledStore(DirectoryObjectStore):
    """Lists in a random order: recovery may assume nothing about listing order."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        out = super().list(prefix)
        random.shuffle(out)
        return out


def _samples(first: int, n: int = 3, seconds: int = 120) -> pa.Table:
    """``n`` records of 100 rows (raw offsets ``first``...) spread over ``seconds`` from
    00:59: with the default two minutes they span two hours."""
    t = synth.refined_samples(nodes=1, seconds=seconds, start_ns=T0)
    t = t.take(pa.array([i * (t.num_rows - 1) // (n * 100 - 1) for i in range(n * 100)]))
    return t.set_column(
        t.schema.get_field_index("raw_offset"),
        "raw_offset",
        pa.array([first + i // 100 for i in range(n * 100)], pa.int64()),
    )


def _hours(table: pa.Table) -> list[tuple[str, bytes]]:
    """Each hour's rows of ``table`` as Parquet bytes, as the writer stages them."""
    from services.lake.objwriter import to_bytes
    from services.lake.writer import split_by_hour

    return [(f"{d}T{h}", to_bytes(t, {})) for (d, h), t in split_by_hour(table)]


def _views(root: Path) -> duckdb.DuckDBPyConnection:
    """The sql/ views over an object lake kept in a directory (seeds first, as the CLI)."""
    ObjectLakeWriter(DirectoryObjectStore(root)).ensure_seeds()
    return sqlload.connect(root)


# --- locations ---------------------------------------------------------------------------


def test_locations_are_told_apart_and_other_schemes_refused(tmp_path: Path) -> None:
    assert parse_location("s3://bkt/a/b/").url == "s3://bkt/a/b"
    assert parse_location(Path("s3://bkt/a")).key("samples") == "a/samples"
    assert parse_location("file:///x/y").path == Path("/x/y")
    assert parse_location("rel/dir").path == Path.cwd() / "rel/dir"
    for bad in ("gs://b/x", "s3a://b/x", "http://h/x", "s3://B_ad/x", "s3://bkt/a/../b"):
        with pytest.raises(ConfigError):
            parse_location(bad)


def test_a_local_writer_never_makes_a_directory_named_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        LakePaths(Path("s3://bucket/lake"))
    with pytest.raises(ConfigError):
        open_writer("gs://bucket/lake")
    assert list(tmp_path.iterdir()) == []


# --- the store ---------------------------------------------------------------------------


def test_conditional_create_and_compare_and_swap(tmp_path: Path) -> None:
    s = DirectoryObjectStore(tmp_path)
    tag = s.put("a/b.json", b"1", create=True)
    with pytest.raises(ObjectExists):
        s.put("a/b.json", b"2", create=True)
    assert s.get("a/b.json") == b"1"
    new = s.put("a/b.json", b"3", if_match=tag)
    with pytest.raises(PreconditionFailed):
        s.put("a/b.json", b"4", if_match=tag)
    info = s.head("a/b.json")
    assert info is not None and info.etag == new
    assert s.head("a/none") is None
    with pytest.raises(ObjectMissing):
        s.get("a/none")
    assert [o.key for o in s.list("a")] == ["a/b.json"]
    s.delete("a/b.json")
    s.delete("a/b.json")
    assert s.list("a") == []


# --- landing -----------------------------------------------------------------------------


def test_a_flush_over_two_hours_lands_both_and_leaves_nothing_staged(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    w = ObjectLakeWriter(store)
    urls = w.land("samples", _samples(0), partition=1, first=10, last=12)
    assert len(urls) == 2 and all(u.endswith("p1-10-12.parquet") for u in urls)
    assert store.list(".landing") == []
    assert w.landed_high_water("samples") == {1: 12}
    con = _views(tmp_path)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (300,)


def test_a_second_writer_of_the_same_name_is_refused_unless_identical(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    one = _samples(0, seconds=30)
    ObjectLakeWriter(store).land("samples", one, partition=0, first=0, last=2)
    ObjectLakeWriter(store).land("samples", one, partition=0, first=0, last=2)  # a retried put
    other = _samples(5, seconds=30)
    with pytest.raises(LakeError, match="another writer"):
        ObjectLakeWriter(store).land("samples", other, partition=0, first=0, last=2)


def _land_and_crash(root: str, point: str) -> None:
    w = ObjectLakeWriter(DirectoryObjectStore(root), crash_at=point)
    w.land("samples", _samples(0), partition=0, first=0, last=2)


@pytest.mark.parametrize(("point", "landed"), [("before_rename", False), ("mid_rename", True)])
def test_a_crash_mid_commit_is_rolled_forward_or_back(
    tmp_path: Path, point: str, landed: bool
) -> None:
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_land_and_crash, args=(str(tmp_path), point))
    p.start()
    p.join(60)
    assert p.exitcode == 137
    w = ObjectLakeWriter(ShuffledStore(tmp_path))
    assert w.recover("samples", {0}) > 0
    assert w.landed_high_water("samples") == ({0: 2} if landed else {})
    assert w.store.list(".landing") == []
    rows = _views(tmp_path).execute("SELECT count(*) FROM samples").fetchone()
    assert rows == ((300,) if landed else (0,))


def test_recovery_leaves_other_partitions_staged_objects_alone(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    store.put(".landing/samples/p3-0-9/0.parquet", b"x")
    store.put(".landing/samples/p4-0-9/0.parquet", b"x")
    assert ObjectLakeWriter(store).recover("samples", {3}) == 1
    assert [o.key for o in store.list(".landing")] == [".landing/samples/p4-0-9/0.parquet"]


def test_a_committed_manifest_is_rolled_forward_whatever_the_listing_order(
    tmp_path: Path,
) -> None:
    store = ShuffledStore(tmp_path)
    staged = [f".landing/samples/p0-0-2/{i}.parquet" for i in range(2)]
    finals = [f"samples/date=2024-01-01/hour=0{i}/p0-0-2.parquet" for i in range(2)]
    w = ObjectLakeWriter(store)
    for s, (_, part) in zip(staged, _hours(_samples(0)), strict=True):
        store.put(s, part)
    store.put(
        ".landing/samples/p0-0-2.json",
        json.dumps(list(map(list, zip(staged, finals, strict=True)))).encode(),
        create=True,
    )
    store.put(finals[0], store.get(staged[0]), create=True)  # crashed after the first final
    assert w.recover("samples", {0}) == 1
    assert sorted(o.key for o in store.list("samples") if "p0-" in o.key) == finals
    assert store.list(".landing") == []


# --- compaction --------------------------------------------------------------------------


def test_compaction_merges_an_hour_and_readers_count_each_row_once(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    w = ObjectLakeWriter(store)
    for i in range(3):
        w.land("samples", _samples(i * 10, seconds=30), partition=0, first=i * 10, last=i * 10 + 2)
    c = ObjectCompactor(store, grace_s=0.0)
    rep = c.compact_hour("samples", "2024-01-01", "00")
    assert rep.merged == 3 and rep.removed == 3 and len(rep.written) == 1
    assert w.landed_high_water("samples") == {0: 22}
    con = _views(tmp_path)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (900,)
    assert store.head(".compact.lease") is not None  # released, not deleted: expired


def test_the_lease_admits_one_compactor_and_fences_a_stale_one(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    now = [1000.0]
    a = Lease(store, ttl_s=10, clock=lambda: now[0])
    b = Lease(store, ttl_s=10, clock=lambda: now[0])
    assert a.acquire() and not b.acquire()
    a.renew()
    now[0] += 11  # a stalls past its lease; b takes over
    assert b.acquire()
    with pytest.raises(LeaseLost):
        a.renew()
    a.release()  # no effect: not ours any more
    assert not a.acquire()
    b.release()
    assert a.acquire()


def test_a_second_compactor_skips_while_the_lease_is_held(tmp_path: Path) -> None:
    store = DirectoryObjectStore(tmp_path)
    w = ObjectLakeWriter(store)
    for i in range(2):
        w.land("samples", _samples(i * 10, seconds=30), partition=0, first=i * 10, last=i * 10 + 2)
    holder = Lease(store)
    assert holder.acquire()
    late = T0 + 3 * HOUR_NS
    oc = ObjectCompactor(store, grace_s=0.0, clock=lambda: late / 1e9)
    assert oc.compact_closed(["samples"], close_after_s=0).merged == 0
    holder.release()
    assert oc.compact_closed(["samples"], close_after_s=0).merged == 2
