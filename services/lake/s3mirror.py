"""Small lake objects copied whole to a local directory, for DuckDB to read as local files.

A Parquet lake landed every few seconds holds, until compaction, many small objects (one
flush each). DuckDB reads an ``s3://`` path through a Python file system
(:class:`~services.lake.s3read.LakeReadFS`): every open, glob and read of every file is a
call into Python, which on a hundred small files costs more than the bytes (the named queries
ran well past their time on a local lake with every byte already cached in memory); and on
a real store each file DuckDB reads one after another is a round trip of its own.

:class:`ObjectMirror` fetches the listed objects up to ``max_object`` bytes, all at once
(``workers`` GETs in flight), into a directory of its own, and gives DuckDB their local paths
(``<dir>/<bucket>/<key>``: the dataset, ``date=`` and ``hour=`` stay in the path, as the views
expect). Larger objects, and those past ``capacity`` bytes, keep their ``s3://`` paths.

Safe because lake objects are immutable: a data object is created once under a name carrying
its offsets; only a seed is replaced, with a new ETag, which is fetched again. A copy is kept
while a dataset's latest listing holds it and removed once none does (compacted inputs), so
the directory holds at most ``capacity`` bytes. The directory is this process's own (removed
when the mirror is collected or the process exits); nothing else writes or evicts there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.lake.store import ObjectInfo

MAX_OBJECT_BYTES = 8 << 20
CAPACITY_BYTES = 1 << 30
WORKERS = 16


class ObjectMirror:
    """Local copies of small immutable objects; ``fetch(bucket, key)`` returns one object's
    bytes and ETag."""

    def __init__(
        self,
        fetch: Callable[[str, str], tuple[bytes, str]],
        *,
        capacity: int = CAPACITY_BYTES,
        max_object: int = MAX_OBJECT_BYTES,
        workers: int = WORKERS,
        parent: str | None = None,
    ) -> None:
        self._fetch = fetch
        self.capacity = capacity
        self.max_object = max_object
        self.workers = workers
        self.root = Path(tempfile.mkdtemp(prefix="refinery-lake-", dir=parent))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self._copies: dict[str, tuple[str, int]] = {}  # "bucket/key" -> etag, size
        self._in_use: dict[str, set[str]] = {}  # listing -> "bucket/key" it mirrors
        self._lock = threading.Lock()

    def close(self) -> None:
        """Remove the directory and every copy in it."""
        self._finalizer()

    def size(self) -> int:
        with self._lock:
            return sum(size for _, size in self._copies.values())

    def paths(self, listing: str, bucket: str, objects: list[ObjectInfo]) -> list[str]:
        """A path for DuckDB to read each of ``objects`` (the latest listing named
        ``listing``, e.g. one dataset's prefix): a local copy, fetched now if missing or
        of another ETag (an object listed with ETag ``""`` is one never rewritten: any copy
        of it stands), for each object that fits; ``s3://bucket/key`` for the others.
        Copies no listing holds any more are removed."""
        with self._lock:
            others = set().union(*(v for k, v in self._in_use.items() if k != listing))
            budget = self.capacity - sum(self._copies[n][1] for n in others if n in self._copies)
            keep: set[str] = set()
            todo: list[ObjectInfo] = []
            for o in objects:
                name = f"{bucket}/{o.key}"
                if o.size > self.max_object or o.size > budget:
                    continue
                budget -= o.size
                keep.add(name)
                have = self._copies.get(name)
                if have is None or (o.etag and have[0] != o.etag):  # "": named once, immutable
                    todo.append(o)
        failed = self._fetch_all(bucket, todo)
        keep -= failed
        with self._lock:
            gone = self._in_use.get(listing, set()) - keep - others
            self._in_use[listing] = keep
            for name in gone:
                self._copies.pop(name, None)
                (self.root / name).unlink(missing_ok=True)
        return [
            str(self.root / f"{bucket}/{o.key}") if f"{bucket}/{o.key}" in keep
            else f"s3://{bucket}/{o.key}"
            for o in objects
        ]  # fmt: skip

    def _fetch_all(self, bucket: str, todo: list[ObjectInfo]) -> set[str]:
        """Fetch ``todo`` concurrently; the names of those that vanished (a compacted input
        deleted since the listing: it keeps its ``s3://`` path and reads as it would have)."""
        if not todo:
            return set()
        with ThreadPoolExecutor(min(self.workers, len(todo))) as pool:
            results = list(pool.map(lambda o: self._fetch_one(bucket, o), todo))
        return {name for name in results if name}

    def _fetch_one(self, bucket: str, o: ObjectInfo) -> str:
        name = f"{bucket}/{o.key}"
        try:
            data, etag = self._fetch(bucket, o.key)
        except FileNotFoundError:
            return name
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fetch-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a seed replaced under a reader: the reader keeps its file
        with self._lock:
            self._copies[name] = (etag, len(data))
        return ""
