"""Codec round-trips (property-based) for both wire encodings, and the rejection contract."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import ARROW, JSON, decode, encode
from schemas.errors import RejectedInput
from schemas.reasons import Reason
from schemas.wire import (
    COLLECTIVES_SCHEMA,
    EVENTS_SCHEMA,
    PAYLOAD_SCHEMAS,
    SAMPLES_SCHEMA,
    ClockBlock,
    Envelope,
    PayloadKind,
    SourceId,
    SyncState,
)

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def envelopes(draw: st.DrawFn, kind: PayloadKind = PayloadKind.SAMPLES) -> Envelope:
    clock = draw(
        st.none()
        | st.builds(
            ClockBlock,
            source=st.sampled_from(["chrony", "ptp4l"]),
            offset_ns=st.integers(-(10**12), 10**12),
            error_bound_ns=st.integers(0, 10**9),
            state=st.sampled_from(list(SyncState)),
        )
    )
    return Envelope(
        kind=kind,
        source=SourceId(
            node=draw(names), exporter=draw(names), instance=draw(names), boot_id=draw(names)
        ),
        seq=draw(st.integers(0, 2**62)),
        sent_ns=draw(st.integers(0, 2**62)),
        clock=clock,
    )


@st.composite
def sample_tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 50))
    return pa.table(
        {
            "ts_ns": draw(st.lists(st.integers(0, 2**62), min_size=n, max_size=n)),
            "metric": draw(
                st.lists(st.sampled_from(["ib.port_rcv_data", "gpu.temp"]), min_size=n, max_size=n)
            ),
            "device": draw(st.lists(names, min_size=n, max_size=n)),
            "value": draw(st.lists(st.none() | finite, min_size=n, max_size=n)),
            "raw": draw(st.lists(st.none() | st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
            "text": [None] * n,
        },
        schema=SAMPLES_SCHEMA,
    )


@settings(max_examples=150, deadline=None)
@given(env=envelopes(), table=sample_tables(), ct=st.sampled_from([JSON, ARROW]))
def test_samples_round_trip_both_encodings(env: Envelope, table: pa.Table, ct: str) -> None:
    got_ct, body = encode(env, table, ct)
    assert got_ct == ct
    batch = decode(body, ct)
    assert batch.envelope == env
    assert batch.table.equals(table)


@settings(max_examples=50, deadline=None)
@given(env=envelopes(), table=sample_tables())
def test_both_encodings_decode_to_the_same_table(env: Envelope, table: pa.Table) -> None:
    a = decode(encode(env, table, JSON)[1], JSON)
    b = decode(encode(env, table, ARROW)[1], ARROW)
    assert a.table.equals(b.table)
    assert a.envelope == b.envelope


def test_events_and_collectives_round_trip() -> None:
    src = SourceId(node="n1", exporter="fw", instance="0", boot_id="b1")
    ev = pa.table(
        {
            "ts_ns": [1],
            "event": ["xid"],
            "device": ["gpu3"],
            "code": [79],
            "severity": ["critical"],
            "message": ["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."],
            "attrs": ["{}"],
        },
        schema=EVENTS_SCHEMA,
    )
    env = Envelope(kind=PayloadKind.EVENTS, source=src, seq=0, sent_ns=2)
    for ct in (JSON, ARROW):
        assert decode(encode(env, ev, ct)[1], ct).table.equals(ev)
    co = pa.table(
        {
            "ts_ns": [10],
            "end_ns": [20],
            "job": ["j1"],
            "comm": ["c0"],
            "op": ["AllReduce"],
            "op_seq": [7],
            "rank": [3],
            "nranks": [16],
            "device": ["gpu3"],
            "bytes": [1 << 20],
            "dtype": ["float"],
            "algbw_gbps": [100.5],
            "busbw_gbps": [188.4],
        },
        schema=COLLECTIVES_SCHEMA,
    )
    env = Envelope(kind=PayloadKind.COLLECTIVES, source=src, seq=1, sent_ns=2)
    for ct in (JSON, ARROW):
        assert decode(encode(env, co, ct)[1], ct).table.equals(co)


def test_json_string_value_moves_to_text_column() -> None:
    doc = {
        "schema_version": 1,
        "source": {"node": "n1", "exporter": "x", "instance": "0", "boot_id": "b"},
        "seq": 0,
        "sent_ns": 5,
        "columns": {
            "ts_ns": [1, 2],
            "metric": ["ib.port_rcv_data"] * 2,
            "device": ["i40iw0/1"] * 2,
            "value": ["N/A (no PMA)", 3.0],
        },
    }
    b = decode(json.dumps(doc).encode(), JSON)
    assert b.table.column("text").to_pylist() == ["N/A (no PMA)", None]
    assert b.table.column("value").to_pylist() == [None, 3.0]
    assert b.table.column("raw").null_count == 2


GOOD = {
    "schema_version": 1,
    "source": {"node": "n", "exporter": "e", "instance": "0", "boot_id": "b"},
    "seq": 0,
    "sent_ns": 0,
    "columns": {"ts_ns": [1], "metric": ["m.x"], "device": ["d"], "value": [1.0]},
}


@pytest.mark.parametrize(
    ("body", "ct", "reason"),
    [
        (json.dumps(GOOD).encode(), "text/plain", Reason.UNSUPPORTED_CONTENT_TYPE),
        (json.dumps(GOOD).encode(), None, Reason.UNSUPPORTED_CONTENT_TYPE),
        (b"", JSON, Reason.UNDECODABLE),
        (b"{not json", JSON, Reason.UNDECODABLE),
        (b"\x00\x01garbage", ARROW, Reason.UNDECODABLE),
        (
            json.dumps({**GOOD, "schema_version": 99}).encode(),
            JSON,
            Reason.UNSUPPORTED_SCHEMA_VERSION,
        ),
        (json.dumps({**GOOD, "seq": -1}).encode(), JSON, Reason.BAD_ENVELOPE),
        (json.dumps({**GOOD, "source": {"node": "../etc"}}).encode(), JSON, Reason.BAD_ENVELOPE),
        (
            json.dumps(
                {**GOOD, "columns": {"ts_ns": ["x"], "metric": ["m"], "device": ["d"]}}
            ).encode(),
            JSON,
            Reason.SCHEMA_MISMATCH,
        ),
        (
            json.dumps({**GOOD, "columns": {"metric": ["m"], "device": ["d"]}}).encode(),
            JSON,
            Reason.SCHEMA_MISMATCH,
        ),
        (
            json.dumps(
                {**GOOD, "columns": {"ts_ns": [1, 2], "metric": ["m"], "device": ["d"]}}
            ).encode(),
            JSON,
            Reason.SCHEMA_MISMATCH,
        ),
        (b"[1,2,3]", JSON, Reason.BAD_ENVELOPE),
        (b"x" * (16 * 1024 * 1024 + 1), JSON, Reason.OVERSIZED),
    ],
)
def test_rejections_carry_one_reason(body: bytes, ct: str | None, reason: Reason) -> None:
    with pytest.raises(RejectedInput) as ei:
        decode(body, ct)
    assert ei.value.reason is reason


def test_arrow_without_envelope_is_bad_envelope() -> None:
    sink = pa.BufferOutputStream()
    t = pa.table({"ts_ns": [1]})
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    with pytest.raises(RejectedInput) as ei:
        decode(sink.getvalue().to_pybytes(), ARROW)
    assert ei.value.reason is Reason.BAD_ENVELOPE


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([JSON, ARROW]))
def test_decode_never_raises_anything_but_rejected_input(body: bytes, ct: str) -> None:
    try:
        b = decode(body, ct)
    except RejectedInput as e:
        assert e.reason in set(Reason)
    else:
        # random bytes that happen to decode must still be a fully conforming batch
        assert b.table.schema.equals(PAYLOAD_SCHEMAS[b.envelope.kind])


def _arrow_stream(
    table: pa.Table,
    env_json: bytes | None,
    *,
    chunk: int | None = None,
    compression: str | None = None,
) -> bytes:
    meta = {} if env_json is None else {b"refinery.envelope": env_json}
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, table.schema.with_metadata(meta), options=opts) as w:
        w.write_table(table, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


@settings(max_examples=60, deadline=None)
@given(
    env=envelopes(),
    table=sample_tables(),
    chunk=st.sampled_from([None, 1, 7]),
    compression=st.sampled_from([None, "lz4", "zstd"]),
    dictionary=st.booleans(),
)
def test_arrow_streams_of_many_batches_compressed_or_with_dictionaries_decode_whole(
    env: Envelope, table: pa.Table, chunk: int | None, compression: str | None, dictionary: bool
) -> None:
    """Plain streams are built from the messages the bounds check read, streams with a
    dictionary are read again by pyarrow's stream reader: both give the table sent."""
    sent = table
    if dictionary:  # a dictionary-encoded device column: the second way
        table = table.set_column(2, "device", table.column("device").dictionary_encode())
    body = _arrow_stream(
        table, env.model_dump_json(exclude_none=True).encode(), chunk=chunk, compression=compression
    )
    b = decode(body, ARROW)
    assert b.envelope == env
    assert b.table.equals(sent)


ENV = {
    "schema_version": 1,
    "source": {"node": "n", "exporter": "e", "instance": "0", "boot_id": "b"},
    "seq": 0,
    "sent_ns": 0,
}


@pytest.mark.parametrize("dictionary", [False, True])
@pytest.mark.parametrize(
    ("env_json", "reason"),
    [
        (None, Reason.BAD_ENVELOPE),
        (b"{not json", Reason.BAD_ENVELOPE),
        (b"[1,2]", Reason.BAD_ENVELOPE),
        (json.dumps({**ENV, "schema_version": 99}).encode(), Reason.UNSUPPORTED_SCHEMA_VERSION),
        (json.dumps({**ENV, "schema_version": "1"}).encode(), Reason.UNSUPPORTED_SCHEMA_VERSION),
        (json.dumps({**ENV, "seq": -1}).encode(), Reason.BAD_ENVELOPE),
        (json.dumps({**ENV, "source": {"node": "../etc"}}).encode(), Reason.BAD_ENVELOPE),
    ],
)
def test_arrow_envelope_rejections_carry_their_reason_both_ways(
    env_json: bytes | None, reason: Reason, dictionary: bool
) -> None:
    t = pa.table({"ts_ns": [1], "metric": ["m.x"], "device": ["d"], "value": [1.0]})
    if dictionary:
        t = t.set_column(2, "device", t.column("device").dictionary_encode())
    with pytest.raises(RejectedInput) as ei:
        decode(_arrow_stream(t, env_json), ARROW)
    assert ei.value.reason is reason
