"""lake_accounting per raw topic and partition: telemetry.raw and an ingest topic with the
same partition and offsets are accounted apart, and rows or accounting that name no raw
topic (written before they carried it) are telemetry.raw's."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from lab.lake import synth
from services.lake import sqlload
from services.lake.datasets import ACCOUNTING_SCHEMA, conform
from services.lake.writer import LakeWriter

T0 = 1_704_067_200_000_000_000 + 60 * 10**9
INGEST = "telemetry.ingest.influx"


def _samples(n: int, offsets: list[int], topic: str | None) -> pa.Table:
    t = synth.refined_samples(nodes=1, seconds=2, start_ns=T0).slice(0, n)
    off = pa.array([offsets[i % len(offsets)] for i in range(n)], pa.int64())
    t = t.set_column(t.schema.get_field_index("raw_offset"), "raw_offset", off)
    at = t.schema.get_field_index("raw_topic")
    return t.set_column(at, "raw_topic", pa.array([topic] * n, pa.string()))


def _accounting(topic: str | None, offsets: list[int], refined: int) -> pa.Table:
    k = len(offsets)
    acc = {
        "ts": [T0] * k,
        "raw_topic": pa.array([topic] * k, pa.string()),
        "raw_partition": [0] * k,
        "raw_offset": offsets,
        "input_samples": [refined // k] * k,
        "refined_samples": [refined // k] * k,
        "duplicate_samples": [0] * k,
        "quarantined_samples": [0] * k,
        "outcome": ["refined"] * k,
    }
    return conform(pa.table(acc), ACCOUNTING_SCHEMA)


def test_raw_and_ingest_at_the_same_positions_are_accounted_apart(tmp_path: Path) -> None:
    w = LakeWriter(tmp_path)
    w.ensure_seeds()
    w.land("samples", _samples(40, [0, 1], "telemetry.raw"), partition=0, first=0, last=0)
    w.land("samples", _samples(20, [0, 1], INGEST), partition=0, first=1, last=1)
    w.land("samples", _samples(10, [2], None), partition=0, first=2, last=2)  # an older row
    w.land("accounting", _accounting("telemetry.raw", [0, 1], 40), partition=0, first=0, last=0)
    w.land("accounting", _accounting(INGEST, [0, 1], 20), partition=0, first=1, last=1)
    w.land("accounting", _accounting(None, [2], 10), partition=0, first=2, last=2)
    con = sqlload.connect(tmp_path)
    got = con.execute(
        """SELECT raw_topic, raw_partition, raw_records, refined_samples, landed_samples, ok
           FROM lake_accounting"""
    ).fetchall()
    assert got == [
        (INGEST, 0, 2, 20, 20, True),
        ("telemetry.raw", 0, 3, 50, 50, True),
    ]
