"""Kafka values → lake rows: the worker's accounting JSON, JSON records, and hostile bytes
(only RejectedInput, never a crash); lake_accounting ignores replay rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from schemas.errors import RejectedInput
from services.lake import sqlload
from services.lake.datasets import ACCOUNTING_SCHEMA, DATASETS
from services.lake.decode import rows_of
from services.lake.writer import LakeWriter

T0 = 1_704_067_200_000_000_000


def _acc(offset: int, outcome: str, n: int, refined: int, dup: int, q: int) -> bytes:
    doc = {
        "raw_topic": "telemetry.raw", "raw_partition": 0, "raw_offset": offset, "node": "n1",
        "outcome": outcome, "reason": None, "input_samples": n, "refined_samples": refined,
        "duplicate_samples": dup, "quarantined_samples": q, "append_ms": 1,
    }  # fmt: skip
    return json.dumps(doc).encode()


def test_worker_accounting_json_lands_and_replays_do_not_double_count(tmp_path: Path) -> None:
    w = LakeWriter(tmp_path)
    w.ensure_seeds()
    msgs = [
        _acc(0, "refined", 3, 3, 0, 0),
        _acc(1, "duplicate", 2, 0, 2, 0),
        _acc(0, "replay", 3, 0, 0, 0),  # reprocessed after a crash: nothing republished
    ]
    tables = [
        rows_of("accounting", m, None, partition=0, offset=i, timestamp_ns=T0 + i)
        for i, m in enumerate(msgs)
    ]
    t = pa.concat_tables(tables)
    assert t.schema == ACCOUNTING_SCHEMA and t.column("ts").to_pylist() == [T0, T0 + 1, T0 + 2]
    w.land("accounting", t, partition=0, first=0, last=2)
    con = sqlload.connect(tmp_path)
    row = con.execute(
        "SELECT raw_records, input_samples, refined_samples, duplicate_samples,"
        " unaccounted_samples FROM lake_accounting"
    ).fetchall()
    assert row == [(2, 5, 3, 2, 0)]


def test_json_records_flatten_with_position() -> None:
    alert = {
        "id": "a1", "rule": "r", "state": "firing", "severity": "warning", "entity": "n1",
        "starts_ns": 5, "summary": "s", "evidence": {"x": 1}, "emitted_ns": 7,
    }  # fmt: skip
    t = rows_of("alerts", json.dumps(alert).encode(), "application/json", partition=2,
                offset=9, timestamp_ns=0)  # fmt: skip
    row = t.to_pylist()[0]
    assert (row["ts"], row["kafka_partition"], row["kafka_offset"]) == (7, 2, 9)
    assert json.loads(row["evidence"]) == {"x": 1}


@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize(
    "value",
    [b"", b"\x00" * 64, b"{", b"[]", b"{}", b'{"columns": 5}', b"\xff\xfe", os.urandom(256)],
)
def test_hostile_bytes_only_ever_reject(dataset: str, value: bytes) -> None:
    for ct in (None, "application/json", "application/vnd.apache.arrow.stream", "text/x"):
        try:
            t = rows_of(dataset, value, ct, partition=0, offset=0, timestamp_ns=0)
        except RejectedInput:
            continue
        assert t.schema == DATASETS[dataset].schema  # e.g. b"[]" is zero rows


def _two(t: pa.DataType) -> list[object]:
    if pa.types.is_string(t):
        return ["a", "b"]
    return [True, False] if pa.types.is_boolean(t) else [1, 2]


def test_a_table_already_in_the_dataset_schema_keeps_its_rows_and_null_checks() -> None:
    """conform's fast path (the schema already equal): the same rows, the dataset schema's
    metadata, and a NULL in a non-nullable column still refused, as on the general path."""
    from services.lake.datasets import conform

    schema = DATASETS["samples"].schema
    strict = [f.name for f in schema if not f.nullable]
    assert strict  # the check below has columns to look at
    arrays = [pa.array([None, None] if f.nullable else _two(f.type), f.type) for f in schema]
    table = pa.Table.from_arrays(arrays, schema=schema.with_metadata({b"k": b"v"}))
    got = conform(table, schema)
    assert got.equals(table) and got.schema.metadata == schema.metadata
    # the same table, reordered: the general path gives the same answer
    assert conform(table.select(list(reversed(schema.names))), schema).equals(got)
    for name in strict:
        i = schema.get_field_index(name)
        holed = pa.Table.from_arrays(
            [pa.nulls(2, a.type) if j == i else a for j, a in enumerate(arrays)], schema=schema
        )
        assert holed.schema.equals(schema)  # the fast path's case
        with pytest.raises(ValueError, match=f"column {name} has NULLs"):
            conform(holed, schema)
