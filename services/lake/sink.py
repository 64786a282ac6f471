"""The types the landing service knows a lake by: :class:`LakeSink` (what lands tables),
:class:`BatchLakeSink` with its :class:`Flush` (a sink committing a dataset's flush at once:
Iceberg) and :class:`LakeCompaction`. Implementations: :mod:`services.lake.writer`,
:mod:`~services.lake.objwriter`, :mod:`~services.lake.iceberg_sink`; chosen by
:mod:`services.lake.backend`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import duckdb
import numpy as np
import pyarrow as pa

from services.lake.compact import CompactionReport
from services.lake.writer import CrashSeam


class LakeSink(Protocol):
    """What lands tables: :class:`LakeWriter` or :class:`ObjectLakeWriter`."""

    seam: CrashSeam

    def land(
        self, dataset: str, table: pa.Table, *, partition: int, first: int, last: int
    ) -> Sequence[Path | str]: ...

    def recover(self, dataset: str, partitions: set[int] | None = None) -> int: ...

    def landed_high_water(self, dataset: str) -> dict[int, int]: ...

    def live_paths(self, dataset: str, partition: int | None = None) -> Sequence[Path | str]: ...

    def ensure_seed(self, dataset: str) -> None: ...

    def ensure_seeds(self) -> None: ...

    def reader(self) -> duckdb.DuckDBPyConnection | None: ...


@dataclass(frozen=True)
class Flush:
    """One source partition's share of a flush: offsets ``first..last``, their rows (None or
    empty when none decoded) and the Kafka offset of each row (None: unknown)."""

    partition: int
    first: int
    last: int
    table: pa.Table | None
    row_offsets: np.ndarray | None = None


@runtime_checkable
class BatchLakeSink(LakeSink, Protocol):
    """A sink that commits every partition of a dataset's flush at once (Iceberg)."""

    def land_flushes(self, dataset: str, flushes: Sequence[Flush]) -> Sequence[Path | str]: ...


class LakeCompaction(Protocol):
    """What compacts: :class:`Compactor` or :class:`ObjectCompactor`."""

    def recover(self, dataset: str) -> int: ...

    def compact_hour(
        self, dataset: str, date: str, hour: str, *, wait: bool = True
    ) -> CompactionReport: ...

    def compact_closed(
        self,
        datasets: list[str] | None = None,
        *,
        close_after_s: float = 600.0,
        wait: bool = False,
    ) -> CompactionReport: ...
