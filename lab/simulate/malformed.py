"""Malformed input of every dead-letter reason, with the reason the refiner must give it.

Whole-record reasons (:data:`schemas.reasons.RECORD_REASONS`) are separate Kafka records from a
third-party exporter (``exporter="custom"``) on a node; :func:`record` returns the
``(content_type, body, samples)`` to send and :func:`schemas.codec.decode` rejects each body
with exactly its reason. Per-sample reasons are extra rows appended to an otherwise valid
batch by :func:`bad_rows`; the rest of that batch must still flow.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from schemas.codec import ARROW, ENVELOPE_KEY, MAX_ROWS, encode
from schemas.reasons import RECORD_REASONS, REFINER_REASONS, Reason
from schemas.wire import SAMPLES_SCHEMA, Envelope

S = 1_000_000_000
SAMPLE_REASONS = tuple(r for r in Reason if r not in RECORD_REASONS | REFINER_REASONS)


def _ipc(table: pa.Table, meta: dict[bytes, bytes] | None, compress: bool = False) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd" if compress else None)
    with pa.ipc.new_stream(sink, table.schema.with_metadata(meta or {}), options=opts) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def sample_table(ts_ns: int, rows: int) -> pa.Table:
    """A small valid table (gpu.temp of gpu0..) for the body of a malformed record."""
    return pa.table(
        {
            "ts_ns": pa.array([ts_ns] * rows, pa.int64()),
            "metric": ["gpu.temp"] * rows,
            "device": [f"gpu{i % 8}" for i in range(rows)],
            "value": pa.array([55.0] * rows, pa.float64()),
            "raw": pa.nulls(rows, pa.uint64()),
            "text": pa.nulls(rows, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )


def record(reason: Reason, envelope: Envelope, ts_ns: int) -> tuple[str, bytes, int]:
    """A record the refiner rejects whole with ``reason``; ValueError for a sample reason."""
    table = sample_table(ts_ns, 8)
    env_doc = json.loads(envelope.model_dump_json(exclude_none=True))
    if reason is Reason.UNSUPPORTED_CONTENT_TYPE:
        _, body = encode(envelope, table, ARROW)
        return "application/x-protobuf", body, table.num_rows
    if reason is Reason.UNDECODABLE:
        _, body = encode(envelope, table, ARROW)
        return ARROW, body[: len(body) - 24], 0  # cut inside the record batch
    if reason is Reason.OVERSIZED:
        # dictionary-encoded strings and IPC compression keep the body small enough for any
        # broker while the decoded row count is over the limit
        n = MAX_ROWS + 1
        big = sample_table(ts_ns, 1)
        big = pa.concat_tables([big] * n).combine_chunks()
        for name in ("metric", "device"):
            i = big.schema.get_field_index(name)
            big = big.set_column(i, name, big.column(name).dictionary_encode())
        meta = {ENVELOPE_KEY: json.dumps(env_doc).encode()}
        return ARROW, _ipc(big, meta, compress=True), n
    if reason is Reason.BAD_ENVELOPE:
        env_doc["seq"] = -1
        return ARROW, _ipc(table, {ENVELOPE_KEY: json.dumps(env_doc).encode()}), table.num_rows
    if reason is Reason.VALUE_OUT_OF_RANGE:
        env_doc["seq"] = 2**63
        return ARROW, _ipc(table, {ENVELOPE_KEY: json.dumps(env_doc).encode()}), table.num_rows
    if reason is Reason.UNSUPPORTED_SCHEMA_VERSION:
        env_doc["schema_version"] = 99
        return ARROW, _ipc(table, {ENVELOPE_KEY: json.dumps(env_doc).encode()}), table.num_rows
    if reason is Reason.SCHEMA_MISMATCH:
        bad = table.set_column(0, "ts_ns", pa.array(["yesterday"] * table.num_rows))
        return ARROW, _ipc(bad, {ENVELOPE_KEY: json.dumps(env_doc).encode()}), table.num_rows
    raise ValueError(f"{reason} is not a whole-record reason")


def bad_rows(reasons: list[Reason], ts_ns: int) -> pa.Table:
    """One SAMPLES row per reason, each quarantined with exactly that reason. Rows are stamped
    1 µs after the batch's own samples so they never collide with a good sample's identity."""
    t = ts_ns + 1_000
    spec: dict[Reason, tuple[int, str, str, float, int | None]] = {
        Reason.UNKNOWN_METRIC: (t, "gpu.frobnication_level", "gpu0", 1.0, None),
        Reason.BAD_DEVICE: (t, "gpu.temp", "", 50.0, None),
        Reason.NON_FINITE: (t, "gpu.power", "gpu1", float("nan"), None),
        Reason.OUT_OF_RANGE: (t, "gpu.util", "gpu2", 250.0, None),
        Reason.TIMESTAMP_OUT_OF_WINDOW: (86_400 * S, "gpu.temp", "gpu3", 50.0, None),
        Reason.WRONG_KIND: (t, "gpu.energy", "gpu4", -5.0, None),
    }
    rows = [spec[r] for r in reasons]
    return pa.table(
        {
            "ts_ns": pa.array([r[0] for r in rows], pa.int64()),
            "metric": pa.array([r[1] for r in rows], pa.string()),
            "device": pa.array([r[2] for r in rows], pa.string()),
            "value": pa.array(np.array([r[3] for r in rows], dtype=np.float64)),
            "raw": pa.array([r[4] for r in rows], pa.uint64()),
            "text": pa.nulls(len(rows), pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
