"""collectd ``write_kafka`` JSON (``Format JSON``): an array of value lists, each
``{"values": [...], "dstypes": [...], "dsnames": [...], "time": s, "interval": s,
"host": ..., "plugin": ..., "plugin_instance": ..., "type": ..., "type_instance": ...}``.

A series is ``plugin/type/dsname`` with labels ``host`` (the node), ``plugin_instance`` and
``type_instance``. ``gauge`` values are gauges. ``derive`` and ``counter`` values are the
cumulative counters, unless the producers run ``StoreRates true`` (write_kafka's default):
then they are per-second rates under the same names, and nothing in a message says so. The
topic's declared format says which (``store_rates``): a rate is never taken for a counter;
it maps to the counter's rate gauge. ``absolute`` (a count since the last reading) becomes a
rate (value / interval) in both modes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points, SeriesRegistry
from schemas.ingest.collectd_scan import scan_wave
from schemas.ingest.mapping import SeriesKey
from schemas.reasons import Reason

_REG = SeriesRegistry()
_CUMULATIVE = frozenset({"derive", "counter"})


def _labels(vl: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for k in ("host", "plugin_instance", "type_instance"):
        v = vl.get(k)
        if isinstance(v, str) and v:
            out.append((k, v))
    return tuple(out)


def _hint(t: Any, store_rates: bool) -> str:
    return "rate" if (t in _CUMULATIVE and store_rates) or t == "absolute" else ""


def _describe(vl: dict[str, Any], store_rates: bool) -> tuple[Any, ...] | None:
    """A template's data sources (:mod:`schemas.ingest.collectd_scan`) as
    :meth:`_Lists.add` reads them: (series ids, rate, absolute, interval); None where it
    would reject the value list."""
    try:
        types, names = vl["dstypes"], vl["dsnames"]
        float(vl["time"])
        interval = float(vl.get("interval") or 0.0)
        base = f"{vl['plugin']}/{vl['type']}/"
        labels = _labels(vl)
        if not (isinstance(types, list) and isinstance(names, list)) or len(types) != len(names):
            return None
        hints = [_hint(t, store_rates) for t in types]
        keys = [(base + str(name), labels, h) for name, h in zip(names, hints, strict=True)]
        sids = [_REG.id_of(k) for k in keys]
        return sids, [bool(h) for h in hints], [t == "absolute" for t in types], interval
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def _doc(body: bytes) -> list[Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not JSON: {e}"[:300]) from e
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise RejectedInput(Reason.UNDECODABLE, "not a collectd value list array")
    return doc


class _Lists:
    """Points collected value by value (the one-message path)."""

    def __init__(self) -> None:
        self.sids: list[int] = []
        self.ts: list[int] = []
        self.vals: list[float] = []
        self.exact: list[int] = []
        self.owner: list[int] = []

    def add(self, doc: list[Any], store_rates: bool, owner: int = 0) -> None:
        """Every data source of ``doc``'s value lists; nothing added where one is bad."""
        sids: list[int] = []
        ts: list[int] = []
        vals: list[float] = []
        exact: list[int] = []
        for n, vl in enumerate(doc):
            try:
                values, types, names = vl["values"], vl["dstypes"], vl["dsnames"]
                when = round(float(vl["time"]) * 1e6) * 1000  # written as %.3f s
                interval = float(vl.get("interval") or 0.0)
                base = f"{vl['plugin']}/{vl['type']}/"
                labels = _labels(vl)
                if not (len(values) == len(types) == len(names)):
                    raise ValueError("values, dstypes and dsnames differ in length")
                for v, t, name in zip(values, types, names, strict=True):
                    hint = _hint(t, store_rates)
                    x = float("nan") if v is None else float(v)
                    if t == "absolute" and not store_rates:
                        x = x / interval if interval > 0 else float("nan")
                    k: SeriesKey = (base + str(name), labels, hint)
                    sids.append(_REG.id_of(k))
                    ts.append(when)
                    vals.append(x)
                    exact.append(v if isinstance(v, int) and 0 <= v < 2**64 and not hint else -1)
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise RejectedInput(Reason.UNDECODABLE, f"value list {n}: {e!r}"[:300]) from e
        self.sids += sids
        self.ts += ts
        self.vals += vals
        self.exact += exact
        self.owner += [owner] * len(sids)

    def points(self) -> Points:
        ex = np.array(self.exact, dtype=object)
        ok = np.array([e >= 0 for e in self.exact], dtype=bool)
        return Points(
            _REG,
            np.array(self.sids, dtype=np.int64),
            np.array(self.ts, dtype=np.int64),
            np.array(self.vals, dtype=np.float64),
            exact=np.where(ok, ex, 0).astype(np.uint64),
            exact_ok=ok,
        )


def decode_collectd(body: bytes, store_rates: bool) -> Points:
    """Every data source of every value list; :class:`RejectedInput` ``undecodable`` for
    anything that is not write_kafka's JSON."""
    doc = _doc(body)
    _REG.begin()
    c = _Lists()
    c.add(doc, store_rates)
    return c.points()


_KEYS: dict[str, int] = {}  # joined series text -> id in _REG (of its generation)
_KEYS_GEN = [-1]
_SEP = "\x1f"
_REQUIRED = ("values", "dstypes", "dsnames", "time", "plugin", "type")
_LABELS = ("host", "plugin_instance", "type_instance")


def _string(tab: pa.Table, name: str) -> pa.Array:
    if name not in tab.column_names:
        return pa.nulls(tab.num_rows, pa.string())
    col = tab.column(name).combine_chunks()
    if pa.types.is_null(col.type):
        return pa.nulls(tab.num_rows, pa.string())
    if not pa.types.is_string(col.type):
        raise TypeError(f"{name} is {col.type}")
    return col


def _one_line_list(b: bytes) -> bool:
    """One value list on one line, as write_kafka writes it."""
    return (
        b[:2] == b"[{"
        and b[-2:] == b"}]"
        and b"\n" not in b
        and b"\r" not in b
        and b.count(b'"values"') == 1
    )


_VALUES = np.frombuffer(b'"values"', np.uint8)


def _one_line(bodies: list[bytes]) -> tuple[list[int], Any]:
    """The messages that hold :func:`_one_line_list`, checked on all of them joined by
    newlines at once; and, when all do, that text with each one's outer brackets blanked
    (one JSON object a line for Arrow's reader), else None."""
    n = len(bodies)
    buf = b"\n".join(bodies)
    lens = np.fromiter(map(len, bodies), np.int64, n)
    if n == 0 or buf.count(b"\n") != n - 1 or b"\r" in buf or lens.min() < len(_VALUES):
        return [k for k, b in enumerate(bodies) if _one_line_list(b)], None
    a = np.frombuffer(buf, np.uint8)
    hit = a[: len(a) - len(_VALUES) + 1] == _VALUES[0]
    for i in range(1, len(_VALUES)):
        hit &= a[i : len(a) - len(_VALUES) + 1 + i] == _VALUES[i]
    starts = np.cumsum(lens + 1) - lens - 1
    ends = starts + lens
    count = np.bincount(np.searchsorted(starts, np.flatnonzero(hit), "right") - 1, minlength=n)
    ok = (count == 1) & (a[starts] == ord("[")) & (a[starts + 1] == ord("{"))
    ok &= (a[ends - 2] == ord("}")) & (a[ends - 1] == ord("]"))
    if not ok.all():
        return np.flatnonzero(ok).tolist(), None
    text = a.copy()
    text[starts] = text[ends - 1] = ord(" ")
    return list(range(n)), text


def _table(bodies: list[bytes], joined: Any = None) -> pa.Table:
    """The value lists of one-line messages, one row each, parsed by Arrow's JSON reader;
    ``joined``: their text as :func:`_one_line` made it, when it did."""
    text = joined if joined is not None else b"\n".join(b[1:-1] for b in bodies)
    buf = pa.py_buffer(text)
    opts = pj.ReadOptions(use_threads=False, block_size=max(buf.size + 1, 1 << 16))
    tab = pj.read_json(buf, read_options=opts)
    if tab.num_rows != len(bodies) or not set(_REQUIRED) <= set(tab.column_names):
        raise ValueError("not one value list a message")
    return tab


def _arrow_rows(tab: pa.Table) -> tuple[np.ndarray, dict[str, Any]]:
    """Which rows the vectorized path takes (the others: one by one) and their columns."""
    cols = {c: tab.column(c).combine_chunks() for c in ("values", "dstypes", "dsnames")}
    for c in ("dstypes", "dsnames"):
        if not pa.types.is_string(cols[c].type.value_type):
            raise TypeError(f"{c} holds {cols[c].type}")
    vt = cols["values"].type.value_type
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_null(vt)):
        raise TypeError(f"values hold {vt}")
    lens = [pc.list_value_length(cols[c]).fill_null(-1).to_numpy() for c in cols]
    good = (lens[0] >= 0) & (lens[0] == lens[1]) & (lens[0] == lens[2])
    for c in _REQUIRED[3:]:
        good &= tab.column(c).is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_floating(vt):  # an integer past 2**53 read as a float: not exact here
        big = pc.greater(pc.abs(pc.list_flatten(cols["values"])), 2.0**53).fill_null(False)
        parent = pc.list_parent_indices(cols["values"]).to_numpy()
        good[np.unique(parent[big.to_numpy(zero_copy_only=False)])] = False
    cols.update({c: _string(tab, c) for c in ("plugin", "type", *_LABELS)})
    cols["time"] = tab.column("time").combine_chunks().cast(pa.float64())
    iv = tab.column("interval").combine_chunks() if "interval" in tab.column_names else None
    cols["interval"] = (pa.nulls(tab.num_rows, pa.float64()) if iv is None
                        else iv.cast(pa.float64()))  # fmt: skip
    return good, cols


def _series_ids(keys: pa.Array) -> np.ndarray:
    """The id in ``_REG`` of each joined series text (plugin/type/dsname, labels, hint)."""
    if _KEYS_GEN[0] != _REG.generation or len(_KEYS) > _REG.limit:
        _KEYS.clear()
        _KEYS_GEN[0] = _REG.generation
    enc = keys.dictionary_encode()
    ids = []
    for text in enc.dictionary.to_pylist():
        i = _KEYS.get(text)
        if i is None:
            name, *labels, hint = text.split(_SEP)
            pairs = tuple((k, v) for k, v in zip(_LABELS, labels, strict=True) if v)
            i = _KEYS[text] = _REG.id_of((name, pairs, hint))
        ids.append(i)
    got: np.ndarray = np.array(ids, dtype=np.int64)[enc.indices.to_numpy()]
    return got


def _vectorized(cols: dict[str, Any], store_rates: bool) -> tuple[np.ndarray, ...]:
    """(series id, ts, value, exact, exact_ok, row) per data source of the value lists."""
    values = cols["values"]
    parent = pc.list_parent_indices(values)
    idx = parent.to_numpy()
    flat = pc.list_flatten(values)
    v = pc.cast(flat, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    t = pc.list_flatten(cols["dstypes"])
    absolute = pc.equal(t, "absolute").fill_null(False).to_numpy(zero_copy_only=False)
    cumulative = pc.is_in(t, pa.array(sorted(_CUMULATIVE))).to_numpy(zero_copy_only=False)
    rate = absolute | (cumulative & store_rates)
    if not store_rates and absolute.any():
        iv = cols["interval"].fill_null(0.0).to_numpy()[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(absolute, np.where(iv > 0, v / iv, np.nan), v)
    ts = (np.rint(cols["time"].to_numpy() * 1e6).astype(np.int64) * 1000)[idx]
    rep = {c: cols[c].take(parent).fill_null("") for c in ("plugin", "type", *_LABELS)}
    hint = pa.array(np.where(rate, "rate", ""), pa.string())
    name = pc.binary_join_element_wise(rep["plugin"], rep["type"],
                                       pc.list_flatten(cols["dsnames"]), "/")  # fmt: skip
    keys = pc.binary_join_element_wise(name, *(rep[c] for c in _LABELS), hint, _SEP)
    exact = np.zeros(len(v), dtype=np.uint64)
    ok = np.zeros(len(v), dtype=bool)
    if pa.types.is_integer(flat.type):
        iv64 = flat.cast(pa.int64()).fill_null(-1).to_numpy()
        ok = (iv64 >= 0) & ~rate
        exact[ok] = iv64[ok]
    return _series_ids(keys), ts, v, exact, ok, idx


def decode_collectd_many(
    bodies: list[bytes], store_rates: bool
) -> tuple[Points, np.ndarray, dict[int, RejectedInput]]:
    """:func:`decode_collectd` of many messages in one pass: one-line value lists
    (write_kafka's messages) through Arrow's JSON reader, the rest one by one; the points
    of all, each sample's message index (ascending) and the messages rejected alone. Raises
    where the joined read fails (the caller decodes the set message by message)."""
    _REG.begin()
    scanned = scan_wave(bodies, store_rates, _REG, lambda vl: _describe(vl, store_rates))
    if scanned is not None:
        return scanned[0], scanned[1], {}
    fast, joined = _one_line(bodies)
    good = np.zeros(0, dtype=bool)
    cols: dict[str, Any] = {}
    if fast:
        good, cols = _arrow_rows(_table([bodies[k] for k in fast], joined))
    if len(fast) == len(bodies) and good.all():
        slow: list[int] = []
    else:
        slow = sorted(set(range(len(bodies))) - {fast[j] for j in np.flatnonzero(good).tolist()})
    c, bad = _Lists(), {}
    for k in slow:
        try:
            c.add(_doc(bodies[k]), store_rates, k)
        except RejectedInput as e:
            bad[k] = e
    parts = [c.points()]
    owner = [np.array(c.owner, dtype=np.int64)]
    if good.any():
        sub = cols
        if not good.all():
            rows = pa.array(np.flatnonzero(good))
            sub = {k: (v.take(rows) if isinstance(v, pa.Array) else v) for k, v in cols.items()}
        sids, ts, v, exact, ok, idx = _vectorized(sub, store_rates)
        parts.append(Points(_REG, sids, ts, v, exact=exact, exact_ok=ok))
        owner.append(np.array(fast, dtype=np.int64)[np.flatnonzero(good)][idx])
    if not slow:  # the vectorized rows alone, already in message order
        return parts[1], owner[1], bad
    return _joined(parts, owner), np.sort(np.concatenate(owner), kind="stable"), bad


def _joined(parts: list[Points], owner: list[np.ndarray]) -> Points:
    """The points of ``parts`` in message order (stable within a message)."""
    order = np.argsort(np.concatenate(owner), kind="stable")

    def cat(f: str) -> np.ndarray:
        return np.concatenate([getattr(p, f) for p in parts])[order]

    return Points(_REG, cat("gid"), cat("ts"), cat("value"), exact=cat("exact"),
                  exact_ok=cat("exact_ok"))  # fmt: skip
