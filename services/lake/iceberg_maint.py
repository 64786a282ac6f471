"""Iceberg table maintenance in the lander's loop: snapshot expiry, where the Parquet lake
compacts. pyiceberg 0.12 cannot rewrite data files; compaction of an Iceberg lake is Spark's
``rewrite_data_files`` (docs/lake-iceberg.md).

:class:`IcebergMaintenance` satisfies :class:`~services.lake.backend.LakeCompaction`:
``compact_closed`` expires, in every dataset's table, the snapshots older than ``keep_s``
except the current one and the newest carrying the Kafka offsets
(:func:`~services.lake.iceberg.expire_snapshots`). A commit lost to a concurrent append is
skipped (reported) and done at the next call, as is one whose catalog database cannot be
reached (restarting: the lander's flushes retry it, expiry need not). With the lander's flush
cadence ``max_age_s`` a table holds at most ``keep_s / max_age_s`` (plus one per ``max_rows``
rows landed) + 2 snapshots after expiry, and gains at most ``86400 / max_age_s``
(+ rows / ``max_rows``) a day.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.lake.compact import CompactionReport
from services.lake.datasets import DATASETS
from services.lake.iceberg import expire_snapshots, open_table

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog

log = logging.getLogger(__name__)


class IcebergMaintenance:
    """Snapshot expiry over the tables of ``namespace`` in ``catalog``."""

    def __init__(self, catalog: SqlCatalog, namespace: str, keep_s: float = 3600.0) -> None:
        self.catalog = catalog
        self.namespace = namespace
        self.keep_s = keep_s

    def recover(self, dataset: str) -> int:
        """Nothing to recover: expiry is one catalog commit."""
        return 0

    def compact_hour(
        self, dataset: str, date: str, hour: str, *, wait: bool = True
    ) -> CompactionReport:
        """Not done here (see the module docstring): reported as skipped."""
        return CompactionReport(skipped=[f"{dataset} {date}T{hour}: iceberg (use Spark)"])

    def compact_closed(
        self,
        datasets: list[str] | None = None,
        *,
        close_after_s: float = 600.0,
        wait: bool = False,
    ) -> CompactionReport:
        """Expire old snapshots of ``datasets`` (all when None); ``removed`` counts them."""
        import sqlalchemy.exc
        from pyiceberg.exceptions import CommitFailedException

        report = CompactionReport()
        for ds in datasets or list(DATASETS):
            try:
                table = open_table(self.catalog, self.namespace, ds)
                report.removed += expire_snapshots(table, self.keep_s)
            except CommitFailedException:
                report.skipped.append(f"{ds}: expiry lost to a concurrent commit")
            except sqlalchemy.exc.OperationalError as e:  # the database restarting: next time
                self.catalog.engine.dispose()
                report.skipped.append(f"{ds}: catalog unavailable ({str(e).splitlines()[0]})")
        return report
