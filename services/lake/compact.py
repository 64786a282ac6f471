"""Compaction: merge one hour's small files per source partition into one large file.

Protocol (each step is crash-safe, readers are correct after any prefix of it):

1. Under an exclusive lock (``<root>/.compact.lock``), list the live files of the hour.
2. For a partition with two or more live files, read them, sort by the dataset's sort key and
   write ``.compact-p<part>-<min first>-<max last>.parquet.partial``; fsync. Samples are cut
   into 5-minute slabs of ``ts`` first: each slab is sorted by the key and starts a new row
   group, so a query over a window reads the slabs it overlaps, not the whole hour (row-group
   statistics on ``ts`` prune the rest), and every row group is still sorted by the key.
3. Rename it to ``p<part>-<min first>-<max last>.parquet``; fsync the directory. This rename is
   the commit point: from now on the new file *covers* its inputs (their ranges lie inside its
   range, see :class:`~services.lake.layout.LandedFile`), and every reader — Python or the plain
   DuckDB views in ``sql/views`` — skips covered files. Before it, readers see only the inputs.
4. Delete covered files once the covering file is older than ``grace_s`` (a reader that listed
   the inputs just before step 3 can still open them meanwhile); fsync the directory.

A crash leaves at worst a ``.partial`` temp (removed by :meth:`Compactor.recover`) or covered
inputs (removed by the next run). The landed high-water mark is unchanged: the new file's last
offset is the largest of its inputs'. Files landing meanwhile have larger offsets, so the new
file never covers a file it was not made from.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from services.lake.datasets import DATASETS, conform
from services.lake.layout import (
    HOUR_NS,
    PARTIAL_SUFFIX,
    LakeError,
    LakePaths,
    LandedFile,
    file_name,
    fsync_dir,
    fsync_file,
    live_files,
    parse_file_name,
    parse_hour,
)
from services.lake.writer import (
    CrashSeam,
    encode_strings,
    sort_table,
    write_options,
)

LOCK_NAME = ".compact.lock"
SLAB_S = {"samples": 300.0}  # datasets compacted in time slabs, and the slab length


def sort_into_slabs(
    table: pa.Table, keys: tuple[str, ...], slab_ns: int
) -> tuple[pa.Table, list[int]]:
    """``table`` ordered by (``ts`` // ``slab_ns``, *keys*) and the row offsets where each
    slab after the first starts."""
    slab = np.floor_divide(table.column("ts").to_numpy(), slab_ns)
    keyed = sort_table(table.append_column("_slab", pa.array(slab)), ("_slab", *keys))
    ordered = keyed.column("_slab").to_numpy()
    starts = (np.flatnonzero(np.diff(ordered)) + 1).tolist()
    return keyed.drop_columns(["_slab"]), starts


def write_slabs(
    table: pa.Table, sink: Path | pa.NativeFile, options: dict[str, object], starts: list[int]
) -> None:
    """Write ``table`` to ``sink`` with a row group boundary at each offset of ``starts`` (and
    every ``row_group_size`` rows in between)."""
    opts = dict(options)
    rows = opts.pop("row_group_size")
    assert isinstance(rows, int)
    with pq.ParquetWriter(sink, table.schema, **opts) as w:
        for a, e in itertools.pairwise([0, *starts, table.num_rows]):
            w.write_table(table.slice(a, e - a), row_group_size=rows)


def write_slabs_durably(
    table: pa.Table, path: Path, options: dict[str, object], starts: list[int]
) -> None:
    """:func:`write_slabs` to ``path``, then fsync the file."""
    write_slabs(table, path, options, starts)
    fsync_file(path)


def write_merged(
    dataset: str,
    merged: pa.Table,
    sink: Path | pa.NativeFile,
    options: dict[str, object],
    slab_ns: int | None,
) -> None:
    """Write compaction's output: ``merged`` sorted by the dataset's key (in ``slab_ns``
    slabs of ``ts`` when given, each starting a row group) to ``sink``. Does not fsync."""
    keys = DATASETS[dataset].sort_by
    if slab_ns is not None:
        ordered, starts = sort_into_slabs(merged, keys, slab_ns)
        write_slabs(ordered, sink, options, starts)
    else:
        pq.write_table(sort_table(merged, keys), sink, **options)


@dataclass
class CompactionReport:
    """What one call did: files written, inputs merged and covered files removed."""

    written: list[Path | str] = field(default_factory=list)  # str: an object's URL
    merged: int = 0
    removed: int = 0
    skipped: list[str] = field(default_factory=list)

    def add(self, other: CompactionReport) -> None:
        self.written += other.written
        self.merged += other.merged
        self.removed += other.removed
        self.skipped += other.skipped


class Compactor:
    """Compacts hours of one lake. Safe to run next to a landing writer and to readers.

    ``crash_at`` (tests only): ``compact_before_rename``, ``compact_after_rename`` or
    ``compact_mid_delete``, with an optional ``@N``; the process exits with status 137 there.
    """

    def __init__(
        self,
        root: Path | str,
        *,
        row_group_rows: int = 1 << 20,
        grace_s: float = 30.0,
        compression_level: int = 9,
        slab_s: dict[str, float] | None = None,
        crash_at: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.paths = LakePaths(root)
        self.slab_ns = {k: int(v * 1e9) for k, v in (SLAB_S if slab_s is None else slab_s).items()}
        self.compression_level = compression_level
        self.row_group_rows = row_group_rows
        self.grace_s = grace_s
        self.seam = CrashSeam(crash_at)
        self.clock = clock

    @contextmanager
    def _lock(self, wait: bool) -> Iterator[bool]:
        self.paths.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.paths.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    def recover(self, dataset: str) -> int:
        """Remove compaction temps a crash left behind; returns how many. Takes the lock."""
        n = 0
        with self._lock(wait=True):
            for _, _, hdir in self.paths.hour_dirs(dataset):
                for entry in os.listdir(hdir):
                    if entry.startswith(".compact-") and entry.endswith(PARTIAL_SUFFIX):
                        (hdir / entry).unlink(missing_ok=True)
                        n += 1
        return n

    def compact_hour(
        self, dataset: str, date: str, hour: str, *, wait: bool = True
    ) -> CompactionReport:
        """Compact one hour of one dataset (see the module docstring). Blocks on file I/O and,
        when ``wait``, on another compactor's lock (otherwise returns an empty report).
        Raises LakeError for a bad dataset or hour."""
        hdir = self.paths.hour_dir(dataset, date, hour)
        with self._lock(wait) as held:
            if not held or not hdir.is_dir():
                return CompactionReport()
            return self._compact_dir(dataset, hdir)

    def _compact_dir(self, dataset: str, hdir: Path) -> CompactionReport:
        report = CompactionReport()
        files = [f for f in map(parse_file_name, _listdir(hdir)) if f is not None]
        live = live_files(files)
        by_part: dict[int, list[LandedFile]] = {}
        for f in live:
            by_part.setdefault(f.partition, []).append(f)
        for part, inputs in sorted(by_part.items()):
            if len(inputs) < 2:
                continue
            out = self._merge(dataset, hdir, part, inputs, report)
            if out is not None:
                files.append(out)
        report.removed += self._remove_covered(files)
        return report

    def _merge(
        self,
        dataset: str,
        hdir: Path,
        part: int,
        inputs: list[LandedFile],
        report: CompactionReport,
    ) -> LandedFile | None:
        ds = DATASETS[dataset]
        tables = []
        for f in inputs:
            t = pq.read_table(f.path)
            extra = set(t.column_names) - set(ds.schema.names)
            if extra:  # written by a newer schema than ours: do not drop its columns
                report.skipped.append(f"{f.path}: unknown columns {sorted(extra)}")
                return None
            tables.append(conform(t, ds.schema))
        merged = encode_strings(pa.concat_tables(tables))
        slab_ns = self.slab_ns.get(dataset)
        name = file_name(part, min(f.first for f in inputs), max(f.last for f in inputs))
        tmp = hdir / f".compact-{name[:-8]}{PARTIAL_SUFFIX}"
        try:
            opts = write_options(ds.schema, self.row_group_rows, self.compression_level)
            write_merged(dataset, merged, tmp, opts, slab_ns)
            fsync_file(tmp)
            self.seam.reach("compact_before_rename")
            os.replace(tmp, hdir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(hdir)
        self.seam.reach("compact_after_rename")
        report.written.append(hdir / name)
        report.merged += len(inputs)
        out = parse_file_name(hdir / name)
        assert out is not None
        return out

    def _remove_covered(self, files: list[LandedFile]) -> int:
        live = live_files(files)
        removed = 0
        now = self.clock()
        for f in files:
            if f in live:
                continue
            cover = next(c for c in live if c.covers(f))
            try:
                if now - cover.path.stat().st_mtime < self.grace_s:
                    continue
                f.path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
            self.seam.reach("compact_mid_delete")
        if removed:
            fsync_dir(files[0].path.parent)
        return removed

    def compact_closed(
        self,
        datasets: list[str] | None = None,
        *,
        close_after_s: float = 600.0,
        wait: bool = False,
    ) -> CompactionReport:
        """Compact every hour that ended more than ``close_after_s`` ago and still has more
        than one live file per partition or covered files to remove. Meant to be called
        periodically by the landing loop (``wait=False``: skips if another compactor runs)."""
        report = CompactionReport()
        now_ns = int(self.clock() * 1e9)
        with self._lock(wait) as held:
            if not held:
                return report
            for dataset in datasets or list(DATASETS):
                for date, hour, hdir in self.paths.hour_dirs(dataset):
                    try:
                        d, h = parse_hour(f"{date}T{hour}")
                    except LakeError:
                        continue  # a directory we did not make
                    start_ns = _hour_start_ns(d, h)
                    if start_ns + HOUR_NS + close_after_s * 1e9 > now_ns:
                        continue
                    if _needs_work(hdir):
                        report.add(self._compact_dir(dataset, hdir))
        return report


def _listdir(path: Path) -> list[Path]:
    return [path / n for n in os.listdir(path)]


def _needs_work(hdir: Path) -> bool:
    files = [f for f in map(parse_file_name, _listdir(hdir)) if f is not None]
    live = live_files(files)
    parts = [f.partition for f in live]
    return len(live) < len(files) or len(parts) != len(set(parts))


def _hour_start_ns(date: str, hour: str) -> int:
    from datetime import UTC, datetime

    d = datetime.strptime(f"{date}T{hour}", "%Y-%m-%dT%H").replace(tzinfo=UTC)
    return int(d.timestamp()) * 1_000_000_000
