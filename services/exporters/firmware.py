"""The firmware exporter: runs the configured sources (ethtool, Redfish, kernel log), each
optional, and hands their rows to a sink.

A failing source never stops the others: its exception is caught, and :class:`SourceHealth`
keeps a per-source error count and the last error string (the CLI feeds these into its
OpenTelemetry counters; nothing here touches a global registry). Only ``KeyboardInterrupt`` and
``SystemExit`` pass through.

Sources implement ``name`` and ``collect(now_ns)`` returning one of
:class:`~services.exporters.ethtool.EthtoolStats`,
:class:`~services.exporters.redfish.RedfishReading` or a ``pa.Table`` of events
(:class:`KernelLogSource`).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, tzinfo
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from schemas.wire import ClockBlock
from services.exporters.ethtool import EthtoolStats
from services.exporters.kmsg import parse_dmesg, parse_kmsg
from services.exporters.redfish import RedfishReading

MAX_READ = 16 * 1024 * 1024


class FirmwareSource(Protocol):
    name: str

    def collect(self, now_ns: int) -> Any: ...


@dataclass
class SourceHealth:
    """Per-source accounting, for the service's own telemetry."""

    name: str
    polls: int = 0
    errors: int = 0
    last_error: str | None = None
    last_ok_ns: int | None = None


@dataclass
class FirmwarePoll:
    """The rows of one round over all sources."""

    samples: list[pa.Table] = field(default_factory=list)
    events: list[pa.Table] = field(default_factory=list)
    clock: ClockBlock | None = None
    notes: list[str] = field(default_factory=list)  # skipped/absent/disagreement summaries


class KernelLogSource:
    """Follow a kernel log: a saved ``dmesg -T`` / raw kmsg file (by inode and offset; only
    complete lines; a replaced or truncated file is read again), or the live ``/dev/kmsg``
    character device (one record per read, non-blocking; starts at the end of the ring buffer
    unless ``from_start``)."""

    def __init__(
        self,
        path: Path,
        *,
        raw_kmsg: bool,
        boot_ns: int | None = None,
        gpu_by_pci: Mapping[str, str] | None = None,
        tz: tzinfo = UTC,
        from_start: bool = True,
    ) -> None:
        self.path = path
        self.name = f"{'kmsg' if raw_kmsg else 'dmesg'}:{path}"
        self._raw = raw_kmsg
        self._boot_ns = boot_ns
        self._gpus = dict(gpu_by_pci or {})
        self._tz = tz
        self._from_start = from_start
        self._inode: int | None = None
        self._offset = 0
        self._fd: int | None = None

    def _text(self) -> str:
        st = os.stat(self.path)
        if stat.S_ISCHR(st.st_mode):
            return self._read_device()
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset = st.st_ino, 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read(MAX_READ)
        end = chunk.rfind(b"\n")
        if end < 0:
            return ""
        self._offset += end + 1
        return chunk[: end + 1].decode("utf-8", "replace")

    def _read_device(self) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            if not self._from_start:
                os.lseek(self._fd, 0, os.SEEK_END)
        records: list[str] = []
        while len(records) < 100_000:
            try:
                rec = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten before we read it: records lost
                    continue
                raise
            if not rec:
                break
            records.append(rec.decode("utf-8", "replace").split("\n", 1)[0])
        return "\n".join(records)

    def collect(self, now_ns: int) -> pa.Table:
        text = self._text()
        if self._raw:
            return parse_kmsg(text, self._gpus, self._boot_ns)
        return parse_dmesg(text, self._gpus, self._tz, self._boot_ns)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FirmwareExporter:
    """Poll every source once per :meth:`poll`; never raises for a source's failure."""

    def __init__(
        self, sources: Sequence[FirmwareSource], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.sources = list(sources)
        self.health = {s.name: SourceHealth(s.name) for s in self.sources}
        self._clock = clock

    def poll(self) -> FirmwarePoll:
        out = FirmwarePoll()
        for src in self.sources:
            h = self.health[src.name]
            h.polls += 1
            now = self._clock()
            try:
                result = src.collect(now)
            except Exception as e:  # one source's failure must not stop the others
                h.errors += 1
                h.last_error = f"{type(e).__name__}: {e}"[:500]
                continue
            h.last_ok_ns = now
            self._take(src.name, result, out)
        return out

    @staticmethod
    def _take(name: str, result: object, out: FirmwarePoll) -> None:
        if isinstance(result, EthtoolStats):
            out.samples.append(result.table)
            if result.skipped or result.collisions:
                out.notes.append(
                    f"{name}: {len(result.skipped)} counters not in the catalog, "
                    f"{len(result.collisions)} name collisions"
                )
        elif isinstance(result, RedfishReading):
            out.samples.append(result.samples)
            out.events.append(result.events)
            out.clock = result.clock or out.clock
            if result.absent or result.disagreements:
                out.notes.append(
                    f"{name}: {len(result.absent)} absent sensors skipped, "
                    f"{len(result.disagreements)} disagreements"
                )
        elif isinstance(result, pa.Table):
            out.events.append(result)
