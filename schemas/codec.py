"""Encode and decode wire batches in the two encodings, chosen by the ``content-type`` header.

- ``application/json``: columnar JSON, ``{"schema_version": 1, "kind": "samples", "source":
  {...}, "seq": n, "sent_ns": t, "clock": {...}, "columns": {"ts_ns": [...], ...}}``. A string
  in the ``value`` column is a non-numeric reading and moves to ``text``.
- ``application/vnd.apache.arrow.stream``: Arrow IPC stream; the envelope is JSON in the schema
  metadata key ``refinery.envelope``.

Both decode to the same :class:`~schemas.wire.Batch`. :func:`decode` raises
:class:`~schemas.errors.RejectedInput` with a reason code for anything it cannot accept; it
never raises anything else for any input bytes.

Example::

    >>> import pyarrow as pa
    >>> from schemas.wire import Envelope, SourceId, SAMPLES_SCHEMA
    >>> env = Envelope(source=SourceId(node="n1", exporter="node", instance="0", boot_id="b"),
    ...                seq=1, sent_ns=10)
    >>> t = pa.table({"ts_ns": [5], "metric": ["cpu.busy"], "device": ["cpu0"], "value": [1.0],
    ...               "raw": pa.array([None], pa.uint64()), "text": pa.array([None], pa.string())},
    ...              schema=SAMPLES_SCHEMA)
    >>> ct, body = encode(env, t, JSON)
    >>> decode(body, ct).table.equals(t)
    True
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from schemas.errors import RejectedInput
from schemas.ipc_limits import check_ipc_stream
from schemas.reasons import Reason
from schemas.wire import (
    PAYLOAD_SCHEMAS,
    SUPPORTED_SCHEMA_VERSIONS,
    Batch,
    ClockBlock,
    Envelope,
)

JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"
CONTENT_TYPES = frozenset({JSON, ARROW})
ENVELOPE_KEY = b"refinery.envelope"

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_DECODED_BYTES = 64 * 1024 * 1024
MAX_ROWS = 200_000
MAX_STRING_BYTES = 16 * 1024  # any one string value (device, text, message, attrs, ...)

_V = TypeVar("_V")


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # IPC end-of-stream marker


class _BySchema(Generic[_V]):
    """A small cache keyed by Arrow schema. Found by ``Schema.equals`` (metadata included),
    not by hashing: ``hash()`` of a schema is recomputed on every call (~23 µs for the 35
    refined fields, paid once per record), ``equals`` of the same schema costs ~0.2 µs."""

    def __init__(self, size: int = 64) -> None:
        self._items: list[tuple[pa.Schema, _V]] = []
        self._size = size

    def get(self, schema: pa.Schema) -> _V | None:
        for have, value in self._items:
            if have.equals(schema, check_metadata=True):
                return value
        return None

    def put(self, schema: pa.Schema, value: _V) -> None:
        if len(self._items) < self._size:
            self._items.append((schema, value))


_SCHEMA_MESSAGES: _BySchema[pa.Buffer] = _BySchema()


def ipc_stream_parts(table: pa.Table | pa.RecordBatch) -> list[pa.Buffer | bytes]:
    """The messages of :func:`ipc_stream` (schema, record batches, end marker), each in a
    buffer of its own, for a caller that joins them with other bytes in one copy."""
    head = _SCHEMA_MESSAGES.get(table.schema)
    if head is None:
        head = table.schema.serialize()
        _SCHEMA_MESSAGES.put(table.schema, head)
    batches = [table] if isinstance(table, pa.RecordBatch) else table.to_batches()
    return [head, *(b.serialize() for b in batches if b.num_rows), _EOS]


def ipc_stream(table: pa.Table | pa.RecordBatch) -> pa.Buffer:
    """``table`` as one Arrow IPC stream (schema, record batches, end marker) in one Arrow
    buffer: the bytes ``pa.ipc.new_stream`` writes, with the schema message serialized once
    per schema. A sliced table writes only its rows. Producers take the buffer as it is."""
    sink = pa.BufferOutputStream()
    for part in ipc_stream_parts(table):
        sink.write(part)
    return sink.getvalue()


def ipc_stream_within(batch: pa.RecordBatch, size: int | None) -> pa.Buffer:
    """:func:`ipc_stream` of ``batch``, written straight into one buffer of ``size`` bytes
    instead of serializing the batch and then copying schema, batch and end marker together
    (a copy of every byte saved, for the cost of writing the schema message again: worth it
    for large batches). When the stream does not fit in ``size`` (or no size is known),
    :func:`ipc_stream`."""
    if size is None:
        return ipc_stream(batch)
    buf = pa.allocate_buffer(size)
    sink = pa.FixedSizeBufferWriter(buf)
    try:
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
    except OSError:  # past the end of the buffer: the caller's size was too small
        return ipc_stream(batch)
    return buf.slice(0, sink.tell())


def encode(envelope: Envelope, table: pa.Table, content_type: str = ARROW) -> tuple[str, bytes]:
    """Serialize one batch; returns ``(content_type, body)``. The table must fit its schema."""
    schema = PAYLOAD_SCHEMAS[envelope.kind]
    if not table.schema.equals(schema):  # the common case needs no select or cast
        table = table.select(schema.names).cast(schema)
    if content_type == ARROW:
        meta = {ENVELOPE_KEY: envelope.model_dump_json(exclude_none=True).encode()}
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema.with_metadata(meta)) as w:
            w.write_table(table)
        return ARROW, sink.getvalue().to_pybytes()
    if content_type == JSON:
        doc = envelope.model_dump(mode="json", exclude_none=True)
        doc["columns"] = {name: table.column(name).to_pylist() for name in schema.names}
        return JSON, json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    raise ValueError(f"unsupported content type {content_type!r}")


def content_type_of(headers: Any) -> str | None:
    """The ``content-type`` header from Kafka headers (list of pairs or dict), or None."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == "content-type":
            if isinstance(v, bytes):
                return v.decode("utf-8", "replace")
            return str(v) if v is not None else None
    return None


def decode(body: bytes | None, content_type: str | None) -> Batch:
    """Decode one Kafka message value. Raises RejectedInput and nothing else."""
    try:
        return _decode(body, content_type)
    except RejectedInput:
        raise
    except Exception as e:  # any library error on hostile bytes is an undecodable record
        raise RejectedInput(Reason.UNDECODABLE, f"{type(e).__name__}: {e}"[:300]) from e


def _decode(body: bytes | None, content_type: str | None) -> Batch:
    if content_type not in CONTENT_TYPES:
        raise RejectedInput(
            Reason.UNSUPPORTED_CONTENT_TYPE, f"content-type {content_type!r} is not supported"
        )
    if body is None or len(body) == 0:
        raise RejectedInput(Reason.UNDECODABLE, "empty message value")
    if len(body) > MAX_MESSAGE_BYTES:
        raise RejectedInput(Reason.OVERSIZED, f"message of {len(body)} bytes")
    if content_type == JSON:
        return _decode_json(body)
    return _decode_arrow(body)


def _envelope(doc: Any) -> Envelope:
    if not isinstance(doc, dict):
        raise RejectedInput(Reason.BAD_ENVELOPE, "envelope is not an object")
    version = doc.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise RejectedInput(
            Reason.UNSUPPORTED_SCHEMA_VERSION, f"schema_version {version!r} is not supported"
        )
    try:
        env = Envelope.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise RejectedInput(Reason.BAD_ENVELOPE, f"{loc}: {err['msg']}") from e
    return _in_range(env)


_INT64 = (-(2**63), 2**63 - 1)


def _in_range(env: Envelope) -> Envelope:
    """``env`` if each of its integers fits an int64, as every column and state blob that
    holds it does; a larger one (JSON has no bound) would pass validation and fail far later,
    in refining or in a checkpoint."""
    lo, hi = _INT64
    fields: list[tuple[str, int | None]] = [
        ("seq", env.seq),
        ("sent_ns", env.sent_ns),
        ("interval_ns", env.interval_ns),
    ]
    if env.clock is not None:  # every integer of the block, whatever fields it grows
        fields += [(f"clock.{k}", v) for k, v in vars(env.clock).items() if type(v) is int]
    for name, v in fields:
        if v is not None and not lo <= v <= hi:
            raise RejectedInput(Reason.VALUE_OUT_OF_RANGE, f"{name}: {v} is outside int64")
    if env.clock is not None:
        _plausible_clock(env.clock)
    return env


# What a clock block can plausibly say (beyond these it is no clock's report, and its
# arithmetic in refining, with a send time anywhere in int64, could leave int64): an offset
# or error bound of at most a century; exchange times between 1970 and 2116 (2^62 ns) on a
# partition number of Kafka's (int32).
CLOCK_SPAN_NS = 100 * 365 * 86_400 * 10**9
_EXCHANGE_NS = 2**62
_CLOCK_RANGES = {"offset_ns": (-CLOCK_SPAN_NS, CLOCK_SPAN_NS), "error_bound_ns": (0, CLOCK_SPAN_NS)}
_EXCHANGE_RANGES = (
    ("send_ns", 0, _EXCHANGE_NS),
    ("append_ms", 0, _EXCHANGE_NS // 1_000_000),
    ("ack_ns", 0, _EXCHANGE_NS),
    ("partition", 0, 2**31 - 1),
)


def _plausible_clock(clock: ClockBlock) -> None:
    """Raises ``value_out_of_range`` for a clock block value outside what a clock reports."""
    for name, (lo, hi) in _CLOCK_RANGES.items():
        v = getattr(clock, name)
        if v is not None and not lo <= v <= hi:
            raise RejectedInput(
                Reason.VALUE_OUT_OF_RANGE, f"clock.{name}: {v} is outside [{lo}, {hi}]"
            )
    for i, ex in enumerate(clock.exchanges or ()):
        for (name, lo, hi), v in zip(_EXCHANGE_RANGES, ex, strict=True):
            if not lo <= v <= hi:
                raise RejectedInput(
                    Reason.VALUE_OUT_OF_RANGE,
                    f"clock.exchanges[{i}].{name}: {v} is outside [{lo}, {hi}]",
                )


_PLANS: _BySchema[list[tuple[str, Any, bool, bool]]] = _BySchema()


def _plan(schema: pa.Schema) -> list[tuple[str, Any, bool, bool]]:
    """Per field of ``schema``: name, type, nullable, is a string (computed once)."""
    plan = _PLANS.get(schema)
    if plan is None:
        plan = [(f.name, f.type, f.nullable, pa.types.is_string(f.type)) for f in schema]
        _PLANS.put(schema, plan)
    return plan


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast to the payload schema; missing nullable columns become NULL, extra ones are dropped."""
    if table.num_rows > MAX_ROWS:
        raise RejectedInput(Reason.OVERSIZED, f"{table.num_rows} rows > {MAX_ROWS}")
    plan = _plan(schema)
    if table.schema.equals(schema):  # what exporters send: no column to find, cast or add
        for pos, (name, _, nullable, is_string) in enumerate(plan):
            if is_string or not nullable:
                _check_column(name, table.column(pos), nullable, is_string)
        return table.replace_schema_metadata(None)
    have = {name: i for i, name in enumerate(table.schema.names)}
    types = table.schema.types
    cols = []
    for name, typ, nullable, is_string in plan:
        i = have.get(name)
        if i is not None:
            col = table.column(i)
            col_type = types[i]
            if pa.types.is_dictionary(col_type):
                col = col.cast(col_type.value_type)
                col_type = col.type
            if col_type != typ:
                try:
                    col = col.cast(typ)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise RejectedInput(
                        Reason.SCHEMA_MISMATCH, f"column {name}: {col_type} is not {typ}"
                    ) from e
            _check_column(name, col, nullable, is_string)
        elif nullable:
            col = pa.nulls(table.num_rows, typ)
        else:
            raise RejectedInput(Reason.SCHEMA_MISMATCH, f"column {name} is missing")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def _check_column(name: str, col: Any, nullable: bool, is_string: bool) -> None:
    if not nullable and col.null_count:
        raise RejectedInput(Reason.SCHEMA_MISMATCH, f"column {name} has nulls")
    # no string can be longer than all the column's buffers: skip the scan when small
    if is_string and col.get_total_buffer_size() > MAX_STRING_BYTES:
        longest = pc.max(pc.binary_length(col)).as_py() or 0
        if longest > MAX_STRING_BYTES:
            raise RejectedInput(
                Reason.OVERSIZED, f"column {name}: a {longest}-byte string > {MAX_STRING_BYTES}"
            )


def _decode_json(body: bytes) -> Batch:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not JSON: {e}"[:300]) from e
    if not isinstance(doc, dict):
        raise RejectedInput(Reason.BAD_ENVELOPE, "top level is not an object")
    columns = doc.pop("columns", None)
    envelope = _envelope(doc)
    if not isinstance(columns, dict):
        raise RejectedInput(Reason.SCHEMA_MISMATCH, "'columns' is missing or not an object")
    schema = PAYLOAD_SCHEMAS[envelope.kind]
    lengths = {len(v) for v in columns.values() if isinstance(v, list)}
    if len(lengths) > 1 or any(not isinstance(v, list) for v in columns.values()):
        raise RejectedInput(Reason.SCHEMA_MISMATCH, "columns are not lists of one length")
    n = lengths.pop() if lengths else 0
    if n > MAX_ROWS:
        raise RejectedInput(Reason.OVERSIZED, f"{n} rows > {MAX_ROWS}")
    if "value" in columns and "value" in schema.names:
        values = columns["value"]
        if any(isinstance(v, str) for v in values):
            text = columns.get("text") or [None] * n
            columns["text"] = [
                v if isinstance(v, str) else t for v, t in zip(values, text, strict=True)
            ]
            columns["value"] = [None if isinstance(v, str) else v for v in values]
    arrays = {}
    for field in schema:
        if field.name not in columns:
            continue
        try:
            arrays[field.name] = pa.array(columns[field.name], type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as e:
            raise RejectedInput(Reason.SCHEMA_MISMATCH, f"column {field.name}: {e}"[:300]) from e
    table = pa.table(arrays) if arrays else pa.table({"_": pa.nulls(n)})
    return Batch(envelope=envelope, table=_conform(table, schema))


def _decode_arrow(body: bytes) -> Batch:
    buf = pa.py_buffer(body)
    # row counts and decompressed sizes are bounded before anything is decompressed
    messages = check_ipc_stream(buf, max_rows=MAX_ROWS, max_decoded_bytes=MAX_DECODED_BYTES)
    if (
        messages
        and messages[0].type == "schema"
        and all(m.type == "record batch" for m in messages[1:])
    ):  # what exporters send: the batches are built from the messages the check read
        return _decode_messages(messages)
    try:
        reader = pa.ipc.open_stream(buf)
    except (pa.ArrowInvalid, OSError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not an Arrow IPC stream: {e}"[:300]) from e
    return _assemble(reader.schema, reader)


def _decode_messages(messages: list[pa.ipc.Message]) -> Batch:
    """:func:`_decode_arrow` for a stream of a schema and record batches only (no
    dictionaries), from its messages as :func:`check_ipc_stream` read them: the stream is
    not parsed a second time (with the one-step envelope: 190 → 158 µs per record of
    382 rows, measured side by side)."""
    try:
        schema = pa.ipc.read_schema(messages[0])
    except (pa.ArrowInvalid, OSError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not an Arrow IPC stream: {e}"[:300]) from e
    return _assemble(schema, (pa.ipc.read_record_batch(m, schema) for m in messages[1:]))


def _assemble(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> Batch:
    """The batch of a stream with this schema and these record batches, each decompressed
    only when the one before it was checked, so the bound holds as they come."""
    envelope = _envelope_bytes((schema.metadata or {}).get(ENVELOPE_KEY))
    kept = []
    total = 0
    for rb in batches:
        total += rb.get_total_buffer_size()  # nbytes walks every buffer: ~70 us a batch
        if total > MAX_DECODED_BYTES:
            raise RejectedInput(Reason.OVERSIZED, f"decoded size over {MAX_DECODED_BYTES} bytes")
        rb.validate(full=True)  # offsets and lengths in range before any kernel reads them
        kept.append(rb)
    table = pa.Table.from_batches(kept, schema=schema)
    return Batch(envelope=envelope, table=_conform(table, PAYLOAD_SCHEMAS[envelope.kind]))


def _envelope_bytes(raw_env: bytes | None) -> Envelope:
    """The envelope from the schema metadata's JSON: parsed and validated in one step by
    pydantic (4.8 µs where ``json.loads`` and a dict validation took 10.7), strictly (no "1" for
    1), so it accepts nothing the long way would refuse; anything it refuses goes the long
    way, which accepts or rejects it for the exact reason :func:`_envelope` gives."""
    if raw_env is None:
        raise RejectedInput(Reason.BAD_ENVELOPE, "schema metadata has no refinery.envelope")
    try:
        env = Envelope.model_validate_json(raw_env, strict=True)
        if env.schema_version in SUPPORTED_SCHEMA_VERSIONS:
            return _in_range(env)
    except ValidationError:
        pass
    try:
        env_doc = json.loads(raw_env)
    except ValueError as e:
        raise RejectedInput(Reason.BAD_ENVELOPE, "envelope metadata is not JSON") from e
    return _envelope(env_doc)


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
