"""Landing core: Arrow tables in, durable Parquet files out, independent of Kafka.

:meth:`LakeWriter.land` writes the rows of one flush (source partition, offsets first..last)
into one file per UTC hour of ``ts``. Every file is written under a ``.partial`` temp name,
fsynced, renamed and its directory fsynced. A flush that spans several hours is made atomic by
a manifest in ``<root>/.landing`` written (and fsynced) before the first rename: recovery rolls
such a flush forward, so the landed high-water mark never claims offsets whose rows are not all
visible. Only after :meth:`land` returns may the caller commit Kafka offsets.

:meth:`landed_high_water` reads the last landed offset per partition from file names; that is
where a consumer resumes. Example::

    >>> import tempfile, pyarrow as pa
    >>> from services.lake.datasets import ACCOUNTING_SCHEMA, conform
    >>> w = LakeWriter(tempfile.mkdtemp())
    >>> t = conform(pa.table({"ts": [0], "raw_partition": [0], "raw_offset": [7],
    ...     "input_samples": [3], "refined_samples": [3], "duplicate_samples": [0],
    ...     "quarantined_samples": [0], "outcome": ["refined"]}), ACCOUNTING_SCHEMA)
    >>> [p.name for p in w.land("accounting", t, partition=2, first=10, last=12)]
    ['p2-10-12.parquet']
    >>> w.landed_high_water("accounting")
    {2: 12}
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from services.lake.datasets import DATASETS, Dataset, conform
from services.lake.layout import (
    HOUR_NS,
    MAX_TS_NS,
    PARTIAL_SUFFIX,
    SEED_NAME,
    LakeError,
    LakePaths,
    file_name,
    fsync_dir,
    fsync_file,
    hour_of,
    live_files,
)


class CrashSeam:
    """A test seam: ``CrashSeam("after_rename@3").reach("after_rename")`` exits the process
    with status 137 (no cleanup, like kill -9) the third time that point is reached.
    ``CrashSeam(None)`` never fires."""

    def __init__(self, spec: str | None) -> None:
        self.point: str | None = None
        self.countdown = 0
        if spec:
            point, _, count = spec.partition("@")
            self.point, self.countdown = point, int(count) if count else 1

    def reach(self, point: str) -> None:
        if point == self.point:
            self.countdown -= 1
            if self.countdown <= 0:
                os._exit(137)


def write_options(
    schema: pa.Schema,
    row_group_rows: int,
    compression_level: int = 3,
    *,
    statistics: bool | list[str] = True,
) -> dict[str, object]:
    """pyarrow.parquet.write_table keyword arguments for a dataset.

    Strings are dictionary-encoded; integer time and offset columns use DELTA_BINARY_PACKED
    (sorted series make their deltas tiny); floats use BYTE_STREAM_SPLIT so zstd sees the
    slowly-changing exponent bytes together. Everything is zstd-compressed (compaction, which
    runs off the hot path, spends level 9); ``statistics``: min/max on every column, or on
    those named. Landing uses :func:`landing_options`.
    """
    dict_cols: list[str] = []
    encodings: dict[str, str] = {}
    for f in schema:
        if pa.types.is_string(f.type) or pa.types.is_boolean(f.type):
            dict_cols.append(f.name)
        elif pa.types.is_int64(f.type) or pa.types.is_uint64(f.type):
            encodings[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_floating(f.type):
            encodings[f.name] = "BYTE_STREAM_SPLIT"
        else:
            dict_cols.append(f.name)  # int32 etc.: small cardinality (rail, rank, numa)
    return {
        "compression": "zstd",
        "compression_level": compression_level,
        "use_dictionary": dict_cols,
        "column_encoding": encodings,
        "row_group_size": row_group_rows,
        "write_statistics": statistics,
        "store_schema": False,  # plain string columns for every reader, not dictionary<>
    }


def landing_options(dataset: Dataset, row_group_rows: int) -> dict[str, object]:
    """write_table keyword arguments for a landed (small, short-lived) file: LZ4.

    Compaction rewrites every landed file within the hour after it closes (zstd level 9), so
    landing spends as little as it can on what only lasts until then (measured on 50 k-row
    flushes: 44 % less CPU in write_table, same size): min/max statistics only on ``ts`` and
    the sort key, the columns readers prune fresh files by (statistics on every column cost a
    third of the write); dictionaries for strings only (small integers and booleans compress
    as well plain); and values handed to the encoders 64 Ki at a time instead of 1 Ki. LZ4
    instead of zstd level 3 takes another 20 % off write_table's CPU for files about 25 %
    larger (7 instead of 5.7 B/sample on realistic samples); an hour a partition landed only
    one file into is not compacted and keeps them.
    """
    stats = list(dict.fromkeys(("ts", *dataset.sort_by)))
    opts = write_options(dataset.schema, row_group_rows, statistics=stats)
    opts["compression"] = "lz4"
    del opts["compression_level"]
    opts["use_dictionary"] = [f.name for f in dataset.schema if _is_text(f.type)]
    opts["write_batch_size"] = 1 << 16
    return opts


def _rank(col: pa.ChunkedArray) -> pa.Array:
    """Integer keys that order like ``col`` (strings or dictionary of strings): the rank of
    each row's value among the distinct values. Sorting these beats comparing strings."""
    enc = col.combine_chunks()
    if not pa.types.is_dictionary(enc.type):
        enc = pc.dictionary_encode(enc)
    order = pc.sort_indices(enc.dictionary)
    rank = np.empty(len(order), dtype=np.int32)
    rank[order.to_numpy()] = np.arange(len(order), dtype=np.int32)
    return pa.array(rank[enc.indices.to_numpy(zero_copy_only=False)])


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(t == pa.string())


def _one_string(col: pa.ChunkedArray) -> str | None:
    """The value of a string column that holds one value and no NULL, else None. A few probes
    reject most other columns before the full comparison (a fifth of what hashing costs)."""
    n = len(col)
    if n == 0 or col.null_count:
        return None
    first = col[0].as_py()
    if any(col[i].as_py() != first for i in (n - 1, n // 2, n // 4, 3 * n // 4, n // 8)):
        return None
    return first if pc.all(pc.equal(col, first)).as_py() else None


def encode_strings(table: pa.Table) -> pa.Table:
    """String columns dictionary-encoded: ``take`` then moves int32 indices instead of
    strings, and the Parquet writer reuses the dictionary instead of hashing every value.
    Columns with no value at all are left alone (encoding them costs as much as a full one);
    one that holds one value throughout gets its one-entry dictionary without hashing."""
    cols = []
    for c in table.columns:
        if pa.types.is_string(c.type) and c.null_count < len(c):
            one = _one_string(c)
            if one is None:
                c = pc.dictionary_encode(c)
            else:
                idx = pa.array(np.zeros(len(c), dtype=np.int32))
                c = pa.chunked_array([pa.DictionaryArray.from_arrays(idx, pa.array([one]))])
        cols.append(c)
    return pa.Table.from_arrays(cols, names=table.column_names)


def _codes(col: pa.ChunkedArray) -> np.ndarray | None:
    """Integers that order like ``col`` (strings: ranks; integers: themselves), or None when
    ``col`` has NULLs or another type."""
    if col.null_count:
        return None
    if _is_text(col.type):
        return np.asarray(_rank(col).to_numpy())
    if pa.types.is_integer(col.type):
        return np.asarray(col.to_numpy())
    return None


def _slow_key(col: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A key column the multi-key sort accepts: ranks for strings without NULLs, plain values
    for dictionaries with NULLs (it sorts no dictionary type), the column itself otherwise."""
    if _is_text(col.type) and col.null_count == 0:
        return _rank(col)
    if pa.types.is_dictionary(col.type):
        return col.cast(col.type.value_type)
    return col


def _nondecreasing_within(groups: np.ndarray | None, keys: list[np.ndarray]) -> bool:
    """Whether ``keys`` are lexicographically non-decreasing between neighbouring rows of the
    same group (all rows one group when ``groups`` is None)."""
    undecided = None if groups is None else groups[1:] == groups[:-1]
    for k in keys:
        a, b = k[:-1], k[1:]
        greater = a > b
        if (greater if undecided is None else undecided & greater).any():
            return False
        undecided = a == b if undecided is None else undecided & (a == b)
    return True


def sort_indices(table: pa.Table, keys: tuple[str, ...]) -> pa.Array | None:
    """The row order of ``keys`` ascending (stable; NULLs last), or None when ``table`` is in
    that order already.

    Leading keys of small range (string ranks, slab numbers) are folded into one integer
    group code and the rows are put in group order by a stable sort of it; when the remaining
    keys (``ts`` ...) are then already non-decreasing within each group, as rows of a series
    that arrive in time order are, that is the order. Otherwise, or with NULLs in a key, a
    full multi-key sort."""
    if table.num_rows <= 1:
        return None
    cols = [table.column(k) for k in keys]
    codes = [_codes(c) for c in cols]
    if any(c is None for c in codes):
        slow = {k: _slow_key(c) for k, c in zip(keys, cols, strict=True)}
        return pc.sort_indices(pa.table(slow), [(k, "ascending") for k in keys])
    ints = [c for c in codes if c is not None]
    group: np.ndarray | None = None
    span, folded = 1, 0
    for c in ints:
        lo, hi = int(c.min()), int(c.max())
        if span * (hi - lo + 1) >= 1 << 62:
            break
        part = (c - c.min()).astype(np.int64)  # in c's own type: uint64 does not wrap
        group = part if group is None else group * (hi - lo + 1) + part
        span *= hi - lo + 1
        folded += 1
    rest = ints[folded:]
    if group is None or bool((group[1:] >= group[:-1]).all()):
        if _nondecreasing_within(group, rest):
            return None
    else:
        order = np.argsort(group.astype(np.uint16) if span <= 1 << 16 else group, kind="stable")
        if _nondecreasing_within(group[order], [k[order] for k in rest]):
            return pa.array(order)
    full = {f"k{i}": c for i, c in enumerate(([] if group is None else [group]) + rest)}
    return pc.sort_indices(pa.table(full), [(k, "ascending") for k in full])


def _constant(col: pa.ChunkedArray) -> bool:
    """Whether every row of ``col`` holds the same value (NULL included), judged cheaply:
    all NULL, or no NULL and one dictionary value or min == max for integers and booleans
    (not floats: -0.0 == 0.0, and NaN is no minimum)."""
    if col.null_count == len(col):
        return True
    if col.null_count:
        return False
    t = col.type
    if pa.types.is_dictionary(t):
        dicts = [c.dictionary for c in col.chunks]
        return all(len(d) == 1 and d.equals(dicts[0]) for d in dicts)
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        mm = pc.min_max(col)
        return bool(mm["min"] == mm["max"])
    return False


def sort_table(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Rows ordered by ``keys`` ascending (stable; NULLs last); ``table`` itself when it is
    in that order already. Columns holding one value throughout are not moved."""
    order = sort_indices(table, keys)
    if order is None:
        return table
    cols = [c if _constant(c) else c.take(order) for c in table.columns]
    return pa.Table.from_arrays(cols, schema=table.schema)


def write_parquet_durably(table: pa.Table, path: Path, options: dict[str, object]) -> None:
    """Write ``table`` to ``path`` and fsync the file (not its directory)."""
    pq.write_table(table, path, **options)
    fsync_file(path)


def split_by_hour(table: pa.Table) -> list[tuple[tuple[str, str], pa.Table]]:
    """``table``'s rows by UTC hour of ``ts``: ``[((date, hour), rows), ...]``, oldest first
    (``ts`` clamped to 1970..2262)."""
    mm = pc.min_max(table.column("ts"))
    lo, hi = (min(max(int(mm[k].as_py()), 0), MAX_TS_NS) // HOUR_NS for k in ("min", "max"))
    if lo == hi:
        return [(hour_of(lo * HOUR_NS), table)]
    bucket = np.clip(table.column("ts").to_numpy(), 0, MAX_TS_NS) // HOUR_NS
    out = []
    for b in np.unique(bucket):
        part = table.filter(pa.array(bucket == b))
        out.append((hour_of(int(b) * HOUR_NS), part))
    return out


class LakeWriter:
    """Lands tables into one lake root. Not thread-safe; one writer per source partition.

    ``crash_at`` names a seam where the process exits with status 137 (tests only):
    ``before_rename`` (temp files durable, nothing renamed) or ``mid_rename`` (a multi-hour
    flush with its first file renamed); a suffix ``@N`` crashes at the N-th time it is reached.

    ``fsyncs`` and ``fsync_s`` count the fsync calls made so far and the seconds they blocked
    (a flush's durability cost, reported apart from its CPU).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        row_group_rows: int = 1 << 20,
        crash_at: str | None = None,
    ) -> None:
        self.paths = LakePaths(root)
        self.root = self.paths.root
        self.row_group_rows = row_group_rows
        self.seam = CrashSeam(crash_at)
        self._seeded: set[str] = set()
        self.fsyncs = 0
        self.fsync_s = 0.0

    def _sync(self, fsync: Callable[[Path], None], path: Path) -> None:
        t0 = time.perf_counter()
        fsync(path)
        self.fsync_s += time.perf_counter() - t0
        self.fsyncs += 1

    # --- landing --------------------------------------------------------------------------

    def land(
        self, dataset: str, table: pa.Table, *, partition: int, first: int, last: int
    ) -> list[Path]:
        """Durably land ``table`` as the rows of source offsets ``first..last`` of
        ``partition``. Returns the files written (none for an empty table). Blocks on fsync.

        Raises LakeError for a bad dataset/partition/range, ValueError when the table does not
        fit the dataset schema; OSError from the file system propagates (nothing is renamed
        then, so nothing becomes visible).
        """
        ds = DATASETS.get(dataset) if isinstance(dataset, str) else None
        if ds is None:
            raise LakeError(f"unknown dataset {dataset!r}")
        name = file_name(partition, first, last)
        self.ensure_seed(dataset)
        if table.num_rows == 0:
            return []
        table = conform(table, ds.schema)
        parts = self._split_by_hour(table)
        opts = landing_options(ds, self.row_group_rows)
        moves: list[tuple[Path, Path]] = []
        try:
            for (date, hour), part in parts:
                hdir = self.paths.hour_dir(dataset, date, hour)
                hdir.mkdir(parents=True, exist_ok=True)
                tmp = hdir / f".land-{name[:-8]}{PARTIAL_SUFFIX}"
                moves.append((tmp, hdir / name))
                pq.write_table(sort_table(encode_strings(part), ds.sort_by), tmp, **opts)
                self._sync(fsync_file, tmp)
            manifest = self._write_manifest(dataset, name, moves) if len(moves) > 1 else None
            self.seam.reach("before_rename")
            for i, (tmp, final) in enumerate(moves):
                os.replace(tmp, final)
                if i == 0:
                    self.seam.reach("mid_rename")
            for d in {final.parent for _, final in moves}:
                self._sync(fsync_dir, d)
            if manifest is not None:
                manifest.unlink()
                self._sync(fsync_dir, manifest.parent)
        except BaseException:
            for tmp, _ in moves:
                tmp.unlink(missing_ok=True)
            raise
        return [final for _, final in moves]

    def _split_by_hour(self, table: pa.Table) -> list[tuple[tuple[str, str], pa.Table]]:
        return split_by_hour(table)

    def _write_manifest(self, dataset: str, name: str, moves: list[tuple[Path, Path]]) -> Path:
        ldir = self.paths.landing_dir(dataset)
        ldir.mkdir(parents=True, exist_ok=True)
        doc = [[str(t.relative_to(self.root)), str(f.relative_to(self.root))] for t, f in moves]
        path = ldir / (name[:-8] + ".json")
        tmp = ldir / (name[:-8] + ".json.partial")
        tmp.write_text(json.dumps(doc))
        self._sync(fsync_file, tmp)
        os.replace(tmp, path)
        self._sync(fsync_dir, ldir)
        return path

    def ensure_seed(self, dataset: str) -> None:
        """Keep a zero-row ``seed.parquet`` with the dataset's current schema, so views over a
        dataset with no data yet still bind and every column exists (union_by_name)."""
        if dataset in self._seeded:
            return
        schema = DATASETS[dataset].schema
        hdir = self.paths.hour_dir(dataset, "1970-01-01", "00")
        seed = hdir / SEED_NAME
        if seed.exists() and pq.read_schema(seed).remove_metadata().equals(schema):
            self._seeded.add(dataset)
            return
        hdir.mkdir(parents=True, exist_ok=True)
        # a name of its own: landers sharing a lake may seed it at the same moment
        tmp = hdir / f".seed-{os.getpid()}-{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"
        write_parquet_durably(schema.empty_table(), tmp, write_options(schema, 1024))
        os.replace(tmp, seed)
        fsync_dir(hdir)
        self._seeded.add(dataset)

    def ensure_seeds(self) -> None:
        """ensure_seed for every dataset."""
        for dataset in DATASETS:
            self.ensure_seed(dataset)

    # --- reading back ----------------------------------------------------------------------

    def landed_high_water(self, dataset: str) -> dict[int, int]:
        """``{partition: last landed offset}`` from the file names in the lake. Call
        :meth:`recover` first: a flush still in flight does not count."""
        hw: dict[int, int] = {}
        for f in self.paths.data_files(dataset):
            if f.last > hw.get(f.partition, -1):
                hw[f.partition] = f.last
        return hw

    def reader(self) -> None:
        """The DuckDB connection that reads this lake's files: None, the default one does."""
        return None

    def live_paths(self, dataset: str, partition: int | None = None) -> list[Path]:
        """Data files a reader should read (covered compaction inputs left out)."""
        return [
            f.path
            for f in live_files(self.paths.data_files(dataset))
            if partition is None or f.partition == partition
        ]

    def recover(self, dataset: str, partitions: set[int] | None = None) -> int:
        """Finish or undo landings a crash interrupted; returns files renamed or removed.

        Flushes of ``partitions`` (all when None) with a manifest are rolled forward (every
        temp renamed). Other ``.land-`` temps of ``partitions`` are removed: their offsets
        were never committed, so they will be consumed again. Call only while no other writer
        is landing those partitions; another lander's partitions are not touched.
        """
        n = 0
        ldir = self.paths.landing_dir(dataset)
        if ldir.is_dir():
            for m in sorted(ldir.iterdir()):
                part = m.name[1:].split("-", 1)[0]
                if partitions is not None and not (part.isdigit() and int(part) in partitions):
                    continue  # another lander's flush (a manifest is p<partition>-...)
                if m.name.endswith(".partial"):
                    m.unlink()
                    continue
                for tmp_rel, final_rel in json.loads(m.read_text()):
                    tmp = self.paths.inside(self.root / tmp_rel)
                    final = self.paths.inside(self.root / final_rel)
                    if tmp.exists():
                        os.replace(tmp, final)
                        fsync_dir(final.parent)
                        n += 1
                m.unlink()
            fsync_dir(ldir)
        for _, _, hdir in self.paths.hour_dirs(dataset):
            for entry in os.listdir(hdir):
                if not (entry.startswith(".land-p") and entry.endswith(PARTIAL_SUFFIX)):
                    continue
                part = entry[len(".land-p") :].split("-", 1)[0]
                if partitions is None or (part.isdigit() and int(part) in partitions):
                    (hdir / entry).unlink(missing_ok=True)
                    n += 1
        return n
