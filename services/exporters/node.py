"""The node exporter's collector: procfs, sysfs (IB/RoCE, net, PCIe AER, thermal, hwmon, NVMe,
RAPL), NVML GPUs and the chrony clock block, as one :data:`~schemas.wire.SAMPLES_SCHEMA` table
per scrape.

- :func:`collect_node` is the one-shot form (discovers, reads, returns a table).
- :class:`NodeCollector` is the long-running form: it keeps the sysfs file plan (directory
  listings) between scrapes, rediscovers every ``rescan_every`` scrapes (hot-plugged HCAs,
  new interfaces), keeps the fast tier's files open (``pread`` at offset 0; at most
  ``max_open_files``), reads the slow tier (PCIe AER and link state, net error details, NVMe
  state, RAPL limits, temperature limits) every ``slow_every`` scrapes and chrony every
  ``clock_every`` scrapes, and numbers batches with a ``seq`` that keeps increasing across
  restarts (``initial_seq``).
- :func:`bench_scrape` measures CPU seconds per scrape (``time.process_time``).

Every row's ``metric`` is a catalog name (rows for names missing from the catalog are dropped
and listed in :attr:`NodeCollector.unknown`). Scraping never raises for file contents; only a
programming error would escape.

Example::

    >>> from pathlib import Path
    >>> from schemas.catalog import default_catalog
    >>> t = collect_node(Path("/proc"), Path("/sys"), now_ns=0, catalog=default_catalog())
    >>> "cpu.user_seconds" in t.column("metric").to_pylist()
    True
"""

from __future__ import annotations

import itertools
import socket
import time
from pathlib import Path

import pyarrow as pa

from schemas.catalog import Catalog
from schemas.wire import ClockBlock, Envelope, SourceId
from services.exporters.chrony import Tracking, read_chrony
from services.exporters.nvml import NvmlCollector
from services.exporters.procfs import SampleBuffer, collect_procfs, read_boot_id
from services.exporters.sysfs import OpenFiles, SysfsPlan, discover, read_entries
from services.kafka.producer import initial_seq

EXPORTER = "node"


def node_source(procfs: Path, *, node: str | None = None, instance: str = "0") -> SourceId:
    """Source identity: hostname, exporter ``node``, instance, boot_id from procfs."""
    return SourceId(
        node=node or socket.gethostname().split(".")[0] or "localhost",
        exporter=EXPORTER,
        instance=instance,
        boot_id=read_boot_id(procfs),
    )


class NodeCollector:
    """Scrapes one node repeatedly at low cost. Not thread-safe; one scrape at a time.

    ``gpus`` opens NVML (absent → no GPU rows, reason in :attr:`gpu_reason`); ``clock`` runs
    ``chronyc`` (absent → no clock block). Both are off for fixture trees in tests.
    """

    def __init__(
        self,
        procfs: Path,
        sysfs: Path,
        *,
        catalog: Catalog,
        gpus: bool = False,
        clock: bool = False,
        slow_every: int = 10,
        rescan_every: int = 60,
        clock_every: int = 16,
        max_open_files: int = 512,
    ) -> None:
        self.procfs = procfs
        self.sysfs = sysfs
        self.catalog = catalog
        self.slow_every = max(1, slow_every)
        self.rescan_every = max(1, rescan_every)
        self.clock_every = max(1, clock_every)
        self._plan: SysfsPlan | None = None
        self._files = OpenFiles(max_open=max_open_files)
        self._scrapes = 0
        self._seq = itertools.count(initial_seq())
        self._nvml = NvmlCollector() if gpus else None
        self._clock_enabled = clock
        self._tracking: Tracking | None = None
        self.unknown: set[str] = set()

    @property
    def gpu_reason(self) -> str | None:
        """Why there are no GPU rows (None when NVML works or GPUs were not asked for)."""
        return None if self._nvml is None else self._nvml.reason

    @property
    def plan(self) -> SysfsPlan:
        if self._plan is None or self._scrapes % self.rescan_every == 0:
            self._plan = discover(self.sysfs, self.catalog)
            self._files.retain({e.path for e in self._plan.fast})
        return self._plan

    def scrape(self, now_ns: int | None = None) -> pa.Table:
        """One scrape: a table conforming to SAMPLES_SCHEMA, every row stamped ``now_ns``."""
        ts = time.time_ns() if now_ns is None else now_ns
        buf = SampleBuffer(self.catalog)
        plan = self.plan
        collect_procfs(self.procfs, ts, buf)
        read_entries(plan.fast, ts, buf, self._files)
        if self._scrapes % self.slow_every == 0:
            read_entries(plan.slow, ts, buf)
        if self._nvml is not None:
            self._nvml.collect(ts, buf)
        if self._clock_enabled:
            if self._scrapes % self.clock_every == 0:
                self._tracking = read_chrony()
            if self._tracking is not None:
                self._tracking.add_samples(ts, buf)
        self._scrapes += 1
        self.unknown |= buf.unknown
        return buf.to_table()

    def clock_block(self) -> ClockBlock | None:
        """The latest chrony view (refreshed by :meth:`scrape`), or None."""
        return None if self._tracking is None else self._tracking.clock_block()

    def envelope(
        self, source: SourceId, *, sent_ns: int, interval_ns: int | None = None
    ) -> Envelope:
        """The next batch header: ``seq`` increases by one per call for this process."""
        return Envelope(
            source=source,
            seq=next(self._seq),
            sent_ns=sent_ns,
            interval_ns=interval_ns,
            clock=self.clock_block(),
        )

    def close(self) -> None:
        """Close held sysfs descriptors and the NVML session."""
        self._files.close()
        if self._nvml is not None:
            self._nvml.close()


def collect_node(procfs: Path, sysfs: Path, *, now_ns: int, catalog: Catalog) -> pa.Table:
    """One scrape of procfs and sysfs (both tiers, no NVML, no chrony) as a SAMPLES_SCHEMA table."""
    c = NodeCollector(procfs, sysfs, catalog=catalog)
    try:
        return c.scrape(now_ns)
    finally:
        c.close()


def bench_scrape(
    procfs: Path, sysfs: Path, n: int, *, catalog: Catalog | None = None
) -> dict[str, float]:
    """CPU seconds per scrape over ``n`` scrapes of one long-lived :class:`NodeCollector`
    (tiers and rescans amortised as in production), and the share of one core that costs at a
    1 s interval. The first scrape (discovery) is measured separately."""
    from schemas.catalog import default_catalog

    cat = catalog or default_catalog()
    c = NodeCollector(procfs, sysfs, catalog=cat)
    t0 = time.process_time()
    first = c.scrape()
    t1 = time.process_time()
    rows = 0
    for _ in range(n):
        rows += c.scrape().num_rows
    t2 = time.process_time()
    c.close()
    per = (t2 - t1) / max(n, 1)
    return {
        "scrapes": float(n),
        "first_scrape_cpu_s": t1 - t0,
        "cpu_s_per_scrape": per,
        "core_share_at_1s": per / 1.0,
        "rows_per_scrape": rows / max(n, 1),
        "first_rows": float(first.num_rows),
    }
