"""The per-row columns of a refining wave that come from each batch rather than each row:
its source, raw position and clock estimate, repeated over the batch's refined rows, and the
rows' aligned time (:mod:`pipelines.refine.wave`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column, repeat_strings
from pipelines.refine.aligned import in_int64
from pipelines.refine.clock import ClockEstimate
from pipelines.refine.types import RawBatch
from schemas.wire import SourceId

SOURCE_COLUMNS = (
    "exporter", "instance", "boot_id", "seq", "raw_partition", "raw_offset", "raw_topic"
)  # fmt: skip


def per_batch(
    sources: Sequence[SourceId],
    sizes: Sequence[int],
    items: Sequence[RawBatch],
    clocks: Sequence[ClockEstimate],
    counts: Any,
) -> pa.Table:
    """One row per batch of the wave (its source, raw position and clock estimate) repeated
    ``counts[j]`` times: the per-row columns of those values, each built by one repeat
    (numpy for numbers, :func:`repeat_strings` for strings) rather than a take. The wave's
    batches come in units (``sources[u]``: ``sizes[u]`` consecutive ``items``) that share
    their source and raw topic (a joined set is read from one topic partition): those are
    repeated once per unit, over the unit's rows."""
    k = len(items)
    ests = [in_int64(c) for c in clocks]  # int64 columns, whatever the estimator says
    starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))[:-1]]).astype(np.int64)
    per_unit = counts if len(sources) == k else np.add.reduceat(np.asarray(counts), starts)
    topics = [items[j].topic for j in starts.tolist()]

    def rep(values: Any, dtype: Any) -> Any:
        return pa.array(np.repeat(np.fromiter(values, dtype=dtype, count=k), counts))

    return pa.table(
        {
            "node": repeat_strings([s.node for s in sources], per_unit),
            "exporter": repeat_strings([s.exporter for s in sources], per_unit),
            "instance": repeat_strings([s.instance for s in sources], per_unit),
            "boot_id": repeat_strings([s.boot_id for s in sources], per_unit),
            "seq": rep((x.batch.envelope.seq for x in items), np.int64),
            "raw_partition": rep((x.position[0] for x in items), np.int32),
            "raw_offset": rep((x.position[1] for x in items), np.int64),
            "raw_topic": _repeat_topics(topics, per_unit),
            "clock_offset_ns": rep((c.offset_ns for c in ests), np.int64),
            "clock_error_ns": rep((c.error_ns for c in ests), np.int64),
            "anchor_ns": rep((c.anchor_ns for c in ests), np.int64),
            "drift": rep((c.drift_ppm * 1e-6 for c in ests), np.float64),
            "error_rate": rep((c.error_rate for c in ests), np.float64),
            "clock_basis": repeat_strings([c.basis for c in ests], counts),
        }
    )


def _repeat_topics(topics: list[str | None], counts: Any) -> Any:
    """The raw topic of each batch repeated over its rows (NULL where not told)."""
    if None not in topics:
        return repeat_strings(cast(list[str], topics), counts)
    if all(t is None for t in topics):
        return pa.nulls(int(np.sum(counts)), pa.string())
    return pa.array(np.repeat(np.array(topics, dtype=object), counts), pa.string())


def align_rows(ts_source: Any, clocks: list[ClockEstimate], per: pa.Table) -> tuple[Any, Any]:
    """Aligned ts and the offset applied, each row with its own batch's estimate
    (the arithmetic of :func:`pipelines.refine.clock.align`, the estimate's values per row
    in ``per``)."""
    ts = pc.cast(ts_source, pa.int64())
    offsets = column(per, "clock_offset_ns")
    if all(c.drift_ppm == 0.0 for c in clocks):
        return pc.subtract(ts, offsets), offsets
    dt = pc.cast(pc.subtract(ts, column(per, "anchor_ns")), pa.float64())
    off = pc.add(pc.cast(pc.round(pc.multiply(dt, column(per, "drift"))), pa.int64()), offsets)
    return pc.subtract(ts, off), off
