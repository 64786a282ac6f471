"""Clock alignment for discrete records: events and NCCL collective records.

Samples go through :func:`pipelines.refine.refine_batch`; events and collectives need less
(no counters, no overlap) but the same clock: each record keeps ``ts_source`` and gets the
aligned ``ts`` with the offset and error bound applied, plus its node and lineage, so that
detectors and the lake join them to samples on one time axis.
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.refine.clock import ClockEstimate, align, row_errors
from schemas.wire import COLLECTIVES_SCHEMA, EVENTS_SCHEMA, Batch, PayloadKind


def _lineage_fields() -> list[pa.Field]:
    return [
        pa.field("node", pa.string(), nullable=False),
        pa.field("ts", pa.int64(), nullable=False),
        pa.field("ts_source", pa.int64(), nullable=False),
        pa.field("clock_offset_ns", pa.int64(), nullable=False),
        pa.field("clock_error_ns", pa.int64(), nullable=False),
        pa.field("clock_basis", pa.string()),  # see schemas.records.REFINED_SCHEMA
        pa.field("exporter", pa.string(), nullable=False),
        pa.field("boot_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("raw_partition", pa.int32(), nullable=False),
        pa.field("raw_offset", pa.int64(), nullable=False),
        pa.field("raw_topic", pa.string()),  # NULL (older rows): telemetry.raw
    ]


def _aligned_schema(payload: pa.Schema) -> pa.Schema:
    extra = _lineage_fields()
    names = {f.name for f in extra}
    return pa.schema([*extra, *(f for f in payload if f.name not in names and f.name != "ts_ns")])


ALIGNED_EVENTS_SCHEMA = _aligned_schema(EVENTS_SCHEMA)
ALIGNED_COLLECTIVES_SCHEMA = _aligned_schema(COLLECTIVES_SCHEMA).append(
    pa.field("end_ts", pa.int64())
)
ALIGNED_SCHEMAS = {
    PayloadKind.EVENTS: ALIGNED_EVENTS_SCHEMA,
    PayloadKind.COLLECTIVES: ALIGNED_COLLECTIVES_SCHEMA,
}


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# an error bound saturates here: "unbounded". A row's bound grows from it by its rate times
# its distance to the anchor (below 2^62 for any int64 times) without leaving int64.
ERROR_CAP_NS = 2**62


def in_int64(est: ClockEstimate) -> ClockEstimate:
    """``est`` with the values refining puts in int64 columns held to them: its offset and
    anchor saturated to int64, its error bound to :data:`ERROR_CAP_NS`. The estimator's
    arithmetic is Python's; a clock block the decoder accepts with a send time anywhere in
    int64 can make a disagreement, and so a bound, past int64 (the offset would not leave it:
    it is a send time less an append time, each in range)."""
    if (
        _INT64_MIN <= est.offset_ns <= _INT64_MAX
        and _INT64_MIN <= est.anchor_ns <= _INT64_MAX
        and 0 <= est.error_ns <= ERROR_CAP_NS
    ):
        return est
    return replace(
        est,
        offset_ns=min(max(est.offset_ns, _INT64_MIN), _INT64_MAX),
        anchor_ns=min(max(est.anchor_ns, _INT64_MIN), _INT64_MAX),
        error_ns=min(max(est.error_ns, 0), ERROR_CAP_NS),
    )


def align_records(
    batch: Batch, estimate: ClockEstimate, position: tuple[int, int], topic: str | None = None
) -> pa.Table:
    """The batch's rows on the common clock, with lineage: read from ``topic`` at
    ``position`` (partition, offset). ``ts = ts_source - offset``."""
    env = batch.envelope
    t = batch.table
    n = t.num_rows
    schema = ALIGNED_SCHEMAS[env.kind]
    estimate = in_int64(estimate)
    ts_source = t.column("ts_ns")
    ts, offset, error = align(ts_source, estimate)
    errors = pa.repeat(pa.scalar(error, pa.int64()), n)
    if estimate.error_rate:  # a bound from exchanges grows off its anchor
        errors = row_errors(
            ts_source,
            pa.repeat(pa.scalar(estimate.anchor_ns, pa.int64()), n),
            errors,
            pa.repeat(pa.scalar(estimate.error_rate, pa.float64()), n),
        )
    cols: dict[str, pa.Array | pa.ChunkedArray] = {
        "node": pa.repeat(pa.scalar(env.source.node), n),
        "ts": ts,
        "ts_source": ts_source,
        "clock_offset_ns": offset,
        "clock_error_ns": errors,
        "clock_basis": pa.repeat(pa.scalar(estimate.basis), n),
        "exporter": pa.repeat(pa.scalar(env.source.exporter), n),
        "boot_id": pa.repeat(pa.scalar(env.source.boot_id), n),
        "seq": pa.repeat(pa.scalar(env.seq, pa.int64()), n),
        "raw_partition": pa.repeat(pa.scalar(position[0], pa.int32()), n),
        "raw_offset": pa.repeat(pa.scalar(position[1], pa.int64()), n),
        "raw_topic": pa.repeat(pa.scalar(topic, pa.string()), n),
    }
    if env.kind is PayloadKind.COLLECTIVES:
        end = t.column("end_ns")
        cols["end_ts"] = pc.subtract(end, pc.subtract(ts_source, ts))
    for f in schema:
        if f.name not in cols:
            cols[f.name] = t.column(f.name)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)
