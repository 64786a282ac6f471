"""Iceberg table maintenance, where the Parquet lake compacts: closed hours' small files
rewritten (:mod:`services.lake.iceberg_rewrite`), then old snapshots expired.

:class:`IcebergMaintenance` satisfies :class:`~services.lake.backend.LakeCompaction`, so the
lander's loop (every ``compact_every_s``) and ``refinery lake compact`` drive it as they drive
the Parquet compactor. ``compact_closed`` does, in every dataset's table:

1. each hour that ended more than ``close_after_s`` ago (the Parquet compactor's rule) and
   holds two or more data files of a source partition is rewritten in one commit
   (:meth:`~services.lake.iceberg_rewrite.IcebergRewriter.compact_hour`);
2. snapshots older than ``keep_s`` are expired except the current one and the newest
   carrying the Kafka offsets (:func:`~services.lake.iceberg.expire_snapshots`), and the
   files compaction replaced are deleted once no snapshot names them.

A commit lost to a concurrent append is retried by the rewrite (or the hour skipped,
reported) and expiry is done at the next call; a catalog database that cannot be reached
(restarting: the lander's flushes retry it, maintenance need not) or a store that fails
skips the table until the next call. With the lander's flush cadence ``max_age_s`` a table
holds at most ``keep_s / max_age_s`` (plus one per ``max_rows`` rows landed, plus one per
hour compacted) + 2 snapshots after expiry, and gains at most ``86400 / max_age_s``
(+ rows / ``max_rows`` + 24) a day.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.lake.compact import CompactionReport
from services.lake.datasets import DATASETS
from services.lake.iceberg import expire_snapshots, open_table
from services.lake.iceberg_rewrite import IcebergRewriter

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog

log = logging.getLogger(__name__)


class IcebergMaintenance:
    """Compaction and snapshot expiry over the tables of ``namespace`` in ``catalog``;
    ``rewrite`` keywords (crash_at, pause, clock, max_file_rows ...) go to the
    :class:`~services.lake.iceberg_rewrite.IcebergRewriter`."""

    def __init__(
        self, catalog: SqlCatalog, namespace: str, keep_s: float = 3600.0, **rewrite: Any
    ) -> None:
        self.catalog = catalog
        self.namespace = namespace
        self.keep_s = keep_s
        self.rewriter = IcebergRewriter(catalog, namespace, **rewrite)

    def recover(self, dataset: str) -> int:
        """Nothing to recover: a rewrite is one catalog commit (an interrupted one left
        orphan files no snapshot names)."""
        return 0

    def compact_hour(
        self, dataset: str, date: str, hour: str, *, wait: bool = True
    ) -> CompactionReport:
        """Rewrite one hour of ``dataset`` whether closed or not (``wait`` ignored: a
        concurrent compactor is met at the commit)."""
        return self.rewriter.compact_hour(dataset, date, hour)

    def compact_closed(
        self,
        datasets: list[str] | None = None,
        *,
        close_after_s: float = 600.0,
        wait: bool = False,
    ) -> CompactionReport:
        """Rewrite the closed hours of ``datasets`` (all when None), then expire old
        snapshots; ``removed`` counts the snapshots expired."""
        report = CompactionReport()
        for ds in datasets or list(DATASETS):
            try:
                for date, hour in self.rewriter.closed_hours(ds, close_after_s):
                    report.add(self.rewriter.compact_hour(ds, date, hour))
                report.removed += expire_snapshots(
                    open_table(self.catalog, self.namespace, ds), self.keep_s
                )
            except Exception as e:
                if (why := _transient(self.catalog, e)) is None:
                    raise
                report.skipped.append(f"{ds}: {why}")
        return report


def _transient(catalog: SqlCatalog, e: Exception) -> str | None:
    """Why ``e`` is worth skipping the table for until the next call (None: it is not)."""
    from pyiceberg.exceptions import CommitFailedException

    from services.lake.iceberg_sink import connection_lost
    from services.lake.store import StoreError

    if isinstance(e, CommitFailedException):
        return "expiry lost to a concurrent commit"
    if connection_lost(e):  # the database restarting: next time
        catalog.engine.dispose()
        return f"catalog unavailable ({(str(e).splitlines() or [''])[0]})"
    if isinstance(e, OSError | StoreError):
        log.warning("iceberg: maintenance skipped a table: %s", e)
        return f"store unavailable ({(str(e).splitlines() or [''])[0]})"
    return None
