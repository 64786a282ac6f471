"""Influx line protocol, as Telegraf's Kafka output writes it (``data_format = "influx"``,
the default): one or many lines per message, ``measurement,tag=v field=1i,f2=2.5 <ns>``.

A series is ``measurement.field`` with the line's tags as labels (``host`` names the node).
Field values: float, integer (``i``), unsigned (``u``), boolean, string (a string goes to
``text``). Integers keep their exact value for counters. The series part of a line is parsed
once per distinct series; a line with no escape and no quote takes a split-only path.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points
from schemas.ingest.mapping import SeriesKey
from schemas.reasons import Reason

_series: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
_keys: dict[tuple[str, str], SeriesKey] = {}
_TRUE = pa.array(["t", "T", "true", "True", "TRUE"])
_FALSE = pa.array(["f", "F", "false", "False", "FALSE"])


def _split(s: str, sep: str) -> list[str]:
    """``s`` split at ``sep`` outside quotes and not escaped by a backslash."""
    out, cur, quoted, i = [], [], False, 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cur.append(s[i : i + 2])
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        if c == sep and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def _unescape(s: str) -> str:
    return s.replace("\\,", ",").replace("\\=", "=").replace("\\ ", " ").replace('\\"', '"')


def _parse_series(part: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    got = _series.get(part)
    if got is None:
        items = _split(part, ",") if "\\" in part else part.split(",")
        tags = []
        for item in items[1:]:
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise RejectedInput(Reason.UNDECODABLE, f"tag {item[:64]!r} has no '='")
            tags.append((_unescape(k), _unescape(v)))
        if len(_series) > 200_000:
            _series.clear()
        got = _series[part] = (_unescape(items[0]), tuple(sorted(tags)))
    return got


def _key(part: str, field: str) -> SeriesKey:
    k = _keys.get((part, field))
    if k is None:
        meas, tags = _parse_series(part)
        if len(_keys) > 200_000:
            _keys.clear()
        k = _keys[(part, field)] = (f"{meas}.{_unescape(field)}", tags, "")
    return k


def _line_parts(line: str, number: int) -> tuple[str, list[str], str]:
    if "\\" not in line and '"' not in line:
        parts = line.split(" ")
        fields = parts[1].split(",") if len(parts) > 1 else []
    else:
        parts = _split(line, " ")
        fields = _split(parts[1], ",") if len(parts) > 1 else []
    if len(parts) not in (2, 3) or not fields or not parts[0]:
        raise RejectedInput(Reason.UNDECODABLE, f"line {number}: not line protocol: {line[:80]!r}")
    return parts[0], fields, parts[2] if len(parts) == 3 else ""


def decode_influx(body: bytes) -> Points:
    """Every field of every line; :class:`RejectedInput` ``undecodable`` naming the first
    malformed line or value."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not UTF-8: {e}"[:300]) from e
    index: dict[SeriesKey, int] = {}
    keys: list[SeriesKey] = []
    sids: list[int] = []
    vals: list[str] = []
    stamps: list[str] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#" or line.isspace():
            continue
        series, fields, stamp = _line_parts(line.rstrip("\r"), number)
        for f in fields:
            name, eq, v = f.partition("=")
            if not eq or not v:
                raise RejectedInput(Reason.UNDECODABLE, f"line {number}: field {f[:64]!r}")
            k = _key(series, name)
            j = index.get(k)
            if j is None:
                j = index[k] = len(keys)
                keys.append(k)
            sids.append(j)
            vals.append(v)
            stamps.append(stamp)
    return _points(keys, sids, vals, stamps)


def _points(keys: list[SeriesKey], sids: list[int], vals: list[str], stamps: list[str]) -> Points:
    n = len(vals)
    arr = pa.array(vals, pa.string())
    suffix = pc.utf8_slice_codeunits(arr, -1)
    is_int = pc.is_in(suffix, pa.array(["i", "u"])).to_numpy(zero_copy_only=False)
    is_str = pc.starts_with(arr, '"').to_numpy(zero_copy_only=False)
    is_true = pc.is_in(arr, _TRUE).to_numpy(zero_copy_only=False)
    is_bool = is_true | pc.is_in(arr, _FALSE).to_numpy(zero_copy_only=False)
    is_float = ~(is_int | is_str | is_bool)
    value = np.where(is_true, 1.0, np.where(is_bool, 0.0, np.nan))
    exact = np.zeros(n, dtype=np.uint64)
    exact_ok = np.zeros(n, dtype=bool)
    try:
        if is_float.any():
            value[is_float] = arr.filter(pa.array(is_float)).cast(pa.float64()).to_numpy()
        if is_int.any():
            digits = pc.utf8_slice_codeunits(arr.filter(pa.array(is_int)), 0, -1)
            value[is_int] = digits.cast(pa.float64()).to_numpy()
            nonneg = ~pc.starts_with(digits, "-").to_numpy(zero_copy_only=False)
            where = np.flatnonzero(is_int)[nonneg]
            exact[where] = digits.filter(pa.array(nonneg)).cast(pa.uint64()).to_numpy()
            exact_ok[where] = True
        ts = np.full(n, -1, dtype=np.int64)
        given = pc.not_equal(pa.array(stamps, pa.string()), "").to_numpy(zero_copy_only=False)
        if given.any():
            ts[given] = pa.array(stamps).filter(pa.array(given)).cast(pa.int64()).to_numpy()
    except pa.ArrowInvalid as e:
        raise RejectedInput(Reason.UNDECODABLE, f"a value is no number: {e}"[:300]) from e
    text: list[str | None] | None = None
    if is_str.any():
        text = [None] * n
        for i in np.flatnonzero(is_str).tolist():
            text[i] = vals[i][1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return Points(keys, np.array(sids, dtype=np.int64), ts, value, exact=exact,
                  exact_ok=exact_ok, text=text)  # fmt: skip
