"""procfs readers for the node exporter, and the sample buffer every node collector fills.

Each ``read_*`` function takes the procfs root (``/proc`` or a fixture tree), a timestamp and a
:class:`SampleBuffer`, appends what it found and returns nothing. A missing or unreadable file
adds nothing; a malformed line is skipped. None of them raises for any file content, so one
odd file never costs the rest of a scrape.

Readings are sent as read (USER_HZ ticks, kB, µs); the catalog's ``scale`` converts them into
the documented unit downstream. Counters carry the exact reading in ``raw`` and ``float(raw)``
in ``value``; gauges carry ``value`` only; non-numeric readings go to ``text`` with NULL value.
"""

from __future__ import annotations

import os
from collections.abc import Container
from pathlib import Path

import pyarrow as pa

from schemas.wire import SAMPLES_SCHEMA

_U64_MAX = (1 << 64) - 1


def read_bytes(path: str, *, whole: bool = False) -> bytes | None:
    """The content of a small file, or None when it cannot be read. Never raises.

    Uses raw ``os.open``/``os.read``: about a third of the cost of ``open().read()``, which
    matters at hundreds of sysfs files per scrape. A sysfs attribute (at most a page) comes back
    in one read; ``whole=True`` reads on to end of file, as procfs files need.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        first = os.read(fd, 65536)
        if not whole or not first:
            return first
        chunks = [first]
        while b := os.read(fd, 65536):
            chunks.append(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


class SampleBuffer:
    """Rows of one batch, column by column, turned into a :data:`SAMPLES_SCHEMA` table.

    ``metrics``, when given, is the set of catalog names (and aliases) allowed in; a row for any
    other name is dropped and its name remembered in :attr:`unknown`.
    """

    def __init__(self, metrics: Container[str] | None = None) -> None:
        self._allowed = metrics
        self.ts: list[int] = []
        self.metric: list[str] = []
        self.device: list[str] = []
        self.value: list[float | None] = []
        self.raw: list[int | None] = []
        self.text: list[str | None] = []
        self.unknown: set[str] = set()
        self._known: set[str] = set()

    def __len__(self) -> int:
        return len(self.ts)

    def _ok(self, metric: str) -> bool:
        if metric in self._known or self._allowed is None:
            return True
        if metric in self._allowed:
            self._known.add(metric)  # a plain set lookup is cheaper than the catalog's
            return True
        self.unknown.add(metric)
        return False

    def _row(
        self, ts: int, metric: str, device: str, v: float | None, r: int | None, t: str | None
    ) -> None:
        self.ts.append(ts)
        self.metric.append(metric)
        self.device.append(device)
        self.value.append(v)
        self.raw.append(r)
        self.text.append(t)

    def gauge(self, ts: int, metric: str, device: str, value: float) -> None:
        """A gauge, bitmask, enum or event reading."""
        if self._ok(metric):
            self._row(ts, metric, device, float(value), None, None)

    def counter(self, ts: int, metric: str, device: str, raw: int) -> None:
        """A cumulative counter: exact ``raw``; a negative or oversized reading keeps only
        ``value`` so that validation (not this exporter) rejects it with a reason."""
        if self._ok(metric):
            exact = raw if 0 <= raw <= _U64_MAX else None
            self._row(ts, metric, device, float(raw), exact, None)

    def text_reading(self, ts: int, metric: str, device: str, text: str) -> None:
        """A non-numeric reading as read (``N/A (no PMA)``); value stays NULL."""
        if self._ok(metric):
            self._row(ts, metric, device, None, None, text)

    def reading(self, ts: int, metric: str, device: str, data: bytes, counter: bool) -> None:
        """A sysfs-style reading: an integer (counter or gauge), else a float gauge, else text."""
        s = data.strip()
        try:
            n = int(s)
        except ValueError:
            try:
                if counter:
                    raise ValueError
                self.gauge(ts, metric, device, float(s))
            except ValueError:
                self.text_reading(ts, metric, device, s.decode("utf-8", "replace")[:256])
            return
        if counter:
            self.counter(ts, metric, device, n)
        else:
            self.gauge(ts, metric, device, n)

    def extend(self, other: SampleBuffer) -> None:
        """Append another buffer's rows (already filtered by its own allow-list)."""
        self.ts += other.ts
        self.metric += other.metric
        self.device += other.device
        self.value += other.value
        self.raw += other.raw
        self.text += other.text
        self.unknown |= other.unknown

    def to_table(self) -> pa.Table:
        """The rows as a table conforming to :data:`SAMPLES_SCHEMA`."""
        return pa.Table.from_arrays(
            [
                pa.array(self.ts, pa.int64()),
                pa.array(self.metric, pa.string()),
                pa.array(self.device, pa.string()),
                pa.array(self.value, pa.float64()),
                pa.array(self.raw, pa.uint64()),
                pa.array(self.text, pa.string()),
            ],
            schema=SAMPLES_SCHEMA,
        )


_CPU_FIELDS = (
    "cpu.user_seconds",
    "cpu.nice_seconds",
    "cpu.system_seconds",
    "cpu.idle_seconds",
    "cpu.iowait_seconds",
    "cpu.irq_seconds",
    "cpu.softirq_seconds",
    "cpu.steal_seconds",
    "cpu.guest_seconds",
    "cpu.guest_nice_seconds",
)
_STAT_SCALARS = {
    b"ctxt": ("cpu.context_switches", True),
    b"intr": ("cpu.interrupts", True),
    b"processes": ("cpu.forks", True),
    b"procs_running": ("cpu.procs_running", False),
    b"procs_blocked": ("cpu.procs_blocked", False),
    b"btime": ("cpu.boot_time", False),
}


def read_stat(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/stat``: per-CPU times (device ``cpuN``, summary line ``all``) and the node-wide
    scalars (device ``node``). The ``intr`` line can be 100 kB: only its first number is read."""
    data = read_bytes(f"{procfs}/stat", whole=True)
    if data is None:
        return
    for line in data.split(b"\n"):
        if line.startswith(b"cpu"):
            parts = line.split()
            dev = "all" if parts[0] == b"cpu" else parts[0].decode()
            for metric, field in zip(_CPU_FIELDS, parts[1:], strict=False):
                try:
                    buf.counter(ts, metric, dev, int(field))
                except ValueError:
                    break
            continue
        key, _, rest = line.partition(b" ")
        spec = _STAT_SCALARS.get(key)
        if spec is None:
            continue
        first = rest.lstrip().split(b" ", 1)[0]
        try:
            n = int(first)
        except ValueError:
            continue
        if spec[1]:
            buf.counter(ts, spec[0], "node", n)
        else:
            buf.gauge(ts, spec[0], "node", n)


_MEMINFO = {
    b"MemTotal": "mem.total_bytes",
    b"MemFree": "mem.free_bytes",
    b"MemAvailable": "mem.available_bytes",
    b"Buffers": "mem.buffers_bytes",
    b"Cached": "mem.cached_bytes",
    b"SwapCached": "mem.swap_cached_bytes",
    b"Active": "mem.active_bytes",
    b"Inactive": "mem.inactive_bytes",
    b"Unevictable": "mem.unevictable_bytes",
    b"Mlocked": "mem.mlocked_bytes",
    b"SwapTotal": "mem.swap_total_bytes",
    b"SwapFree": "mem.swap_free_bytes",
    b"Dirty": "mem.dirty_bytes",
    b"Writeback": "mem.writeback_bytes",
    b"AnonPages": "mem.anon_bytes",
    b"Mapped": "mem.mapped_bytes",
    b"Shmem": "mem.shmem_bytes",
    b"Slab": "mem.slab_bytes",
    b"SReclaimable": "mem.slab_reclaimable_bytes",
    b"SUnreclaim": "mem.slab_unreclaimable_bytes",
    b"KernelStack": "mem.kernel_stack_bytes",
    b"PageTables": "mem.page_tables_bytes",
    b"CommitLimit": "mem.commit_limit_bytes",
    b"Committed_AS": "mem.committed_bytes",
    b"HardwareCorrupted": "mem.hardware_corrupted_bytes",
    b"AnonHugePages": "mem.anon_hugepages_bytes",
    b"Hugepagesize": "mem.hugepage_size_bytes",
    b"HugePages_Total": "mem.hugepages_total",
    b"HugePages_Free": "mem.hugepages_free",
    b"HugePages_Rsvd": "mem.hugepages_reserved",
    b"HugePages_Surp": "mem.hugepages_surplus",
}


def read_meminfo(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/meminfo`` (device ``node``); kB readings are sent in kB (catalog scale 1024)."""
    data = read_bytes(f"{procfs}/meminfo", whole=True)
    if data is None:
        return
    for line in data.split(b"\n"):
        key, _, rest = line.partition(b":")
        metric = _MEMINFO.get(key)
        if metric is None:
            continue
        try:
            buf.gauge(ts, metric, "node", int(rest.split()[0]))
        except (ValueError, IndexError):
            continue


def read_loadavg(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/loadavg``: 1, 5 and 15 minute load averages (device ``node``)."""
    data = read_bytes(f"{procfs}/loadavg", whole=True)
    if data is None:
        return
    for metric, field in zip(
        ("cpu.load1", "cpu.load5", "cpu.load15"), data.split()[:3], strict=False
    ):
        try:
            buf.gauge(ts, metric, "node", float(field))
        except ValueError:
            return


def read_pressure(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/pressure/{cpu,io,memory,irq}`` (PSI, device ``node``): avg10/60/300 in % and the
    stall total in µs (a counter). Kernels without PSI have no such directory."""
    for res in ("cpu", "io", "memory", "irq"):
        data = read_bytes(f"{procfs}/pressure/{res}", whole=True)
        if data is None:
            continue
        for line in data.split(b"\n"):
            parts = line.split()
            if not parts or parts[0] not in (b"some", b"full"):
                continue
            prefix = f"psi.{res}_{parts[0].decode()}"
            for kv in parts[1:]:
                k, _, v = kv.partition(b"=")
                try:
                    if k == b"total":
                        buf.counter(ts, f"{prefix}_seconds", "node", int(v))
                    elif k.startswith(b"avg"):
                        buf.gauge(ts, f"{prefix}_{k.decode()}", "node", float(v))
                except ValueError:
                    continue


NETDEV_METRICS = (
    "net.rx_bytes",
    "net.rx_packets",
    "net.rx_errors",
    "net.rx_dropped",
    "net.rx_fifo_errors",
    "net.rx_frame_errors",
    "net.rx_compressed",
    "net.rx_multicast",
    "net.tx_bytes",
    "net.tx_packets",
    "net.tx_errors",
    "net.tx_dropped",
    "net.tx_fifo_errors",
    "net.collisions",
    "net.tx_carrier_errors",
    "net.tx_compressed",
)


def read_net_dev(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/net/dev``: the 16 per-interface counters (device ``<iface>``)."""
    data = read_bytes(f"{procfs}/net/dev", whole=True)
    if data is None:
        return
    for line in data.split(b"\n")[2:]:
        name, sep, rest = line.partition(b":")
        if not sep:
            continue
        dev = name.strip().decode("utf-8", "replace")
        fields = rest.split()
        if len(fields) < 16:
            continue
        try:
            values = [int(f) for f in fields[:16]]
        except ValueError:
            continue
        for metric, n in zip(NETDEV_METRICS, values, strict=True):
            buf.counter(ts, metric, dev, n)


# /proc/diskstats field index (0-based after major, minor, name) → (metric, is_counter)
_DISKSTATS = (
    (0, "nvme.reads", True),
    (2, "nvme.read_bytes", True),
    (3, "nvme.read_time", True),
    (4, "nvme.writes", True),
    (6, "nvme.write_bytes", True),
    (7, "nvme.write_time", True),
    (8, "nvme.io_in_progress", False),
    (9, "nvme.io_time", True),
)


def _is_nvme_namespace(name: bytes) -> bool:
    # nvme0n1, not the partitions nvme0n1p1 (their I/O is already in the namespace's numbers)
    if not name.startswith(b"nvme"):
        return False
    ctrl, n, ns = name[4:].partition(b"n")
    return bool(n) and ctrl.isdigit() and ns.isdigit()


def read_diskstats_nvme(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """``/proc/diskstats`` for NVMe namespaces (device ``nvmeXnY``); sectors are 512 B."""
    data = read_bytes(f"{procfs}/diskstats", whole=True)
    if data is None:
        return
    for line in data.split(b"\n"):
        parts = line.split()
        if len(parts) < 14 or not _is_nvme_namespace(parts[2]):
            continue
        dev = parts[2].decode()
        stats = parts[3:]
        for idx, metric, counter in _DISKSTATS:
            try:
                n = int(stats[idx])
            except ValueError:
                continue
            if counter:
                buf.counter(ts, metric, dev, n)
            else:
                buf.gauge(ts, metric, dev, n)


def read_boot_id(procfs: Path) -> str:
    """``/proc/sys/kernel/random/boot_id``, or ``unknown`` when absent (fixture trees)."""
    data = read_bytes(f"{procfs}/sys/kernel/random/boot_id", whole=True)
    text = data.decode("ascii", "replace").strip() if data else ""
    return text or "unknown"


def collect_procfs(procfs: Path, ts: int, buf: SampleBuffer) -> None:
    """Every procfs reader above, in order."""
    read_stat(procfs, ts, buf)
    read_meminfo(procfs, ts, buf)
    read_loadavg(procfs, ts, buf)
    read_pressure(procfs, ts, buf)
    read_net_dev(procfs, ts, buf)
    read_diskstats_nvme(procfs, ts, buf)
