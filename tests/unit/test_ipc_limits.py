"""The IPC bound check on hand-altered streams: a compressed buffer's declared size, a
buffer outside its body, and the exact decoded size it adds up (checked against pyarrow)."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest

from schemas.errors import RejectedInput
from schemas.ipc_limits import _allocation, _batch_of, check_ipc_stream
from schemas.reasons import Reason


def _stream(compression: str | None) -> bytes:
    n = 5000
    t = pa.table({"x": np.arange(n, dtype=np.int64), "s": [f"v{i % 7}" for i in range(n)]})
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, t.schema, options=opts) as w:
        w.write_table(t)
    return bytes(sink.getvalue())


def _batch(data: bytes) -> tuple[pa.ipc.Message, int]:
    """The record batch message of ``data`` and where its body starts in ``data``."""
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
    while True:
        msg = reader.read_next_message()
        if msg.type == "record batch":
            body = msg.body.to_pybytes()
            return msg, data.rindex(body)


def _spans(msg: pa.ipc.Message) -> list[tuple[int, int]]:
    batch = _batch_of(msg.metadata.to_pybytes())
    assert batch is not None
    start, count = batch.vector(2, 16)
    return [struct.unpack_from("<qq", batch.data, start + 16 * i) for i in range(count)]


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_allocation_is_what_pyarrow_allocates(compression: str | None) -> None:
    data = _stream(compression)
    msg, _ = _batch(data)
    batch = _batch_of(msg.metadata.to_pybytes())
    assert batch is not None
    decoded = pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
    buffers = sum(b.size for col in decoded.columns for b in col.buffers() if b is not None)
    got = _allocation(batch, msg.body)
    if compression is None:
        assert got == msg.body.size - sum(-length % 8 for _, length in _spans(msg))
    else:
        assert got == buffers  # the declared sizes are the decoded buffers
        assert got > msg.body.size  # and more than the compressed body


def test_a_declared_size_below_minus_one_is_undecodable() -> None:
    data = bytearray(_stream("lz4"))
    msg, at = _batch(bytes(data))
    offset = next(o for o, length in _spans(msg) if length >= 8)
    data[at + offset : at + offset + 8] = struct.pack("<q", -5)
    with pytest.raises(RejectedInput) as e:
        check_ipc_stream(pa.py_buffer(bytes(data)), max_rows=10**6, max_decoded_bytes=1 << 30)
    assert e.value.reason is Reason.UNDECODABLE and "declares -5 bytes" in str(e.value)


def test_a_huge_declared_size_is_oversized_without_wrapping() -> None:
    data = bytearray(_stream("zstd"))
    msg, at = _batch(bytes(data))
    for offset, length in _spans(msg):
        if length >= 8:  # every buffer claims 2**62 bytes: summed in int64 that would wrap
            data[at + offset : at + offset + 8] = struct.pack("<q", 1 << 62)
    with pytest.raises(RejectedInput) as e:
        check_ipc_stream(pa.py_buffer(bytes(data)), max_rows=10**6, max_decoded_bytes=1 << 30)
    assert e.value.reason is Reason.OVERSIZED


@pytest.mark.parametrize("compression", [None, "lz4"])  # checked in Python / in numpy
def test_a_buffer_outside_the_body_is_undecodable(compression: str | None) -> None:
    data = _stream(compression)
    msg, _ = _batch(data)
    meta = bytearray(msg.metadata.to_pybytes())
    batch = _batch_of(bytes(meta))
    assert batch is not None
    start, count = batch.vector(2, 16)
    last = start + 16 * (count - 1)
    struct.pack_into("<q", meta, last, msg.body.size)  # the last buffer starts at the end
    altered = _batch_of(bytes(meta))
    assert altered is not None
    with pytest.raises(RejectedInput) as e:
        _allocation(altered, msg.body)
    assert e.value.reason is Reason.UNDECODABLE and f"buffer {count - 1} outside" in str(e.value)


@pytest.mark.parametrize("field", [0, 1])  # the offset, the length
@pytest.mark.parametrize("value", [-1, -(1 << 62), "past"])
def test_every_buffer_is_checked_for_negatives_and_the_end_of_the_body(
    field: int, value: int | str
) -> None:
    """Any one buffer of the table made negative or to end past the body, the others left as
    they are: the check names that buffer, whichever it is."""
    data = _stream(None)
    msg, _ = _batch(data)
    base = msg.metadata.to_pybytes()
    batch = _batch_of(base)
    assert batch is not None
    start, count = batch.vector(2, 16)
    spans = _spans(msg)
    for i in range(count):
        meta = bytearray(base)
        off, size = spans[i]
        bad = value if isinstance(value, int) else msg.body.size - (off if field else size) + 1
        struct.pack_into("<q", meta, start + 16 * i + 8 * field, bad)
        altered = _batch_of(bytes(meta))
        assert altered is not None
        with pytest.raises(RejectedInput) as e:
            _allocation(altered, msg.body)
        assert e.value.reason is Reason.UNDECODABLE and f"buffer {i} outside" in str(e.value)
    # and untouched, it passes
    assert _allocation(batch, msg.body) >= 0


def test_a_known_batch_metadata_is_checked_against_each_body_and_limit() -> None:
    """An uncompressed batch whose metadata was checked before: remembered by its bytes, and
    still refused when its rows or decoded size are over this call's limits."""
    from schemas.ipc_limits import _KNOWN

    data = _stream(None)
    msg, at = _batch(data)
    first = check_ipc_stream(pa.py_buffer(data), max_rows=10**6, max_decoded_bytes=1 << 30)
    assert msg.metadata.to_pybytes() in _KNOWN
    again = check_ipc_stream(pa.py_buffer(data), max_rows=10**6, max_decoded_bytes=1 << 30)
    assert [m.type for m in again] == [m.type for m in first]
    with pytest.raises(RejectedInput) as e:
        check_ipc_stream(pa.py_buffer(data), max_rows=4999, max_decoded_bytes=1 << 30)
    assert e.value.reason is Reason.OVERSIZED
    with pytest.raises(RejectedInput) as e:
        check_ipc_stream(pa.py_buffer(data), max_rows=10**6, max_decoded_bytes=1000)
    assert e.value.reason is Reason.OVERSIZED
    # the metadata holds the body's length, and the reader refuses a body of another: the
    # same metadata never comes with a shorter body
    short = data[: at + msg.body.size - 64]
    with pytest.raises(OSError):
        check_ipc_stream(pa.py_buffer(short), max_rows=10**6, max_decoded_bytes=1 << 30)
