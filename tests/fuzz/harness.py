"""What every hostile input must satisfy, and the real batches the fuzzer mutates.

:func:`check_record` runs one Kafka record value through :func:`schemas.codec.decode` and a
fresh :class:`~services.worker.refiner.Refiner` (which calls ``refine_batch`` for samples)
and asserts the contract: decode raises nothing but RejectedInput; process never raises; one
accounting message per record with ``input = refined + duplicate + quarantined``; a rejected
record ends in exactly one dead letter carrying decode's reason; quarantined samples are
all in dead letters with reasons.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

import pyarrow as pa

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.messages import SendKind
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import Catalog, default_catalog
from schemas.codec import ARROW, ENVELOPE_KEY, JSON, decode, encode
from schemas.errors import RejectedInput
from schemas.topics import TOPICS
from schemas.wire import Envelope
from services.worker.refiner import RawRecord, Refiner

S = 1_000_000_000


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str | None  # decode's reason for a rejected record


@functools.cache
def catalog() -> Catalog:
    return default_catalog()


@functools.cache
def seeds() -> tuple[tuple[bytes, str], ...]:
    """Real batches from a small simulation (samples of every exporter, events, collectives),
    each as Arrow IPC, zstd- and lz4-compressed Arrow IPC and columnar JSON."""
    start = time.time_ns() - 10 * S  # timestamps inside the sane window
    sim = Simulation(Cluster.build(2, seed=5), "all", seed=5, start_ns=start, duration_ns=4 * S)
    out: list[tuple[bytes, str]] = []
    seen: set[tuple[str, str]] = set()
    for tick in sim.ticks():
        for m in tick.messages:
            if m.envelope is None or m.table is None or m.kind is not SendKind.BATCH:
                continue
            kind = (m.envelope.kind.value, m.envelope.source.exporter)
            if kind in seen:
                continue
            seen.add(kind)
            table = m.table.slice(0, min(m.table.num_rows, 40))
            for content_type in (ARROW, JSON):
                ct, body = encode(m.envelope, table, content_type)
                out.append((body, ct))
            out.append((arrow_compressed(m.envelope, table, "zstd"), ARROW))
            out.append((arrow_compressed(m.envelope, table, "lz4"), ARROW))
    return tuple(out)


def arrow_compressed(envelope: Envelope, table: pa.Table, codec: str) -> bytes:
    meta = {ENVELOPE_KEY: envelope.model_dump_json(exclude_none=True).encode()}
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=codec)
    with pa.ipc.new_stream(sink, table.schema.with_metadata(meta), options=opts) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def check_record(value: bytes | None, content_type: str | None) -> Verdict:
    """Assert the hostile-input contract for one record; returns what happened."""
    reason: str | None = None
    try:
        decode(value, content_type)
    except RejectedInput as e:
        reason = e.reason.value
    refiner = Refiner(
        catalog(), TOPICS, lambda: TopologyIndex([], []), lambda _: None, lambda _: None
    )
    headers = [] if content_type is None else [("content-type", content_type.encode())]
    rec = RawRecord("telemetry.raw", 0, 7, b"n1", value, headers, time.time_ns() // 1_000_000)
    out = refiner.process(rec, time.time_ns())
    accounting = [m for m in out.messages if m.topic == TOPICS.accounting]
    assert len(accounting) == 1, out.messages
    acc = json.loads(accounting[0].value)
    assert acc["input_samples"] == (
        acc["refined_samples"] + acc["duplicate_samples"] + acc["quarantined_samples"]
    )
    assert out.input_samples == out.refined + out.duplicate + out.quarantined
    dead = [json.loads(m.value) for m in out.messages if m.topic == TOPICS.deadletter]
    if reason is not None:
        assert out.outcome == "deadletter" and acc["outcome"] == "deadletter"
        assert [d["reason"] for d in dead] == [reason] and dead[0]["scope"] == "record"
        assert dead[0]["original_b64"] is not None
    else:
        assert out.outcome in ("refined", "duplicate"), out.outcome
        assert sum(d["samples"] for d in dead) == out.quarantined
        assert all(d["reason"] for d in dead)
    return Verdict(out.outcome, reason)
