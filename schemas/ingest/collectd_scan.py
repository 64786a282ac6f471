"""A wave of collectd ``write_kafka`` messages read by byte scans over their joined text.

write_kafka sends one value list a message, and from one interval to the next a series'
message differs only in its ``values`` and its ``time``. So the wave is scanned with numpy
for those two keys; what remains of each message once their numbers are cut out (its
*template*: host, plugin, type, instances, dstypes, dsnames, interval) is parsed by
``json`` once per distinct template and remembered with its series ids, and the numbers of
the whole wave are read by Arrow's string casts at once. No Python runs per message.

Only a regular wave takes this path: no backslash (no escapes), each message one line with
exactly one ``"values"`` key holding numbers or nulls and one ``"time"`` key holding a JSON
number, its template one value list that :class:`~schemas.ingest.collectd._Lists` accepts.
Anything else returns None and the caller reads the wave as before (each bad message then
rejected alone, with its reason). A message read here gives exactly what ``json.loads`` and
:class:`~schemas.ingest.collectd._Lists` give it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.ingest.assemble import Points, SeriesRegistry

_NEVER = (b"\r", b"\\", b"\x00")  # a carriage return, an escape, a NUL: not this path
_PAD = 16


class _Templates:
    """Each distinct template's data sources as columns: ``first[c]`` its first row in
    the per-source columns, ``count[c]`` how many (series id, rate, absolute), ``interval``."""

    def __init__(self) -> None:
        self.code: dict[bytes, int] = {}
        self.generation = -1
        self.first: list[int] = []
        self.count: list[int] = []
        self.interval: list[float] = []
        self.sid: list[int] = []
        self.rate: list[bool] = []
        self.absolute: list[bool] = []
        self.arrays: tuple[np.ndarray, ...] | None = None

    def reset(self, generation: int) -> None:
        self.__init__()  # type: ignore[misc]
        self.generation = generation

    def add(self, sids: list[int], rate: list[bool], absolute: list[bool], iv: float) -> int:
        self.first.append(len(self.sid))
        self.count.append(len(sids))
        self.interval.append(iv)
        self.sid += sids
        self.rate += rate
        self.absolute += absolute
        self.arrays = None
        return len(self.count) - 1

    def columns(self) -> tuple[np.ndarray, ...]:
        if self.arrays is None:
            self.arrays = (
                np.array(self.first, dtype=np.int64), np.array(self.count, dtype=np.int64),
                np.array(self.interval, dtype=np.float64), np.array(self.sid, dtype=np.int64),
                np.array(self.rate, dtype=bool), np.array(self.absolute, dtype=bool),
            )  # fmt: skip
        return self.arrays


_TEMPLATES = {False: _Templates(), True: _Templates()}
_LIMIT = 50_000


def _skip(a: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``p`` moved past one space (``json.dumps``'s spelling; more make the checks that
    follow fail, and the wave takes the JSON path)."""
    moved: np.ndarray = p + (a[p] == 32)
    return moved


def _quotes(a: np.ndarray, first: bytes) -> np.ndarray:
    """Where a quote is followed by one of the bytes ``first``: every key that may follow."""
    m = len(a) - 16
    after = a[1 : m + 1]
    hit = after == first[0]
    for c in first[1:]:
        hit |= after == c
    found: np.ndarray = np.flatnonzero(hit & (a[:m] == 34))
    return found


def _keys(a: np.ndarray, c: np.ndarray, name: bytes) -> np.ndarray:
    """Of the quotes ``c``, where the key ``name`` is followed by its colon: the position
    after the colon."""
    n = len(name)
    c = c[a[c + n + 1] == 34]
    for i in range(n):
        c = c[a[c + 1 + i] == name[i]]
    colon = _skip(a, c + n + 2)
    after: np.ndarray = colon[a[colon] == ord(":")] + 1
    return after


def _one_each(pos: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether each message ``[starts, ends)`` holds exactly one of ``pos`` (ascending)."""
    return len(pos) == len(starts) and bool(((pos >= starts) & (pos < ends)).all())


def _span_index(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The positions of the spans ``[lo, hi)``, one after the other."""
    lens = hi - lo
    off = np.cumsum(lens) - lens
    idx: np.ndarray = np.repeat(lo - off, lens) + np.arange(int(lens.sum()))
    return idx


def _ends(a: np.ndarray, start: np.ndarray, stops: tuple[int, ...], width: int) -> np.ndarray:
    """The first of ``stops`` at or after each ``start`` within ``width`` bytes (-1: none)."""
    w = a[start[:, None] + np.arange(width)]
    hit = w == stops[0]
    for s in stops[1:]:
        hit |= w == s
    first = np.argmax(hit, axis=1)
    return np.where(hit[np.arange(len(start)), first], start + first, -1)


def _locate(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """(values' ``[``, its ``]``, time's first byte, its end) per message, or None."""
    q = _quotes(a, b"vt")
    lb = _skip(a, _keys(a, q, b"values"))
    t0 = _skip(a, _keys(a, q, b"time"))
    if not (_one_each(lb, starts, ends) and _one_each(t0, starts, ends)):
        return None
    if not (a[lb] == ord("[")).all():
        return None
    rbs = np.flatnonzero(a == ord("]"))
    k = np.searchsorted(rbs, lb)
    if (k >= len(rbs)).any():
        return None
    rb = rbs[k]
    t1 = _ends(a, t0, (ord(","), ord("}")), 40)
    stop = t1
    if (rb >= ends).any() or (stop < 0).any() or (stop >= ends).any() or (t1 <= t0).any():
        return None
    return lb, rb, t0, t1


def _numbers(a: np.ndarray, lb: np.ndarray, rb: np.ndarray) -> tuple[Any, ...] | None:
    """The values of every message, read by ``json`` as one document: (per message count,
    float value, exact, exact ok)."""
    lens = rb + 1 - (lb + 1)  # each list's text and its closing bracket
    data = a[_span_index(lb + 1, rb + 1)]
    ends = np.cumsum(lens)
    data[ends - 1] = ord(",")  # the lists one after the other: one list
    count = np.add.reduceat((data == ord(",")).astype(np.int64), ends - lens)
    text = data[:-1].tobytes()
    flat = json.loads(b"[" + text + b"]")
    # a message's values are at most its commas + 1 (commas within a value add): the same
    # total means each has exactly as many as its commas say
    if len(flat) != int(count.sum()):
        return None
    arr = np.array(flat)
    if arr.dtype.kind == "i" and b"true" not in text and b"false" not in text:
        value = arr.astype(np.float64)
        ok = arr >= 0
        return count, value, np.where(ok, arr, 0).astype(np.uint64), ok
    if arr.dtype.kind == "f" and b"true" not in text and b"false" not in text:
        ok = np.array([type(x) is int for x in flat], dtype=bool) & (arr >= 0)
        exact = np.zeros(len(flat), dtype=np.uint64)
        exact[ok] = [x for x, o in zip(flat, ok.tolist(), strict=True) if o]
        return count, arr, exact, ok
    return _numbers_slow(flat, count)


def _numbers_slow(flat: list[Any], count: np.ndarray) -> tuple[Any, ...] | None:
    """Values with nulls or integers past int64, one by one, as :class:`_Lists` reads them."""
    value, exact = [], []
    for v in flat:
        if v is not None and type(v) not in (int, float):
            return None
        value.append(float("nan") if v is None else float(v))
        exact.append(type(v) is int and 0 <= v < 2**64)
    ok = np.array(exact, dtype=bool)
    ex = np.zeros(len(flat), dtype=np.uint64)
    ex[ok] = [v for v, o in zip(flat, exact, strict=True) if o]
    return count, np.array(value, dtype=np.float64), ex, ok


def _times(a: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray | None:
    """Each message's time in ns, where every one is plain decimal digits with at most
    one inner point (write_kafka's ``%.3f``); None otherwise (the caller's JSON path)."""
    data = a[_span_index(t0, t1)]
    digit = (data >= 48) & (data <= 57)
    point = data == 46
    off = np.zeros(len(t0) + 1, dtype=np.int32)
    np.cumsum(t1 - t0, out=off[1:])
    first, last = off[:-1], off[1:] - 1
    if not (digit | point).all() or (point[first] | point[last]).any():
        return None
    if (np.add.reduceat(point.view(np.int8), first) > 1).any():
        return None
    zero = (data[first] == 48) & (last > first)  # a leading zero: "0.5" only
    if (zero & ~point[np.minimum(first + 1, len(data) - 1)]).any():
        return None
    tok = pa.StringArray.from_buffers(len(t0), pa.py_buffer(off), pa.py_buffer(data))
    t = pc.cast(tok, pa.float64()).to_numpy()
    if not (t < 9e9).all():
        return None
    ts: np.ndarray = np.rint(t * 1e6).astype(np.int64) * 1000
    return ts


def _template_keys(a: np.ndarray, lb: np.ndarray, rb: np.ndarray, t0: np.ndarray,
                   t1: np.ndarray, size: int) -> list[bytes]:  # fmt: skip
    """Each message without its values and its time but the first byte, one a line."""
    c = a[:size].copy()
    c[_span_index(np.concatenate([lb + 1, t0 + 1]), np.concatenate([rb, t1]))] = 0
    out: list[bytes] = c.tobytes().translate(None, b"\x00").split(b"\n")
    return out


Describe = Any  # (value list of a template) -> (series ids, rate, absolute, interval)


def _template_codes(keys: list[bytes], store_rates: bool, reg: SeriesRegistry,
                    describe: Describe) -> np.ndarray | None:  # fmt: skip
    """Each template's code in the cache (parsed and described on first sight)."""
    cache = _TEMPLATES[store_rates]
    if cache.generation != reg.generation or len(cache.code) > _LIMIT:
        cache.reset(reg.generation)
    code = cache.code
    try:
        return np.fromiter(map(code.__getitem__, keys), np.int64, len(keys))
    except KeyError:
        pass  # a template not seen yet
    for k in set(keys).difference(code):
        try:
            doc = json.loads(k)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict)):
            return None
        vl = doc[0]
        if vl.get("values") != [] or type(vl.get("time")) is not int:
            return None
        got = describe(vl)
        if got is None:
            return None
        code[k] = cache.add(*got)
    return np.fromiter(map(code.__getitem__, keys), np.int64, len(keys))


def scan_wave(
    bodies: list[bytes], store_rates: bool, reg: SeriesRegistry, describe: Describe
) -> tuple[Points, np.ndarray] | None:
    """The points of a regular wave of write_kafka messages and each sample's message
    index (ascending); None where the wave is not regular (see the module)."""
    n = len(bodies)
    joined = b"\n".join(bodies)
    if n == 0 or any(c in joined for c in _NEVER):
        return None
    a = np.frombuffer(joined + b"\n" * _PAD, np.uint8)
    if np.count_nonzero(a == 10) != n - 1 + _PAD:  # one line a message
        return None
    lens = np.fromiter(map(len, bodies), np.int64, n)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lens[:-1] + 1, out=starts[1:])
    ends = starts + lens
    try:
        where = _locate(a, starts, ends)
        if where is None:
            return None
        lb, rb, t0, t1 = where
        nums = _numbers(a, lb, rb)
        ts = _times(a, t0, t1)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, RecursionError):
        return None
    if nums is None or ts is None:
        return None
    keys = _template_keys(a, lb, rb, t0, t1, len(joined))
    if len(keys) != n:
        return None
    codes = _template_codes(keys, store_rates, reg, describe)
    if codes is None:
        return None
    count, value, exact, whole = nums
    first, nds, interval, sid, rate, absolute = _TEMPLATES[store_rates].columns()
    if not (count == nds[codes]).all():
        return None
    owner = np.repeat(np.arange(n), count)
    row_start = np.cumsum(count) - count
    ds = first[codes][owner] + np.arange(len(owner)) - row_start[owner]
    r, ab = rate[ds], absolute[ds]
    if not store_rates and ab.any():
        iv = interval[codes][owner]
        with np.errstate(divide="ignore", invalid="ignore"):
            value = np.where(ab, np.where(iv > 0, value / iv, np.nan), value)
    ok = whole & ~r
    points = Points(reg, sid[ds], ts[owner], value, exact=np.where(ok, exact, 0).astype(np.uint64),
                    exact_ok=ok)  # fmt: skip
    return points, owner
