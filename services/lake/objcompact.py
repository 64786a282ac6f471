"""Compaction on object storage: the local protocol (:mod:`services.lake.compact`) without
rename, and a lease object instead of ``flock``.

1. Take the lease ``.compact.lease`` (:class:`Lease`): a JSON object ``{owner, expires}``
   created with ``If-None-Match: *``, or taken over once expired and renewed with
   ``If-Match: <etag>`` — of two compactors, one wins each compare-and-swap.
2. For a partition with two or more live files in an hour, read them, merge and sort as the
   local compactor does, renew the lease (a compactor that lost it stops here), then create
   ``p<part>-<min first>-<max last>.parquet`` with ``If-None-Match: *``: the commit point.
   From then on it covers its inputs and every reader skips them; an object already there
   under that name was made from the same offsets (a retried put, or a compactor that lost
   its lease after committing) and is kept.
3. Renew the lease, then delete covered objects once their cover is older than ``grace_s``.

A crash leaves at worst covered inputs (removed by the next run): single PUTs leave no temp.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from services.lake.compact import SLAB_S, CompactionReport, write_merged
from services.lake.datasets import DATASETS, conform
from services.lake.layout import (
    HOUR_NS,
    LakeError,
    LandedFile,
    file_name,
    live_files,
    parse_file_name,
)
from services.lake.objwriter import hour_prefix, parse_data_files
from services.lake.store import ObjectExists, ObjectStore, PreconditionFailed
from services.lake.writer import CrashSeam, encode_strings, write_options

LEASE_KEY = ".compact.lease"


class LeaseLost(LakeError):
    """Another compactor took the lease (ours expired): stop before the next commit."""


class Lease:
    """An exclusive claim on ``key`` that expires ``ttl_s`` after it was last renewed.
    Every change is a conditional put, so two holders never both succeed. Times come from
    ``clock`` (compactors' clocks are assumed within a fraction of ``ttl_s``)."""

    def __init__(
        self,
        store: ObjectStore,
        key: str = LEASE_KEY,
        *,
        ttl_s: float = 60.0,
        owner: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.key, self.ttl_s, self.clock = store, key, ttl_s, clock
        self.owner = owner or uuid.uuid4().hex
        self.etag: str | None = None

    def _doc(self, expires: float) -> bytes:
        return json.dumps({"owner": self.owner, "expires": expires}).encode()

    def acquire(self) -> bool:
        """One try to take the lease; True when held. Does not wait."""
        info = self.store.head(self.key)
        data = self._doc(self.clock() + self.ttl_s)
        try:
            if info is None:
                self.etag = self.store.put(self.key, data, create=True)
                return True
            doc = json.loads(self.store.get(self.key))
            if doc.get("owner") != self.owner and float(doc.get("expires", 0)) > self.clock():
                return False
            self.etag = self.store.put(self.key, data, if_match=info.etag)
            return True
        except (ObjectExists, PreconditionFailed):
            return False

    def renew(self) -> None:
        """Extend the lease; raises LeaseLost when another holder took it meanwhile."""
        if self.etag is None:
            raise LeaseLost(f"{self.key}: not held")
        try:
            self.etag = self.store.put(
                self.key, self._doc(self.clock() + self.ttl_s), if_match=self.etag
            )
        except PreconditionFailed:
            self.etag = None
            raise LeaseLost(f"{self.key}: taken by another compactor") from None

    def release(self) -> None:
        """Give the lease up (expire it now) if still ours."""
        if self.etag is not None:
            with suppress(PreconditionFailed):
                self.store.put(self.key, self._doc(0.0), if_match=self.etag)
            self.etag = None


@dataclass(frozen=True)
class _Hour:
    files: list[LandedFile]
    modified: dict[str, float]  # key -> the store's modification time


class ObjectCompactor:
    """Compacts hours of a lake on an object store; the contract of
    :class:`~services.lake.compact.Compactor`. ``crash_at`` (tests): the same seams."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        row_group_rows: int = 1 << 20,
        grace_s: float = 30.0,
        compression_level: int = 9,
        slab_s: dict[str, float] | None = None,
        crash_at: str | None = None,
        clock: Callable[[], float] = time.time,
        lease_s: float = 60.0,
    ) -> None:
        self.store = store
        self.slab_ns = {k: int(v * 1e9) for k, v in (SLAB_S if slab_s is None else slab_s).items()}
        self.row_group_rows = row_group_rows
        self.grace_s = grace_s
        self.compression_level = compression_level
        self.seam = CrashSeam(crash_at)
        self.clock = clock
        self.lease = Lease(store, ttl_s=lease_s, clock=clock)

    @contextmanager
    def _leased(self, wait: bool) -> Iterator[bool]:
        while not self.lease.acquire():
            if not wait:
                yield False
                return
            time.sleep(0.5)
        try:
            yield True
        finally:
            self.lease.release()

    def recover(self, dataset: str) -> int:
        """Nothing to clean: every put is whole or absent. Returns 0."""
        if dataset not in DATASETS:
            raise LakeError(f"unknown dataset {dataset!r}")
        return 0

    def _hours(self, dataset: str) -> dict[str, _Hour]:
        """The data objects of ``dataset`` by hour prefix, from one listing."""
        objects = self.store.list(dataset)
        files = parse_data_files(objects)
        modified = {o.key: o.modified for o in objects}
        out: dict[str, _Hour] = {}
        for f in files:
            out.setdefault(str(f.path.parent), _Hour([], modified)).files.append(f)
        return out

    def compact_hour(
        self, dataset: str, date: str, hour: str, *, wait: bool = True
    ) -> CompactionReport:
        """Compact one hour of one dataset. Blocks on the store and, when ``wait``, on
        another compactor's lease; raises LakeError for a bad dataset or hour, LeaseLost."""
        prefix = hour_prefix(dataset, date, hour)
        with self._leased(wait) as held:
            hour_files = self._hours(dataset).get(prefix)
            if not held or hour_files is None:
                return CompactionReport()
            return self._compact(dataset, hour_files)

    def _compact(self, dataset: str, hour: _Hour) -> CompactionReport:
        report = CompactionReport()
        files = list(hour.files)
        by_part: dict[int, list[LandedFile]] = {}
        for f in live_files(files):
            by_part.setdefault(f.partition, []).append(f)
        for part, inputs in sorted(by_part.items()):
            if len(inputs) >= 2:
                out = self._merge(dataset, part, inputs, report)
                if out is not None:
                    files.append(out)
                    hour.modified[str(out.path)] = self.clock()
        report.removed += self._remove_covered(files, hour.modified)
        return report

    def _merge(
        self, dataset: str, part: int, inputs: list[LandedFile], report: CompactionReport
    ) -> LandedFile | None:
        ds = DATASETS[dataset]
        tables = []
        for f in inputs:
            t = pq.read_table(pa.BufferReader(self.store.get(str(f.path))))
            extra = set(t.column_names) - set(ds.schema.names)
            if extra:  # written by a newer schema than ours: do not drop its columns
                report.skipped.append(f"{self.store.url(str(f.path))}: unknown {sorted(extra)}")
                return None
            tables.append(conform(t, ds.schema))
        name = file_name(part, min(f.first for f in inputs), max(f.last for f in inputs))
        key = f"{inputs[0].path.parent}/{name}"
        sink = pa.BufferOutputStream()
        opts = write_options(ds.schema, self.row_group_rows, self.compression_level)
        write_merged(dataset, encode_strings(pa.concat_tables(tables)), sink, opts,
                     self.slab_ns.get(dataset))  # fmt: skip
        self.seam.reach("compact_before_rename")
        self.lease.renew()
        # an object already there was merged from the same offsets: it covers the same inputs
        with suppress(ObjectExists):
            self.store.put(key, sink.getvalue().to_pybytes(), create=True)
        self.seam.reach("compact_after_rename")
        report.written.append(self.store.url(key))
        report.merged += len(inputs)
        out = parse_file_name(inputs[0].path.parent / name)
        assert out is not None
        return out

    def _remove_covered(self, files: list[LandedFile], modified: dict[str, float]) -> int:
        live = live_files(files)
        removed = 0
        now = self.clock()
        for f in files:
            if f in live:
                continue
            cover = next(c for c in live if c.covers(f))
            if now - modified.get(str(cover.path), now) < self.grace_s:
                continue
            if removed == 0:
                self.lease.renew()
            self.store.delete(str(f.path))
            removed += 1
            self.seam.reach("compact_mid_delete")
        return removed

    def compact_closed(
        self,
        datasets: list[str] | None = None,
        *,
        close_after_s: float = 600.0,
        wait: bool = False,
    ) -> CompactionReport:
        """Compact every hour that ended more than ``close_after_s`` ago and has more than
        one live file per partition or covered files to remove (``wait=False``: skip when
        another compactor holds the lease)."""
        report = CompactionReport()
        now_ns = int(self.clock() * 1e9)
        with self._leased(wait) as held:
            if not held:
                return report
            for dataset in datasets or list(DATASETS):
                for prefix, hour in sorted(self._hours(dataset).items()):
                    start_ns = _hour_start_ns(prefix)
                    if start_ns + HOUR_NS + close_after_s * 1e9 > now_ns:
                        continue
                    live = live_files(hour.files)
                    parts = [f.partition for f in live]
                    if len(live) < len(hour.files) or len(parts) != len(set(parts)):
                        report.add(self._compact(dataset, hour))
        return report


def _hour_start_ns(prefix: str) -> int:
    """Start of the hour of ``<ds>/date=D/hour=H`` in ns since the epoch."""
    from datetime import UTC, datetime

    _, d, h = prefix.split("/")
    t = datetime.strptime(f"{d[5:]}T{h[5:]}", "%Y-%m-%dT%H").replace(tzinfo=UTC)
    return int(t.timestamp()) * 1_000_000_000
