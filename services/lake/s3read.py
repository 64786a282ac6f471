"""How DuckDB reads an ``s3://`` lake: the lake's own listing, and immutable objects cached.

DuckDB 2.0.x has no httpfs; it reads ``s3://`` through an fsspec file system registered on
the connection. s3fs, the usual one, costs a LIST per directory level of a glob and several
HEADs per file opened, each through botocore in Python: a named query over ~100 small files
spent seconds in requests (measured: 91 LISTs, 20 HEADs per refresh; 3 HEADs per open).
:class:`LakeReadFS` replaces it with what the lake's layout allows:

- **Listing from the lake itself** (:func:`lake_object_files`): one recursive LIST per
  dataset (obstore, 1,000 keys a request) gives every committed object with its size and
  ETag; covered inputs of a compaction are left out exactly as ``sql/lake.sql`` does, staged
  objects (``.landing/``) are never under a dataset's prefix. A refresh remembers size and
  ETag of each object, so opening it sends no HEAD.
- **Objects are immutable**: a data object is created once (``If-None-Match: *``) under a
  name that carries its Kafka offsets, and never rewritten; only ``seed.parquet`` is replaced
  when a schema changes (a new ETag). Reads go by blocks of ``block_bytes`` (an object up to
  that size is one GET of the whole object: footer and column chunks together), cached in
  one LRU of ``cache_bytes`` keyed by (key, ETag, block). A query repeated on the same files
  reads them from memory, as a local lake's reader does from the page cache.
- **Small objects as local files** (:mod:`services.lake.s3mirror`, when ``mirror`` is given):
  :meth:`LakeReadFS.read_paths` copies the listed objects up to a block whole to a local
  directory of the connection's own, all fetched at once, and names their local paths, so
  DuckDB opens, globs and reads them without a call into Python; larger objects keep their
  ``s3://`` paths and come through the block cache.

Thread-safe (DuckDB calls from its worker threads). Store errors propagate as raised by
obstore (DuckDB reports them as the query's error).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import obstore as obs
from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from services.lake.layout import live_files, parse_file_name
from services.lake.s3mirror import ObjectMirror
from services.lake.store import ObjectInfo

BLOCK_BYTES = 8 << 20
CACHE_BYTES = 256 << 20


class BlockCache:
    """A bounded LRU of object blocks keyed by (key, etag, block number)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.hits = self.misses = 0
        self._blocks: OrderedDict[tuple[str, str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, k: tuple[str, str, int]) -> bytes | None:
        with self._lock:
            b = self._blocks.get(k)
            if b is None:
                self.misses += 1
                return None
            self.hits += 1
            self._blocks.move_to_end(k)
            return b

    def put(self, k: tuple[str, str, int], data: bytes) -> None:
        with self._lock:
            if k in self._blocks or len(data) > self.capacity:
                return
            self._blocks[k] = data
            self.size += len(data)
            while self.size > self.capacity:
                _, old = self._blocks.popitem(last=False)
                self.size -= len(old)


def lake_object_files(objects: list[ObjectInfo]) -> list[ObjectInfo]:
    """Of one dataset's listing (keys ``<ds>/date=D/hour=H/<name>``), the ``*.parquet``
    objects a reader must read: the data objects :func:`~services.lake.layout.live_files`
    keeps (``sql/lake.sql``'s rule: none covered by another of its partition and hour), and
    the other ``.parquet`` objects there (the seed). Sorted by key."""
    by_key: dict[str, ObjectInfo] = {}
    landed = []
    for o in objects:
        parts = o.key.rsplit("/", 3)
        if (
            len(parts) != 4
            or not parts[1].startswith("date=")
            or not parts[2].startswith("hour=")
            or not parts[3].endswith(".parquet")
        ):
            continue
        by_key[o.key] = o
        lf = parse_file_name(Path(o.key))
        if lf is not None:
            landed.append(lf)
    covered = {str(f.path) for f in landed} - {str(f.path) for f in live_files(landed)}
    return sorted((o for k, o in by_key.items() if k not in covered), key=lambda o: o.key)


def _info(m: Any) -> ObjectInfo:
    return ObjectInfo(str(m["path"]), int(m["size"]), m["last_modified"].timestamp(), m["e_tag"])


class LakeReadFS(AbstractFileSystem):  # type: ignore[misc]
    """Read-only ``s3://`` for DuckDB over obstore; ``store_of(bucket)`` makes the obstore
    store of a bucket (rooted at the bucket, no prefix)."""

    protocol = ("s3", "s3a")
    cachable = False

    def __init__(
        self,
        store_of: Callable[[str], Any],
        *,
        block_bytes: int = BLOCK_BYTES,
        cache_bytes: int = CACHE_BYTES,
        mirror_bytes: int = 0,
        mirror_dir: str | None = None,
    ) -> None:
        super().__init__()
        self._store_of = store_of
        self._stores: dict[str, Any] = {}
        self._known: dict[str, tuple[int, str, float]] = {}  # "bucket/key" -> size, etag, mtime
        self._lock = threading.Lock()
        self.block_bytes = block_bytes
        self.cache = BlockCache(cache_bytes)
        self.requests = {"list": 0, "head": 0, "get": 0}
        self.mirror = (
            ObjectMirror(self._get_whole, capacity=mirror_bytes, max_object=block_bytes,
                         parent=mirror_dir)
            if mirror_bytes > 0
            else None
        )  # fmt: skip

    def store(self, bucket: str) -> Any:
        with self._lock:
            if bucket not in self._stores:
                self._stores[bucket] = self._store_of(bucket)
            return self._stores[bucket]

    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        path = path.split("://", 1)[-1].lstrip("/")
        bucket, _, key = path.partition("/")
        return bucket, key

    def list_objects(self, bucket: str, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (one recursive listing), remembered for opens."""
        self.requests["list"] += 1
        got = obs.list(self.store(bucket), prefix.rstrip("/") + "/").collect()
        out = [_info(m) for m in got]
        with self._lock:
            for o in out:
                self._known[f"{bucket}/{o.key}"] = (o.size, o.etag, o.modified)
        return out

    def read_paths(self, listing: str, bucket: str, objects: list[ObjectInfo]) -> list[str]:
        """The paths DuckDB reads ``objects`` of ``bucket`` by (the latest listing named
        ``listing``): local copies of the small ones where a mirror is kept, else
        ``s3://bucket/key``."""
        if self.mirror is None:
            return [f"s3://{bucket}/{o.key}" for o in objects]
        return self.mirror.paths(listing, bucket, objects)

    def read_urls(self, listing: str, files: list[tuple[str, int]]) -> list[str]:
        """:meth:`read_paths` for files named once and never rewritten, by URL and size
        (an Iceberg table's data files: unique names, sizes from its manifests). Files not
        on ``s3://`` keep their paths."""
        if self.mirror is None:
            return [u for u, _ in files]
        out = [u for u, _ in files]
        by_bucket: dict[str, list[tuple[int, ObjectInfo]]] = {}
        for i, (url, size) in enumerate(files):
            if url.startswith(("s3://", "s3a://")):
                bucket, key = self._split(url)
                by_bucket.setdefault(bucket, []).append((i, ObjectInfo(key, size, 0.0, "")))
        for bucket, objs in by_bucket.items():
            got = self.mirror.paths(f"{listing}@{bucket}", bucket, [o for _, o in objs])
            for (i, _), path in zip(objs, got, strict=True):
                out[i] = path
        return out

    def _get_whole(self, bucket: str, key: str) -> tuple[bytes, str]:
        self.requests["get"] += 1
        got = obs.get(self.store(bucket), key)
        return bytes(got.bytes()), str(got.meta["e_tag"])

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        bucket, key = self._split(path)
        got = self._known.get(f"{bucket}/{key}")
        if got is None:
            self.requests["head"] += 1
            try:
                m = obs.head(self.store(bucket), key)
            except FileNotFoundError:
                return self._dir_info(path, bucket, key)
            o = _info(m)
            got = (o.size, o.etag, o.modified)
            with self._lock:
                self._known[f"{bucket}/{key}"] = got
        return {"name": f"{bucket}/{key}", "size": got[0], "type": "file", "ETag": got[1],
                "mtime": got[2]}  # fmt: skip

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], UTC)

    def _dir_info(self, path: str, bucket: str, key: str) -> dict[str, Any]:
        self.requests["list"] += 1
        got = obs.list_with_delimiter(self.store(bucket), key.rstrip("/") or None)
        if not got["objects"] and not got["common_prefixes"]:
            raise FileNotFoundError(path)
        return {"name": f"{bucket}/{key}".rstrip("/"), "size": 0, "type": "directory"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        bucket, key = self._split(path)
        self.requests["list"] += 1
        got = obs.list_with_delimiter(self.store(bucket), key.rstrip("/") or None)
        out: list[dict[str, Any]] = [
            {"name": f"{bucket}/{p}", "size": 0, "type": "directory"}
            for p in got["common_prefixes"]
        ]
        for m in got["objects"]:
            out.append({"name": f"{bucket}/{m['path']}", "size": int(m["size"]),
                        "type": "file", "ETag": str(m["e_tag"])})  # fmt: skip
        if not out:
            raise FileNotFoundError(path)
        return out if detail else [o["name"] for o in out]

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Every object under ``path`` from one recursive listing (glob's walk)."""
        bucket, key = self._split(path)
        base = key.rstrip("/")
        found: dict[str, dict[str, Any]] = {}
        for o in self.list_objects(bucket, base) if base else self._list_bucket(bucket):
            rel = o.key[len(base) :].lstrip("/") if base else o.key
            depth = rel.count("/") + 1
            if maxdepth is not None and depth > maxdepth:
                continue
            found[f"{bucket}/{o.key}"] = {"name": f"{bucket}/{o.key}", "size": o.size,
                                          "type": "file", "ETag": o.etag}  # fmt: skip
            if withdirs:
                parts = rel.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(filter(None, [bucket, base, *parts[:i]]))
                    found.setdefault(d, {"name": d, "size": 0, "type": "directory"})
        names = sorted(found)
        return {n: found[n] for n in names} if detail else names

    def _list_bucket(self, bucket: str) -> list[ObjectInfo]:
        self.requests["list"] += 1
        got = obs.list(self.store(bucket)).collect()
        return [_info(m) for m in got]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> _ObjectFile:
        if mode != "rb":
            raise PermissionError(f"{path}: the lake's DuckDB file system is read-only")
        return _ObjectFile(self, path)

    def read_range(
        self, bucket: str, key: str, etag: str, size: int, start: int, end: int
    ) -> bytes:
        """Bytes ``start..end`` of an object, through the block cache."""
        bs = self.block_bytes
        first, last = start // bs, max(start, end - 1) // bs
        blocks: dict[int, bytes] = {}
        missing = []
        for n in range(first, last + 1):
            b = self.cache.get((f"{bucket}/{key}", etag, n))
            if b is None:
                missing.append(n)
            else:
                blocks[n] = b
        if missing:
            self.requests["get"] += len(missing)
            starts = [n * bs for n in missing]
            ends = [min(size, (n + 1) * bs) for n in missing]
            got = obs.get_ranges(self.store(bucket), key, starts=starts, ends=ends)
            for n, data in zip(missing, got, strict=True):
                blocks[n] = bytes(data)
                self.cache.put((f"{bucket}/{key}", etag, n), blocks[n])
        joined = b"".join(blocks[n] for n in range(first, last + 1))
        return joined[start - first * bs : end - first * bs]


class _ObjectFile(AbstractBufferedFile):  # type: ignore[misc]
    """One object opened for reading; every read goes through the file system's block
    cache (no buffering of its own)."""

    def __init__(self, fs: LakeReadFS, path: str) -> None:
        inf = fs.info(path)
        self._bucket, self._key = fs._split(path)
        self._etag = str(inf.get("ETag", ""))
        super().__init__(fs, path, mode="rb", cache_type="none", size=inf["size"])

    def _fetch_range(self, start: int, end: int) -> bytes:
        if start >= end:
            return b""
        fs: LakeReadFS = self.fs
        return fs.read_range(self._bucket, self._key, self._etag, self.size, start, end)
