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
from schemas.ingest.assemble import Points, SeriesRegistry
from schemas.reasons import Reason

_REG = SeriesRegistry()
_series: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
_lines: dict[tuple[str, tuple[str, ...]], list[int]] = {}
_gen = [0]
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


def _ids(series: str, names: tuple[str, ...]) -> list[int]:
    """The series ids of a line's fields, cached by the line's series part and field names."""
    got = _lines.get((series, names))
    if got is None:
        meas, tags = _parse_series(series)
        got = [_REG.id_of((f"{meas}.{_unescape(f)}", tags, "")) for f in names]
        _lines[(series, names)] = got
    return got


def _fields(line: str, number: int) -> tuple[str, list[str], list[str], str]:
    """A line's series part, field names, field values and timestamp."""
    if "\\" not in line and '"' not in line:  # no escape, no string: split only
        parts = line.split(" ")
        kv = parts[1].replace(",", "=").split("=") if len(parts) in (2, 3) else []
        if len(parts) not in (2, 3) or not parts[0] or len(kv) % 2 or "" in kv:
            raise RejectedInput(Reason.UNDECODABLE, f"line {number}: not line protocol: "
                                f"{line[:80]!r}")  # fmt: skip
        return parts[0], kv[0::2], kv[1::2], parts[2] if len(parts) == 3 else ""
    parts = _split(line, " ")
    fields = _split(parts[1], ",") if len(parts) in (2, 3) else []
    if not parts[0] or not fields:
        raise RejectedInput(Reason.UNDECODABLE, f"line {number}: not line protocol: {line[:80]!r}")
    names, vals = [], []
    for f in fields:
        name, eq, v = f.partition("=")
        if not eq or not v or not name:
            raise RejectedInput(Reason.UNDECODABLE, f"line {number}: field {f[:64]!r}")
        names.append(name)
        vals.append(v)
    return parts[0], names, vals, parts[2] if len(parts) == 3 else ""


def decode_influx(body: bytes) -> Points:
    """Every field of every line; :class:`RejectedInput` ``undecodable`` naming the first
    malformed line or value."""
    if _REG.begin() != _gen[0] or len(_lines) > 200_000 or len(_series) > 200_000:
        _lines.clear()
        _series.clear()
        _gen[0] = _REG.generation
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not UTF-8: {e}"[:300]) from e
    gids: list[int] = []
    vals: list[str] = []
    stamps: list[str | None] = []
    counts: list[int] = []
    _read_lines(text, gids, vals, stamps, counts)
    return _points(gids, vals, stamps, counts)


def _read_lines(
    text: str, gids: list[int], vals: list[str], stamps: list[str | None], counts: list[int]
) -> int:
    """Append the points of every line of ``text`` to the lists; the number of lines read
    (comments and blank lines left out)."""
    lines = 0
    for number, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#" or line.isspace():
            continue
        series, names, vs, stamp = _fields(line.rstrip("\r"), number)
        gids += _ids(series, tuple(names))
        vals += vs
        stamps.append(stamp or None)
        counts.append(len(vs))
        lines += 1
    return lines


def _points(
    gids: list[int], vals: list[str], stamps: list[str | None], counts: list[int]
) -> Points:
    n = len(vals)
    if n <= 64:  # a few fields: Python per value costs less than a dozen Arrow calls
        return _few_points(gids, vals, stamps, counts)
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
        per_line = pa.array(stamps, pa.string()).cast(pa.int64()).fill_null(-1).to_numpy()
        ts = np.repeat(per_line, counts)
    except pa.ArrowInvalid as e:
        raise RejectedInput(Reason.UNDECODABLE, f"a value is no number: {e}"[:300]) from e
    text: list[str | None] | None = None
    if is_str.any():
        text = [None] * n
        for i in np.flatnonzero(is_str).tolist():
            text[i] = vals[i][1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return Points(_REG, np.array(gids, dtype=np.int64), ts, value, exact=exact,
                  exact_ok=exact_ok, text=text)  # fmt: skip


_TRUE_S = frozenset(_TRUE.to_pylist())
_FALSE_S = frozenset(_FALSE.to_pylist())


def _few_points(
    gids: list[int], vals: list[str], stamps: list[str | None], counts: list[int]
) -> Points:
    value: list[float] = []
    exact: list[int] = []
    text: list[str | None] | None = None
    try:
        for i, v in enumerate(vals):
            c = v[-1]
            x = 0
            if c == "i" or c == "u":
                x = int(v[:-1])
                value.append(float(x))
            elif c == '"':
                text = text or [None] * len(vals)
                text[i] = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
                value.append(float("nan"))
            elif v in _TRUE_S or v in _FALSE_S:
                value.append(1.0 if v in _TRUE_S else 0.0)
            else:
                value.append(float(v))
            exact.append(x if 0 <= x < 2**64 and c in "iu" else -1)
        per_line = [int(s) if s else -1 for s in stamps]
    except ValueError as e:
        raise RejectedInput(Reason.UNDECODABLE, f"a value is no number: {e}"[:300]) from e
    ok = np.array([e >= 0 for e in exact], dtype=bool)
    return Points(
        _REG,
        np.array(gids, dtype=np.int64),
        np.repeat(np.array(per_line, dtype=np.int64), counts),
        np.array(value, dtype=np.float64),
        exact=np.array([max(e, 0) for e in exact], dtype=np.uint64),
        exact_ok=ok,
        text=text,
    )


def decode_influx_many(bodies: list[bytes]) -> tuple[Points, np.ndarray, dict[int, RejectedInput]]:
    """:func:`decode_influx` of many messages in one pass: the points of all, each sample's
    message index, and the messages rejected alone (their lines left out). A value that is
    no number raises for the whole set (the caller decodes it message by message)."""
    if _REG.begin() != _gen[0] or len(_lines) > 200_000 or len(_series) > 200_000:
        _lines.clear()
        _series.clear()
        _gen[0] = _REG.generation
    gids: list[int] = []
    vals: list[str] = []
    stamps: list[str | None] = []
    counts: list[int] = []
    owner: list[int] = []  # each line's message
    bad: dict[int, RejectedInput] = {}
    for k, body in enumerate(bodies):
        marks = len(gids), len(vals), len(stamps)
        try:
            text = body.decode("utf-8")
            owner += [k] * _read_lines(text, gids, vals, stamps, counts)
        except (RejectedInput, UnicodeDecodeError) as e:
            bad[k] = e if isinstance(e, RejectedInput) else RejectedInput(
                Reason.UNDECODABLE, f"not UTF-8: {e}"[:300])  # fmt: skip
            del gids[marks[0] :], vals[marks[1] :], stamps[marks[2] :]
            del counts[marks[2] :], owner[marks[2] :]
    points = _points(gids, vals, stamps, counts)
    msg = np.repeat(np.array(owner, dtype=np.int64), counts)
    return points, msg, bad
