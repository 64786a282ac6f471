"""Bounds on an Arrow IPC stream, checked before any body is decompressed or any batch built.

Arrow IPC body compression (lz4 frame or zstd, per buffer) lets a 16 MiB message expand to
gigabytes: pyarrow allocates each buffer's declared uncompressed size while it reads a
record batch, so a limit checked on the decoded batches comes too late. :func:`check_ipc_stream`
walks the stream's messages with :class:`pyarrow.ipc.MessageReader` (no decompression), reads
each record or dictionary batch's flatbuffer metadata (row count, buffer table, compression)
and the 8-byte uncompressed-length prefix of every compressed buffer, and rejects the stream
when the sum of what it would allocate exceeds the bound. Arrow itself refuses a buffer whose
decompressed size differs from its prefix, so the prefixes are a true bound.

Every offset in the metadata is checked against the metadata and body sizes; anything
malformed raises :class:`~schemas.errors.RejectedInput` (``undecodable``), anything too large
``oversized``. Memory used by the check itself: the metadata of one message at a time.
"""

from __future__ import annotations

import operator
import struct

import numpy as np
import pyarrow as pa

from schemas.errors import RejectedInput
from schemas.reasons import Reason

MAX_MESSAGES = 1024  # IPC messages (schema, dictionaries, record batches) in one Kafka record
MAX_BUFFERS = 4096  # buffers in one record batch (our schemas use well under 100)

_HEADER_DICTIONARY_BATCH = 2
_HEADER_RECORD_BATCH = 3


def _bad(detail: str) -> RejectedInput:
    return RejectedInput(Reason.UNDECODABLE, f"malformed Arrow IPC metadata: {detail}")


def _read(fmt: str, data: bytes, pos: int) -> int:
    size = struct.calcsize(fmt)
    if pos < 0 or pos + size > len(data):
        raise _bad(f"offset {pos} outside {len(data)} bytes")
    value: int = struct.unpack_from(fmt, data, pos)[0]
    return value


class _Table:
    """A flatbuffer table at ``pos`` in ``data``, every access bounds-checked."""

    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos
        self.vtable = pos - _read("<i", data, pos)
        self.vtable_size = _read("<H", data, self.vtable)

    def field(self, index: int) -> int | None:
        slot = 4 + 2 * index
        if slot + 2 > self.vtable_size:
            return None
        off = _read("<H", self.data, self.vtable + slot)
        return None if off == 0 else self.pos + off

    def scalar(self, index: int, fmt: str, default: int) -> int:
        pos = self.field(index)
        return default if pos is None else _read(fmt, self.data, pos)

    def table(self, index: int) -> _Table | None:
        pos = self.field(index)
        return None if pos is None else _Table(self.data, pos + _read("<I", self.data, pos))

    def vector(self, index: int, element_size: int) -> tuple[int, int]:
        """(position of the first element, count) of a vector of structs."""
        pos = self.field(index)
        if pos is None:
            return 0, 0
        start = pos + _read("<I", self.data, pos)
        count = _read("<I", self.data, start)
        if start + 4 + count * element_size > len(self.data):
            raise _bad("vector runs past the metadata")
        return start + 4, count


def _batch_of(metadata: bytes) -> _Table | None:
    """The RecordBatch table of a record or dictionary batch message (None for others)."""
    message = _Table(metadata, _read("<I", metadata, 0))
    kind = message.scalar(1, "<B", 0)
    header = message.table(2)
    if header is None or kind not in (_HEADER_RECORD_BATCH, _HEADER_DICTIONARY_BATCH):
        return None
    return header if kind == _HEADER_RECORD_BATCH else header.table(1)


def _check_batch(msg: pa.ipc.Message, meta: bytes, max_rows: int) -> int:
    """The bytes a record or dictionary batch message decodes to, its metadata walked; an
    uncompressed one is remembered in :data:`_KNOWN`."""
    batch = _batch_of(meta)
    if batch is None:
        raise _bad(f"{msg.type} message without a batch header")
    rows = batch.scalar(0, "<q", 0)
    if rows < 0 or rows > max_rows:
        raise RejectedInput(Reason.OVERSIZED, f"record batch of {rows} rows > {max_rows}")
    size = _allocation(batch, msg.body)
    if batch.field(3) is None:  # uncompressed (and every span checked by _allocation)
        start, count = batch.vector(2, 16)
        flat = struct.unpack_from(f"<{2 * count}q", batch.data, start)
        end = max(map(operator.add, flat[0::2], flat[1::2]), default=0)
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.clear()
        _KNOWN[meta] = (rows, end, size)
    return size


def _allocation(batch: _Table, body: pa.Buffer | None) -> int:
    """Bytes reading ``batch`` would allocate for its buffers (decompressed)."""
    compressed = batch.field(3) is not None
    start, count = batch.vector(2, 16)
    if count > MAX_BUFFERS:
        raise RejectedInput(Reason.OVERSIZED, f"{count} buffers in one record batch")
    body_size = body.size if body is not None else 0
    # the buffer table, (offset, length) pairs of little-endian int64, checked pair by pair
    # in Python: a few dozen buffers, where numpy's cost per call was most of the check
    flat = struct.unpack_from(f"<{2 * count}q", batch.data, start)
    for i in range(count):
        off, size = flat[2 * i], flat[2 * i + 1]
        if off < 0 or size < 0 or off > body_size - size:
            raise _bad(f"buffer {i} outside the {body_size}-byte body")
    if not compressed:  # the usual case: exporters leave compression to Kafka
        return sum(flat[1::2])
    spans = np.array(flat, dtype=np.int64).reshape(-1, 2)
    offset, length = spans[:, 0], spans[:, 1]
    sizes = length.copy()
    prefixed = np.flatnonzero(length >= 8)  # a compressed buffer starts with its decoded size
    if len(prefixed):
        assert body is not None
        raw = np.frombuffer(body, dtype=np.uint8)
        at = offset[prefixed][:, None] + np.arange(8)
        declared = np.ascontiguousarray(raw[at]).view("<i8")[:, 0]
        bad = declared < -1
        if bad.any():
            first = int(np.argmax(bad))
            raise _bad(f"buffer {int(prefixed[first])} declares {int(declared[first])} bytes")
        sizes[prefixed] = np.where(declared == -1, length[prefixed] - 8, declared)
    # any one buffer over 2**40 bytes is over every bound: clipped, the sum cannot wrap
    return int(np.minimum(sizes, 1 << 40).sum())


# The bound of an uncompressed record batch message by its metadata bytes (a cache, not
# state): (rows, where its last buffer ends in the body, bytes it decodes to). A source's
# batches repeat their metadata byte for byte (the same rows and buffer spans) and the check
# is then a lookup: every offset and length was found non-negative and inside the body when
# the entry was made (the metadata holds the body's length, which the reader holds the body
# to; where the buffers end is compared with the body again all the same).
_KNOWN: dict[bytes, tuple[int, int, int]] = {}
_KNOWN_MAX = 4096


def check_ipc_stream(
    buf: pa.Buffer, *, max_rows: int, max_decoded_bytes: int
) -> list[pa.ipc.Message]:
    """Raise RejectedInput unless the IPC stream in ``buf`` stays within ``max_rows`` rows per
    record batch, ``max_decoded_bytes`` decompressed bytes in all, :data:`MAX_MESSAGES`
    messages and :data:`MAX_BUFFERS` buffers per batch. Decompresses nothing. Returns the
    messages read (views of ``buf``), for a caller that builds the batches from them rather
    than reading the stream a second time."""
    reader = pa.ipc.MessageReader.open_stream(buf)
    read: list[pa.ipc.Message] = []
    total = 0
    while True:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            return read
        read.append(msg)
        if len(read) > MAX_MESSAGES:
            raise RejectedInput(Reason.OVERSIZED, f"more than {MAX_MESSAGES} IPC messages")
        if msg.type not in ("record batch", "dictionary batch"):
            continue
        meta = msg.metadata.to_pybytes()
        known = _KNOWN.get(meta)
        body_size = msg.body.size if msg.body is not None else 0
        if known is not None and known[1] <= body_size:
            rows, _, size = known
            if rows > max_rows:
                raise RejectedInput(Reason.OVERSIZED, f"record batch of {rows} rows > {max_rows}")
            total += size
        else:
            total += _check_batch(msg, meta, max_rows)
        if total > max_decoded_bytes:
            raise RejectedInput(
                Reason.OVERSIZED,
                f"decompressed size over {max_decoded_bytes} bytes (compression bomb?)",
            )
