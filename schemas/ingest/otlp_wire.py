"""The hot part of OTLP protobuf: a gauge's or sum's number data points read from the wire.

Walking upb point objects costs ~4 µs a point (attribute messages, oneofs, tuples). Here the
serialized ``Gauge``/``Sum`` is scanned once for each point's field offsets (a short loop of
byte compares: ``NumberDataPoint`` is fields 2 start fixed64, 3 time fixed64, 4 as_double,
6 as_int sfixed64, 7 attributes, 8 flags), the fixed-width fields are read with one numpy
gather per column, and a point's series comes from its attribute *bytes*, resolved through
the attribute decoder once per distinct attribute set. Anything else in a point (exemplars,
unknown fields, scattered attributes) returns None and the caller takes the generic path:
both give the same table.
"""

from __future__ import annotations

import numpy as np

_PAD = b"\0" * 8
Scan = tuple[list[bytes], np.ndarray, np.ndarray]  # attribute bytes, offsets, as_int


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    """(value, index after) of the varint at ``i``."""
    out = shift = 0
    while True:
        b = raw[i]
        out |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return out, i
        shift += 7


def _point(raw: bytes, i: int, end: int) -> tuple[int, int, int, bool, int, int] | None:
    """(start, time, value offsets (-1: absent), value is as_int, attributes span) of the
    point in ``raw[i:end]``; None where it holds anything else."""
    s = t = v = a0 = a1 = -1
    integer = False
    while i < end:
        f = raw[i]
        if f == 0x19:
            t, i = i + 1, i + 9
        elif f == 0x21 or f == 0x31:
            v, integer, i = i + 1, f == 0x31, i + 9
        elif f == 0x11:
            s, i = i + 1, i + 9
        elif f == 0x3A:
            if a0 < 0:
                a0 = i
            elif a1 != i:
                return None  # attributes scattered among other fields
            n = raw[i + 1]
            i = i + 2 + n if n < 0x80 else sum(_varint(raw, i + 1))
            a1 = i
        elif f == 0x40:
            i = _varint(raw, i + 1)[1]
        else:
            return None
    if i != end:
        return None
    return s, t, v, integer, a0, a1


def _slow(raw: bytes, spans: list[tuple[int, int]]) -> Scan | None:
    attrs: list[bytes] = []
    offs: list[tuple[int, int, int]] = []
    ints: list[bool] = []
    pad = len(raw)
    for i, end in spans:
        p = _point(raw, i, end)
        if p is None:
            return None
        s, t, v, integer, a0, a1 = p
        attrs.append(raw[a0:a1] if a0 >= 0 else b"")
        offs.append((s if s >= 0 else pad, t if t >= 0 else pad, v if v >= 0 else pad))
        ints.append(integer)
    return attrs, np.array(offs, dtype=np.int64).reshape(-1, 3), np.array(ints, dtype=bool)


def _spans(raw: bytes) -> list[tuple[int, int]] | None:
    """(start, end) of each point of a serialized Gauge or Sum; None: something else."""
    spans: list[tuple[int, int]] = []
    n, i = len(raw), 0
    while i < n:
        tag = raw[i]
        if tag == 0x0A:
            ln = raw[i + 1]
            ln, i = (ln, i + 2) if ln < 0x80 else _varint(raw, i + 1)
            spans.append((i, i + ln))
            i += ln
        elif tag == 0x10 or tag == 0x18:  # Sum's temporality and is_monotonic
            i = _varint(raw, i + 1)[1]
        else:
            return None
    return spans if i == n else None


def scan(raw: bytes, uniform: bool = True) -> Scan | None:
    """Attribute bytes per point, offsets (n, 3: start, time, value; absent: past the end,
    where 8 zero bytes are appended) and as_int flags of a serialized Gauge or Sum; None
    where a point needs the generic path.

    ``uniform``: points laid out as the SDKs write them (start, time, value, then the
    rest) are taken whole at once and the rest is their attribute bytes: the caller must
    check, once per distinct such bytes, that they hold attributes only (else call again
    with ``uniform=False``, which reads each point field by field)."""
    spans = _spans(raw)
    if spans is None:
        return None
    if not uniform or not spans:
        return _slow(raw, spans)
    se = np.array(spans, dtype=np.int64)
    s0, end = se[:, 0], se[:, 1]
    buf = np.frombuffer(raw, dtype=np.uint8)
    if not bool(np.all(end - s0 >= 27)):
        return _slow(raw, spans)
    tag = buf[s0 + 18]
    ok = (buf[s0] == 0x11) & (buf[s0 + 9] == 0x19) & ((tag == 0x21) | (tag == 0x31))
    if not bool(ok.all()):
        return _slow(raw, spans)
    attrs = [raw[a + 27 : b] for a, b in spans]
    offs = np.stack([s0 + 1, s0 + 10, s0 + 19], axis=1)
    return attrs, offs, tag == 0x31


def columns(raw: bytes, offs: np.ndarray) -> np.ndarray:
    """The 8 bytes at each offset, as an (n, 3) array of little-endian uint64."""
    buf = np.frombuffer(raw + _PAD, dtype=np.uint8)
    idx = offs[..., None] + np.arange(8)
    return buf[idx].reshape(-1, 8).copy().view("<u8").reshape(offs.shape)
