"""Landing onto object storage: exactly once without rename.

Same layout and file names as the local lake (:mod:`services.lake.layout`), so the views in
``sql/`` and every reader work unchanged. What differs is the commit:

- A flush whose rows fall in one hour is one conditional create of its data object
  ``<ds>/date=D/hour=H/p<part>-<first>-<last>.parquet`` (``If-None-Match: *``): the object
  appears whole or not at all, and a second writer of the same name is refused.
- A flush that spans hours first stages each hour's file under
  ``.landing/<ds>/p<part>-<first>-<last>/<n>.parquet``, then commits by a conditional create
  of the manifest ``.landing/<ds>/p<part>-<first>-<last>.json`` (the list of staged → final
  keys), then creates the final objects, then deletes the manifest and the staged objects.
  :meth:`ObjectLakeWriter.recover` rolls a committed manifest forward (copies what is
  missing) and deletes staged objects no manifest names, so the landed high-water mark never
  claims offsets whose rows are not all visible.

Only after :meth:`land` returns may the caller commit Kafka offsets. A put the client retried
after the store had already stored it fails the create; the writer then compares the stored
bytes with its own and takes an identical object as its own. A different object under the
same name means another writer landed that range: :class:`~services.lake.layout.LakeError`.
Recovery reads every manifest and listing in whatever order the store returns them.

A store that cannot be reached (restarting, a network partition) is waited for: every call
of the writer is retried with backoff for up to ``reconnect_s`` (each is idempotent: a
retried land re-stages, re-creates its manifest and objects with the same bytes), so the
lander blocks in :meth:`ObjectLakeWriter.land` and commits no offset until the store is back;
past ``reconnect_s`` StoreUnavailable reaches the lander, which exits for its supervisor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from services.lake.datasets import DATASETS, conform
from services.lake.layout import (
    LANDING_DIR,
    SEED_NAME,
    LakeError,
    LandedFile,
    file_name,
    live_files,
    parse_file_name,
    parse_hour,
)
from services.lake.store import (
    ObjectExists,
    ObjectInfo,
    ObjectStore,
    StoreUnavailable,
    patiently,
)
from services.lake.writer import (
    CrashSeam,
    encode_strings,
    landing_options,
    sort_table,
    split_by_hour,
    write_options,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def to_bytes(table: pa.Table, options: dict[str, Any]) -> bytes:
    """``table`` as Parquet file bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    return bytes(sink.getvalue().to_pybytes())


def hour_prefix(dataset: str, date: str, hour: str) -> str:
    """``<dataset>/date=D/hour=H`` for a validated hour."""
    if dataset not in DATASETS:
        raise LakeError(f"unknown dataset {dataset!r}")
    date, hour = parse_hour(f"{date}T{hour}")
    return f"{dataset}/date={date}/hour={hour}"


def parse_data_files(objects: list[ObjectInfo]) -> list[LandedFile]:
    """The data objects among a dataset's listing (covered ones included), sorted. Each
    ``LandedFile.path`` is the object key as a relative path."""
    files = []
    for o in objects:
        parts = o.key.split("/")
        if len(parts) != 4 or not parts[1].startswith("date=") or not parts[2].startswith("hour="):
            continue
        lf = parse_file_name(Path(o.key))
        if lf is not None:
            files.append(lf)
    files.sort()
    return files


def data_files(store: ObjectStore, dataset: str) -> list[LandedFile]:
    """Every data object of ``dataset`` (covered ones included), from one listing."""
    if dataset not in DATASETS:
        raise LakeError(f"unknown dataset {dataset!r}")
    return parse_data_files(store.list(dataset))


class ObjectLakeWriter:
    """Lands tables into a lake on an :class:`~services.lake.store.ObjectStore`; the same
    contract as :class:`~services.lake.writer.LakeWriter` (one writer per source partition,
    not thread-safe). ``crash_at`` (tests): ``before_rename`` (staged or nothing created),
    ``mid_rename`` (a multi-hour flush committed, its first final object created)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        row_group_rows: int = 1 << 20,
        crash_at: str | None = None,
        reconnect_s: float = 120.0,
    ) -> None:
        self.store = store
        self.root = store.root_url
        self.row_group_rows = row_group_rows
        self.seam = CrashSeam(crash_at)
        self.reconnect_s = reconnect_s
        self.reconnects = 0  # calls that failed on an unreachable store and were retried
        self._seeded: set[str] = set()
        self._con: duckdb.DuckDBPyConnection | None = None

    def _create(self, key: str, data: bytes) -> None:
        """Create ``key`` holding ``data``; an identical object already there is ours (a
        retried put), a different one raises LakeError."""
        try:
            self.store.put(key, data, create=True)
        except ObjectExists:
            if self.store.get(key) != data:
                raise LakeError(
                    f"{self.store.url(key)} was landed by another writer: is a second lander "
                    "consuming the same partition?"
                ) from None

    def _patiently(self, call: Callable[[], T]) -> T:
        """``call()``, waiting out an unreachable store (:func:`~services.lake.store.patiently`,
        up to ``reconnect_s``). Every call retried this way is idempotent (conditional creates
        of identical bytes)."""
        return patiently(call, self.reconnect_s, self._retrying)

    def _retrying(self, e: StoreUnavailable) -> None:
        self.reconnects += 1
        log.warning("land: %s: retrying", e)

    def land(
        self, dataset: str, table: pa.Table, *, partition: int, first: int, last: int
    ) -> list[str]:
        """Durably land ``table`` as the rows of offsets ``first..last`` of ``partition``;
        returns the URLs of the objects created (none for an empty table). Blocks on the
        store, and while it cannot be reached waits for it (up to ``reconnect_s``: the
        caller commits no offset meanwhile). Raises LakeError (bad values, another writer),
        StoreError (the store; StoreUnavailable past ``reconnect_s``), or ValueError (the
        table does not fit the dataset)."""
        return self._patiently(
            lambda: self._land(dataset, table, partition=partition, first=first, last=last)
        )

    def _land(
        self, dataset: str, table: pa.Table, *, partition: int, first: int, last: int
    ) -> list[str]:
        ds = DATASETS.get(dataset) if isinstance(dataset, str) else None
        if ds is None:
            raise LakeError(f"unknown dataset {dataset!r}")
        name = file_name(partition, first, last)
        self.ensure_seed(dataset)
        if table.num_rows == 0:
            return []
        table = conform(table, ds.schema)
        opts = landing_options(ds, self.row_group_rows)
        parts = []
        for (date, hour), part in split_by_hour(table):
            data = to_bytes(sort_table(encode_strings(part), ds.sort_by), opts)
            parts.append((f"{hour_prefix(dataset, date, hour)}/{name}", data))
        if len(parts) == 1:
            self.seam.reach("before_rename")
            self._create(*parts[0])
        else:
            self._land_staged(dataset, name, parts)
        return [self.store.url(k) for k, _ in parts]

    def _land_staged(self, dataset: str, name: str, parts: list[tuple[str, bytes]]) -> None:
        stem = f"{LANDING_DIR}/{dataset}/{name[:-8]}"
        moves = [[f"{stem}/{i}.parquet", key] for i, (key, _) in enumerate(parts)]
        for (staged, _), (_, data) in zip(moves, parts, strict=True):
            self.store.put(staged, data)
        self.seam.reach("before_rename")
        self._create(f"{stem}.json", json.dumps(moves).encode())  # the commit point
        for i, (key, data) in enumerate(parts):
            self._create(key, data)
            if i == 0:
                self.seam.reach("mid_rename")
        self._finish(stem, moves)

    def _finish(self, stem: str, moves: list[list[str]]) -> None:
        self.store.delete(f"{stem}.json")
        for staged, _ in moves:
            self.store.delete(staged)

    def recover(self, dataset: str, partitions: set[int] | None = None) -> int:
        """Finish or undo landings a crash interrupted; returns objects created or removed.
        Committed manifests are rolled forward; staged objects of ``partitions`` (all when
        None) that no manifest names are removed (their offsets were never committed). Call
        only while no other writer lands those partitions. Waits for an unreachable store
        as :meth:`land` does."""
        return self._patiently(lambda: self._recover(dataset, partitions))

    def _recover(self, dataset: str, partitions: set[int] | None) -> int:
        if dataset not in DATASETS:
            raise LakeError(f"unknown dataset {dataset!r}")
        n = 0
        objects = self.store.list(f"{LANDING_DIR}/{dataset}")
        keys = {o.key for o in objects}
        for key in keys:
            if not key.endswith(".json"):
                continue
            moves = json.loads(self.store.get(key))
            for staged, final in moves:
                if self.store.head(final) is None:
                    self.store.copy(staged, final)
                    n += 1
            self._finish(key[:-5], moves)
        for key in keys:
            stem = key.rsplit("/", 1)[0]
            if not key.endswith(".parquet") or f"{stem}.json" in keys:
                continue  # staged objects of a manifest were deleted with it above
            lf = parse_file_name(Path(stem + ".parquet"))
            if lf is not None and (partitions is None or lf.partition in partitions):
                self.store.delete(key)
                n += 1
        return n

    def ensure_seed(self, dataset: str) -> None:
        """Keep a zero-row ``seed.parquet`` with the dataset's current schema (see
        :meth:`LakeWriter.ensure_seed`); replaced when the schema changed."""
        if dataset in self._seeded:
            return
        schema = DATASETS[dataset].schema
        key = f"{hour_prefix(dataset, '1970-01-01', '00')}/{SEED_NAME}"
        if self.store.head(key) is not None:
            have = pq.read_schema(pa.BufferReader(self.store.get(key)))
            if have.remove_metadata().equals(schema):
                self._seeded.add(dataset)
                return
        self.store.put(key, to_bytes(schema.empty_table(), write_options(schema, 1024)))
        self._seeded.add(dataset)

    def ensure_seeds(self) -> None:
        """ensure_seed for every dataset."""
        for dataset in DATASETS:
            self.ensure_seed(dataset)

    def landed_high_water(self, dataset: str) -> dict[int, int]:
        """``{partition: last landed offset}`` from the object names (call :meth:`recover`
        first). Waits for an unreachable store as :meth:`land` does."""
        hw: dict[int, int] = {}
        for f in self._patiently(lambda: data_files(self.store, dataset)):
            hw[f.partition] = max(hw.get(f.partition, -1), f.last)
        return hw

    def live_paths(self, dataset: str, partition: int | None = None) -> list[str]:
        """URLs of the data objects a reader should read (covered ones left out)."""
        return [
            self.store.url(str(f.path))
            for f in live_files(data_files(self.store, dataset))
            if partition is None or f.partition == partition
        ]

    def reader(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection (this writer's own) that reads this store's URLs."""
        if self._con is None:
            self._con = duckdb.connect()
            self.store.register(self._con)
        return self._con
