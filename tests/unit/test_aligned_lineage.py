"""Aligned events and collectives name the raw topic, partition and offset they were read
at (an ingest topic has offsets of its own); untold, the topic is NULL (telemetry.raw)."""

from __future__ import annotations

import pyarrow as pa

from pipelines.refine.aligned import (
    ALIGNED_COLLECTIVES_SCHEMA,
    ALIGNED_EVENTS_SCHEMA,
    align_records,
)
from pipelines.refine.clock import ClockEstimate
from schemas.wire import EVENTS_SCHEMA, Batch, Envelope, PayloadKind, SourceId

T = 1_700_000_000 * 1_000_000_000
EST = ClockEstimate(offset_ns=5, anchor_ns=T, drift_ppm=0.0, error_ns=7, points=1, converged=True)


def _events() -> Batch:
    rows = {"ts_ns": [T, T + 1], "event": ["xid", "link_down"], "device": ["gpu0", "mlx5_0/1"]}
    cols = {f.name: rows.get(f.name, [None, None]) for f in EVENTS_SCHEMA}
    src = SourceId(node="n1", exporter="ev", instance="0", boot_id="b0")
    env = Envelope(source=src, seq=1, sent_ns=T, kind=PayloadKind.EVENTS)
    return Batch(envelope=env, table=pa.table(cols, schema=EVENTS_SCHEMA))


def test_aligned_rows_name_their_raw_topic() -> None:
    t = align_records(_events(), EST, (3, 10), "telemetry.ingest.collectd")
    assert t.schema.equals(ALIGNED_EVENTS_SCHEMA)
    assert t.column("raw_topic").to_pylist() == ["telemetry.ingest.collectd"] * 2
    assert t.column("raw_partition").to_pylist() == [3, 3]
    assert t.column("raw_offset").to_pylist() == [10, 10]
    assert t.column("ts").to_pylist() == [T - 5, T - 4]


def test_untold_the_raw_topic_is_null() -> None:
    t = align_records(_events(), EST, (0, 1))
    assert t.column("raw_topic").null_count == 2
    assert ALIGNED_COLLECTIVES_SCHEMA.field("raw_topic").nullable
