"""Row layout of one exporter's batch and the cheap construction of its per-node tables.

Every node's batch of one exporter has the same rows: ``substeps x entries`` where an entry is
a ``(device, metric)`` pair. The ``metric``, ``device`` and ``text`` columns and the validity of
``raw`` are therefore built once; a tick only fills the numeric columns, for all nodes at once,
and each node's table is a zero-copy view over its slice of those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from schemas.wire import SAMPLES_SCHEMA


@dataclass(frozen=True)
class Layout:
    """``entries`` repeated ``substeps`` times; ``counter[e]`` says whether entry e has raw."""

    devices: tuple[str, ...]
    metrics: tuple[str, ...]
    counter: tuple[bool, ...]
    substeps: int

    @property
    def n_entries(self) -> int:
        return len(self.metrics)

    @property
    def rows(self) -> int:
        return self.n_entries * self.substeps


class TableBuilder:
    """Builds per-node SAMPLES tables from ``(N, S, E)`` value and raw arrays; never blocks."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        s = layout.substeps
        self._metric = pa.array(list(layout.metrics) * s, pa.string())
        self._device = pa.array(list(layout.devices) * s, pa.string())
        self._text = pa.nulls(layout.rows, pa.string())
        mask = np.tile(np.asarray(layout.counter, dtype=bool), s)
        self._raw_validity = pa.array(mask).buffers()[1]
        self._raw_nulls = int((~mask).sum())
        self._is_counter = np.asarray(layout.counter, dtype=bool)

    def tables(self, ts: np.ndarray, value: np.ndarray, raw: np.ndarray) -> list[pa.Table]:
        """``ts`` (N, S) int64 source-clock times; ``value`` (N, S, E) float64; ``raw`` (N, S, E)
        uint64 (ignored where the entry is a gauge). One table per node, SAMPLES_SCHEMA."""
        n, s, e = value.shape
        rows = s * e
        ts_rows = np.ascontiguousarray(np.repeat(ts.astype(np.int64), e, axis=1))
        val = np.ascontiguousarray(value.reshape(n, rows), dtype=np.float64)
        rw = np.ascontiguousarray(raw.reshape(n, rows), dtype=np.uint64)
        out = []
        for i in range(n):
            cols = [
                pa.array(ts_rows[i]),
                self._metric,
                self._device,
                pa.array(val[i]),
                pa.Array.from_buffers(
                    pa.uint64(),
                    rows,
                    [self._raw_validity, pa.py_buffer(rw[i])],
                    null_count=self._raw_nulls,
                ),
                self._text,
            ]
            out.append(pa.Table.from_arrays(cols, schema=SAMPLES_SCHEMA))
        return out

    def merge_values(self, gauge: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """The ``value`` column: the raw reading as float for counters, else the gauge."""
        return np.where(self._is_counter, raw.astype(np.float64), gauge)
