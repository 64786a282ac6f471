"""The s3:// read path's pure parts: which listed objects a reader reads, the block cache."""

from __future__ import annotations

from services.lake.s3read import BlockCache, lake_object_files
from services.lake.store import ObjectInfo


def _o(key: str) -> ObjectInfo:
    return ObjectInfo(key, 10, 0.0, "e")


def test_covered_inputs_staged_objects_and_temp_files_are_left_out() -> None:
    h = "samples/date=2026-01-01/hour=00"
    listing = [
        _o(f"{h}/p0-0-2.parquet"),
        _o(f"{h}/p0-3-5.parquet"),
        _o(f"{h}/p0-0-5.parquet"),  # compaction's output covers both above
        _o(f"{h}/p1-3-5.parquet"),  # another partition: not covered
        _o(f"{h}/p0-6-8.parquet.partial"),
        _o("samples/date=1970-01-01/hour=00/seed.parquet"),
        _o("samples/date=2026-01-01/hour=01/p0-6-8.parquet"),  # another hour
        _o("samples/stray.parquet"),  # not in an hour directory (as the glob would)
    ]
    got = [o.key for o in lake_object_files(listing)]
    assert got == [
        "samples/date=1970-01-01/hour=00/seed.parquet",
        f"{h}/p0-0-5.parquet",
        f"{h}/p1-3-5.parquet",
        "samples/date=2026-01-01/hour=01/p0-6-8.parquet",
    ]


def test_the_block_cache_is_bounded_and_keyed_by_etag() -> None:
    c = BlockCache(capacity=10)
    c.put(("k", "e1", 0), b"12345")
    c.put(("k", "e1", 1), b"67890")
    assert c.get(("k", "e1", 0)) == b"12345"
    assert c.get(("k", "e2", 0)) is None  # the object was replaced: its old bytes are not read
    c.put(("j", "e1", 0), b"abc")  # over capacity: the least recently used block goes
    assert c.get(("k", "e1", 1)) is None
    assert c.get(("k", "e1", 0)) == b"12345" and c.size <= 10
    c.put(("big", "e", 0), b"x" * 11)  # larger than the cache: not kept
    assert c.get(("big", "e", 0)) is None
