"""Compaction of an Iceberg lake with pyiceberg 0.12 alone: the small files the lander's
flushes add to an hour partition rewritten as one file per source partition, in one commit.

For one hour of one table (:meth:`IcebergRewriter.compact_hour`):

1. Reload the table; take the live data files of the hour named as the lander names them
   (``p<part>-<first>-<last>-<uuid>.parquet``) and group them by source partition; a
   partition with one file is left alone, as are files some other writer added.
2. Read each group (through pyiceberg's scan: field ids, columns added since filled with
   nulls), sort it as the Parquet compactor does (samples in 5-minute slabs of ``ts``, each
   a row group, by the dataset's key; others by the key), and upload it as
   ``p<part>-<min first>-<max last>-<uuid>.parquet`` (zstd, several files of at most
   ``max_file_rows`` rows when larger).
3. Commit **one** overwrite snapshot that deletes the inputs and adds the outputs. Its
   summary carries :data:`~services.lake.iceberg.OFFSETS_KEY` copied from the snapshot it
   replaces, so the lander's offsets are found in it as in any append (and snapshot expiry,
   which keeps the newest snapshot carrying them, keeps this one), and
   :data:`~services.lake.iceberg.COMPACTED_KEY` (the hour).

Guarantees: the rows of the hour are the same before and after (the outputs hold exactly
the inputs' rows). The commit is the SQL catalog's compare-and-swap of the table's metadata,
asserting the snapshot the plan was made on: a crash before it leaves the inputs in the
table (the outputs are orphans no snapshot names); an append by the lander or a commit by a
second compactor in between makes it fail, and the hour is planned again from the reloaded
table (outputs reused when the inputs did not change, so the retry is only a commit; an
input set changed by a late append is read again; a second compactor that already did the
hour leaves nothing to do). No appended file is ever dropped: a commit only deletes files
of the snapshot it asserted. Outputs of plans that did not commit are deleted (only after
a definite refusal); the replaced inputs are deleted by snapshot expiry once no snapshot
older than the compaction's is left (:func:`~services.lake.iceberg.expire_snapshots`).

Test seams: ``crash_at`` ``rewrite_before_commit`` (outputs uploaded, nothing committed;
exit 137); ``pause`` is called before each commit attempt.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from services.lake.compact import SLAB_S, CompactionReport, sort_into_slabs, write_slabs
from services.lake.datasets import DATASETS
from services.lake.iceberg import COMPACTED_KEY, OFFSETS_KEY, offsets_snapshot, open_table
from services.lake.iceberg_files import (
    arrow_schema,
    file_options,
    hour_of,
    live_data_files,
    upload_data_file,
)
from services.lake.iceberg_sink import connection_lost
from services.lake.layout import HOUR_NS, file_name
from services.lake.writer import CrashSeam, sort_table

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

_LANDED = re.compile(r"p(\d+)-(\d+)-(\d+)-[0-9a-f]+\.parquet")


def source_range(path: str) -> tuple[int, int, int] | None:
    """``(partition, first, last)`` of a data file named as the lander names them."""
    m = _LANDED.fullmatch(path.rsplit("/", 1)[-1])
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]))


def plan_hour(files: list[Any]) -> dict[int, list[Any]]:
    """The DataFiles of one hour to merge: by source partition, those with two or more."""
    by_part: dict[int, list[Any]] = {}
    for f in files:
        r = source_range(f.file_path)
        if r is not None:
            by_part.setdefault(r[0], []).append(f)
    return {p: sorted(fs, key=lambda f: f.file_path) for p, fs in by_part.items() if len(fs) > 1}


def hour_closed(date: str, hour: str, now_s: float, close_after_s: float) -> bool:
    """Whether hour ``date``/``hour`` ended more than ``close_after_s`` before ``now_s``
    (the Parquet compactor's rule)."""
    start = datetime.strptime(f"{date}T{hour}", "%Y-%m-%dT%H").replace(tzinfo=UTC)
    return int(start.timestamp()) * 10**9 + HOUR_NS + close_after_s * 1e9 <= now_s * 1e9


class IcebergRewriter:
    """Compacts hour partitions of ``namespace.<dataset>`` tables of ``catalog`` (see the
    module docstring). Safe next to landers and other rewriters; not thread-safe itself."""

    def __init__(
        self,
        catalog: SqlCatalog,
        namespace: str,
        *,
        row_group_rows: int = 1 << 20,
        max_file_rows: int = 1 << 25,
        compression_level: int = 9,
        slab_s: dict[str, float] | None = None,
        max_attempts: int = 5,
        crash_at: str | None = None,
        pause: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.catalog = catalog
        self.namespace = namespace
        self.row_group_rows = row_group_rows
        self.max_file_rows = max_file_rows
        self.compression_level = compression_level
        self.slab_ns = {k: int(v * 1e9) for k, v in (SLAB_S if slab_s is None else slab_s).items()}
        self.max_attempts = max_attempts
        self.seam = CrashSeam(crash_at)
        self.pause = pause
        self.clock = clock
        self.conflicts = 0

    def closed_hours(self, dataset: str, close_after_s: float) -> list[tuple[str, str]]:
        """The closed hours of ``dataset``'s table with files to merge, oldest first."""
        table = open_table(self.catalog, self.namespace, dataset)
        hours: dict[tuple[str, str], list[Any]] = {}
        for f in live_data_files(table):
            hours.setdefault(hour_of(f), []).append(f)
        now = self.clock()
        return [
            h
            for h, files in sorted(hours.items())
            if hour_closed(*h, now, close_after_s) and plan_hour(files)
        ]

    def compact_hour(self, dataset: str, date: str, hour: str) -> CompactionReport:
        """Merge hour ``date``/``hour`` of ``dataset`` in one commit. Blocks on the store and
        the catalog; a commit lost ``max_attempts`` times is reported as skipped. Raises the
        store's errors (OSError) and the catalog's (nothing is committed then)."""
        report = CompactionReport()
        table = open_table(self.catalog, self.namespace, dataset)
        written: dict[frozenset[str], list[Any]] = {}
        unknown = False
        for attempt in range(self.max_attempts):
            if attempt:
                table.refresh()
            groups = plan_hour([f for f in live_data_files(table) if hour_of(f) == (date, hour)])
            inputs = [f for fs in groups.values() for f in fs]
            outputs = []
            for part, files in sorted(groups.items()):
                key = frozenset(f.file_path for f in files)
                if key not in written:
                    written[key] = self._rewrite(table, dataset, part, files)
                outputs += written[key]
            if not groups:
                break
            if self.pause is not None:
                self.pause()
            self.seam.reach("rewrite_before_commit")
            done = self._commit(table, dataset, (date, hour), inputs, outputs)
            if done:
                report.written += [f.file_path for f in outputs]
                report.merged += len(inputs)
                break
            unknown = unknown or done is None
            self.conflicts += 1
            time.sleep(0.05 * (attempt + 1))
        else:
            report.skipped.append(f"{dataset} {date}T{hour}: commits lost to concurrent writers")
        if not unknown:  # a commit of unknown outcome may have landed its outputs: keep all
            self._drop_unused(table, written, {str(p) for p in report.written})
        return report

    def _rewrite(self, table: Table, dataset: str, part: int, inputs: list[Any]) -> list[Any]:
        """The rows of ``inputs`` (source partition ``part``) sorted and uploaded as one or
        more data files of at most ``max_file_rows`` rows; their DataFiles."""
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.io.pyarrow import ArrowScan
        from pyiceberg.table import FileScanTask

        date, hour = hour_of(inputs[0])
        scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
        rows = scan.to_table([FileScanTask(f) for f in inputs]).cast(arrow_schema(table))
        keys = DATASETS[dataset].sort_by
        slab_ns = self.slab_ns.get(dataset)
        if slab_ns is not None:
            rows, starts = sort_into_slabs(rows, keys, slab_ns)
        else:
            rows, starts = sort_table(rows, keys), []
        ranges = [r for f in inputs if (r := source_range(f.file_path)) is not None]
        stem = file_name(part, min(r[1] for r in ranges), max(r[2] for r in ranges))[:-8]
        opts = file_options(dataset, self.row_group_rows, self.compression_level)
        out = []
        for a in range(0, max(rows.num_rows, 1), self.max_file_rows):
            chunk = rows.slice(a, self.max_file_rows)
            cuts = [s - a for s in starts if a < s < a + chunk.num_rows]
            buf = pa.BufferOutputStream()
            write_slabs(chunk, buf, opts, cuts)
            path = (
                f"{table.location()}/data/date={date}/hour={hour}/"
                f"{stem}-{uuid.uuid4().hex[:12]}.parquet"
            )
            data = bytes(buf.getvalue().to_pybytes())
            out.append(upload_data_file(table, data, path, date, hour))
        return out

    def _commit(
        self,
        table: Table,
        dataset: str,
        hour: tuple[str, str],
        inputs: list[Any],
        outputs: list[Any],
    ) -> bool | None:
        """One overwrite snapshot: ``inputs`` deleted, ``outputs`` added, the offsets carried
        forward. True: committed; False: another commit came first (this one did not land);
        None: unknown (the connection broke; the next plan tells)."""
        from pyiceberg.exceptions import CommitFailedException, CommitStateUnknownException

        props = {COMPACTED_KEY: f"{hour[0]}T{hour[1]}"}
        src = offsets_snapshot(table)
        if src is not None:
            props[OFFSETS_KEY] = src.summary.additional_properties[OFFSETS_KEY]
        txn = table.transaction()
        with txn.update_snapshot(snapshot_properties=props).overwrite() as rewrite:
            for f in inputs:
                rewrite.delete_data_file(f)
            for f in outputs:
                rewrite.append_data_file(f)
        try:
            txn.commit_transaction()
        except CommitFailedException as e:
            log.info("iceberg: %s compaction lost a commit (%s): planning again", dataset, e)
            return False
        except CommitStateUnknownException as e:
            log.warning("iceberg: %s compaction commit state unknown (%s)", dataset, e)
            return None
        except Exception as e:
            if not connection_lost(e):
                raise
            self.catalog.engine.dispose()
            return None
        return True

    def _drop_unused(
        self, table: Table, written: dict[frozenset[str], list[Any]], kept: set[str]
    ) -> None:
        """Delete the outputs of plans that never committed (no snapshot names them)."""
        for files in written.values():
            for f in files:
                if f.file_path not in kept:
                    with contextlib.suppress(OSError):
                        table.io.delete(f.file_path)
