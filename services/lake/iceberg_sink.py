"""Landing into Iceberg tables, exactly once: one append per flush, the offsets in its summary.

:meth:`IcebergLakeSink.land_flushes` takes the rows of one flush of a dataset — one
:class:`~services.lake.backend.Flush` per source partition, each with the Kafka offset of
every row — and commits them as one Iceberg append whose snapshot summary carries the last
landed offset of every partition (:data:`~services.lake.iceberg.OFFSETS_KEY`, merged with the
table's). Before every attempt it reloads the table and drops the rows whose offsets the table
already holds: a zombie lander (its partitions moved while it held a flush) or a commit that
lost a race lands only what nobody landed yet. pyiceberg's own retry is off (it would re-apply
the stale append); a CommitFailedException is followed by a re-read, a filter and a retry.

The catalog database going away (a restart, a failover, SQLite locked by another process) and
the warehouse's object store going away (restarted, a network partition: the table's FileIO
cannot upload a data file, read or write metadata) are transient: each attempt of a flush
(reload, filter, upload, commit) and every other call of the sink is retried with the object
lake's rule (:func:`~services.lake.store.patiently`: backoff for up to ``reconnect_s``, a
``cannot reach the store ...: retrying`` warning each time; the engine's pooled connections
dropped, so the next attempt connects afresh). A retried attempt starts from the re-read
offsets, so a commit whose connection broke (of unknown outcome) lands once whether or not it
reached the database; the data files an attempt uploaded are reused by the next while their
rows are still to land, else left as orphans no snapshot names. Past ``reconnect_s`` it
raises :class:`~services.lake.store.StoreUnavailable` and the lander exits for its supervisor
to restart it (nothing past the table's offsets was committed to Kafka).

Data files are written by us (sorted and encoded like the Parquet lake, field ids for every
reader) as ``<table>/data/date=D/hour=HH/p<part>-<first>-<last>-<uuid>.parquet``, one per UTC
hour per partition, then added to the append. A kill -9 while they upload or while the catalog
commits leaves either no new snapshot (the files are orphans no snapshot names, never read;
the offsets were not committed, so the records land again) or the whole snapshot (the table's
offsets say so; the records are skipped on restart).

Test seams (``crash_at``, exit 137): ``mid_upload`` (first data file of a flush written),
``before_commit`` (all written, nothing committed); ``pause`` is called before each commit
attempt (a test holds a zombie there).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from services.lake.datasets import DATASETS, conform
from services.lake.iceberg import (
    OFFSETS_KEY,
    data_files,
    duckdb_path,
    fileio_unavailable,
    landed_offsets,
    offsets_property,
    open_table,
    table_schema,
    with_hour_columns,
)
from services.lake.iceberg_files import (
    arrow_schema,
    file_options,
    parquet_bytes,
    upload_data_file,
)
from services.lake.layout import LakeError, file_name
from services.lake.sink import Flush
from services.lake.store import ObjectStore, StoreUnavailable, patiently
from services.lake.writer import CrashSeam, sort_table, split_by_hour, write_options

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.table import Table

    from services.lake.s3store import S3Settings

log = logging.getLogger(__name__)

SEED_KEY = "{dataset}/date=1970-01-01/hour=00/seed.parquet"
T = TypeVar("T")


def trim(flush: Flush, landed: int) -> Flush | None:
    """``flush`` less its rows at offsets ``<= landed``; None when nothing is left to land."""
    if flush.last <= landed:
        return None
    if flush.first > landed:
        return flush
    table = flush.table
    if table is None or table.num_rows == 0:
        return Flush(flush.partition, landed + 1, flush.last, None, None)
    if flush.row_offsets is None:
        raise LakeError(f"p{flush.partition}: rows overlap offset {landed} and carry no offsets")
    keep = flush.row_offsets > landed
    return Flush(
        flush.partition,
        landed + 1,
        flush.last,
        table.filter(pa.array(keep)),
        flush.row_offsets[keep],
    )


class IcebergLakeSink:
    """Lands datasets into ``namespace.<dataset>`` tables of ``catalog``; seeds (zero-row
    files that let DuckDB's views bind before any data) go to ``seeds``, the lake root.
    Not thread-safe; several processes may land into one table (each its own partitions,
    or a zombie: see the module docstring)."""

    def __init__(
        self,
        catalog: SqlCatalog,
        namespace: str,
        seeds: ObjectStore,
        *,
        s3: S3Settings | None = None,
        row_group_rows: int = 1 << 20,
        crash_at: str | None = None,
        pause: Callable[[], None] | None = None,
        max_attempts: int = 50,
        reconnect_s: float = 120.0,
    ) -> None:
        self.catalog = catalog
        self.namespace = namespace
        self.store = seeds
        self.s3 = s3
        self.row_group_rows = row_group_rows
        self.seam = CrashSeam(crash_at)
        self.pause = pause
        self.max_attempts = max_attempts
        self.reconnect_s = reconnect_s
        self.commits = 0
        self.conflicts = 0
        self.reconnects = 0  # calls that failed on the catalog's connection or the store, retried
        self._tables: dict[str, Table] = {}
        self._seeded: set[str] = set()
        self._reader: duckdb.DuckDBPyConnection | None = None
        self._where = seeds.root_url if s3 is None else f"{seeds.root_url} at {s3.where()}"

    def table(self, dataset: str) -> Table:
        """The dataset's table, as of the last load (created when absent)."""
        return self._patiently(lambda: self._table(dataset))

    def _table(self, dataset: str) -> Table:
        got = self._tables.get(dataset)
        if got is None:
            got = self._tables[dataset] = open_table(self.catalog, self.namespace, dataset)
        return got

    def _fresh(self, dataset: str) -> Table:
        table = self._table(dataset)
        table.refresh()
        return table

    def _patiently(self, call: Callable[[], T]) -> T:
        """``call()``, retried while the catalog database or the store cannot be reached (up
        to ``reconnect_s``: :func:`~services.lake.store.patiently`); then StoreUnavailable.
        Other errors propagate at once."""
        return patiently(call, self.reconnect_s, self._retrying, self._unavailable)

    def _unavailable(self, e: Exception) -> StoreUnavailable | None:
        if isinstance(e, StoreUnavailable):  # the seeds' store
            return e
        if connection_lost(e):
            return StoreUnavailable(f"iceberg catalog: {_first_line(e)}")
        return fileio_unavailable(e, self._where)

    def _retrying(self, e: StoreUnavailable) -> None:
        """Count and log a retry; drop the engine's pooled connections (the next call
        connects afresh)."""
        self.reconnects += 1
        log.warning("land: %s: retrying", e)
        self.catalog.engine.dispose()

    # --- landing --------------------------------------------------------------------------

    def land(
        self, dataset: str, table: pa.Table, *, partition: int, first: int, last: int
    ) -> list[str]:
        """One partition's flush (see :meth:`land_flushes`)."""
        return self.land_flushes(dataset, [Flush(partition, first, last, table, None)])

    def land_flushes(self, dataset: str, flushes: Sequence[Flush]) -> list[str]:
        """Commit ``flushes`` (distinct partitions of ``dataset``) as one append, less what the
        table already holds; returns the data files committed (none when nothing was left, or
        no flush has rows: then no snapshot is made). Blocks on the store and the catalog, and
        while either cannot be reached waits for it (up to ``reconnect_s``: the caller commits
        no offset meanwhile). Raises LakeError after ``max_attempts`` lost commits,
        StoreUnavailable past ``reconnect_s``; other errors of the store and the catalog
        propagate (nothing past the table's offsets is committed then)."""
        if dataset not in DATASETS:
            raise LakeError(f"unknown dataset {dataset!r}")
        self.ensure_seed(dataset)
        written: dict[tuple[int, int, int], list[Any]] = {}
        for attempt in range(self.max_attempts):
            done = self._patiently(lambda: self._attempt(dataset, flushes, written))
            if done is not None:
                return done
            self.conflicts += 1
            time.sleep(random.uniform(0.05, 0.2) * min(attempt + 1, 10))
        raise LakeError(f"{dataset}: {self.max_attempts} commits lost to concurrent writers")

    def _attempt(
        self,
        dataset: str,
        flushes: Sequence[Flush],
        written: dict[tuple[int, int, int], list[Any]],
    ) -> list[str] | None:
        """Reload the table, drop what it holds, upload what is left (once: ``written``) and
        commit it; the data files committed, or None when another commit came first. Safe to
        run again after any failure: it starts from the offsets the table holds."""
        table = self._fresh(dataset)
        landed = landed_offsets(table)
        todo = [t for f in flushes if (t := trim(f, landed.get(f.partition, -1)))]
        if not any(f.table is not None and f.table.num_rows for f in todo):
            return []
        files = self._files(table, dataset, todo, written)
        ends = {**landed, **{f.partition: f.last for f in todo}}
        if self.pause is not None:
            self.pause()
        self.seam.reach("before_commit")
        if not self._commit(table, files, ends):
            return None
        self.commits += 1
        return [duckdb_path(f.file_path) for f in files]

    def _files(
        self,
        table: Table,
        dataset: str,
        todo: list[Flush],
        written: dict[tuple[int, int, int], list[Any]],
    ) -> list[Any]:
        """The data files of ``todo``, written once per (partition, first, last)."""
        out: list[Any] = []
        for f in todo:
            if f.table is None or f.table.num_rows == 0:
                continue
            key = (f.partition, f.first, f.last)
            if key not in written:
                written[key] = self._write(table, dataset, f)
            out += written[key]
        return out

    def _commit(self, table: Table, files: list[Any], ends: dict[int, int]) -> bool:
        """Append ``files`` with the offsets ``ends``; False when another commit came first
        (pyiceberg guarantees this one did not land then) or its outcome is unknown. A lost
        catalog connection or store propagates (the retried attempt's reload tells whether
        it landed)."""
        from pyiceberg.exceptions import CommitFailedException, CommitStateUnknownException

        txn = table.transaction()
        props = {OFFSETS_KEY: offsets_property(ends)}
        with txn.update_snapshot(snapshot_properties=props).merge_append() as append:
            for f in files:
                append.append_data_file(f)
        try:
            txn.commit_transaction()
        except CommitFailedException as e:
            log.info("iceberg: commit lost (%s): re-reading the offsets", e)
            return False
        except CommitStateUnknownException as e:  # the re-read offsets tell whether it landed
            log.warning("iceberg: commit state unknown (%s): re-reading the offsets", e)
            return False
        return True

    def _write(self, table: Table, dataset: str, flush: Flush) -> list[Any]:
        """``flush``'s rows as one data file per UTC hour, uploaded; their DataFiles."""
        assert flush.table is not None
        ds = DATASETS[dataset]
        rows = conform(flush.table, ds.schema)
        arrow = arrow_schema(table)
        opts = file_options(dataset, self.row_group_rows)
        stem = file_name(flush.partition, flush.first, flush.last)[: -len(".parquet")]
        out = []
        for i, ((date, hour), part) in enumerate(split_by_hour(rows)):
            t = with_hour_columns(sort_table(part, ds.sort_by), arrow, date, hour)
            path = (
                f"{table.location()}/data/date={date}/hour={hour}/"
                f"{stem}-{uuid.uuid4().hex[:12]}.parquet"
            )
            out.append(upload_data_file(table, parquet_bytes(t, opts), path, date, hour))
            if i == 0:
                self.seam.reach("mid_upload")
        return out

    # --- reading back ----------------------------------------------------------------------

    def landed_high_water(self, dataset: str) -> dict[int, int]:
        """``{partition: last offset}`` the table holds (re-read from the catalog)."""
        return self._patiently(lambda: landed_offsets(self._fresh(dataset)))

    def live_paths(self, dataset: str, partition: int | None = None) -> list[str]:
        """The current snapshot's data files (of ``partition``'s flushes, when given)."""
        found = self._patiently(lambda: data_files(self._fresh(dataset)))
        paths = [duckdb_path(p) for p in found]
        if partition is None:
            return paths
        return [p for p in paths if p.rsplit("/", 1)[-1].startswith(f"p{partition}-")]

    def recover(self, dataset: str, partitions: set[int] | None = None) -> int:
        """Nothing to finish: an interrupted flush left no snapshot (or a whole one)."""
        return 0

    def reader(self) -> duckdb.DuckDBPyConnection | None:
        """A DuckDB connection that reads the data files (None: the default one does)."""
        if self.s3 is None:
            return None
        if self._reader is None:
            self._reader = duckdb.connect()
            self.s3.register(self._reader)
        return self._reader

    # --- seeds -----------------------------------------------------------------------------

    def ensure_seed(self, dataset: str) -> None:
        """A zero-row ``<lake>/<dataset>/date=1970-01-01/hour=00/seed.parquet`` with the
        table's columns, listed with the data files so a view binds on an empty table."""
        if dataset not in self._seeded:
            self._patiently(lambda: self._ensure_seed(dataset))

    def _ensure_seed(self, dataset: str) -> None:
        key = SEED_KEY.format(dataset=dataset)
        schema = table_schema(dataset)
        if self.store.head(key) is not None:
            have = pq.read_schema(pa.BufferReader(self.store.get(key)))
            if have.remove_metadata().equals(schema):
                self._seeded.add(dataset)
                return
        self.store.put(key, parquet_bytes(schema.empty_table(), write_options(schema, 1024)))
        self._seeded.add(dataset)

    def ensure_seeds(self) -> None:
        for dataset in DATASETS:
            self.ensure_seed(dataset)

    def seed_path(self, dataset: str) -> str:
        return self.store.url(SEED_KEY.format(dataset=dataset))


def connection_lost(e: BaseException) -> bool:
    """Whether ``e`` says the catalog database could not be reached or dropped the connection
    (SQLAlchemy's OperationalError: refused, reset, server restarting, SQLite locked), or
    SQLAlchemy saw the connection invalidated."""
    import sqlalchemy.exc

    if isinstance(e, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
        return True
    return isinstance(e, sqlalchemy.exc.DBAPIError) and e.connection_invalidated


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
