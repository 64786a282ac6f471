"""Many OTLP JSON messages (the Collector's ``otlp_json``) read in one pass by Arrow's JSON
reader: every gauge's and sum's number points of all of them as columns, no Python per
point.

Each message is one line (as the Collector writes it): the lines are one NDJSON block for
:func:`pyarrow.json.read_json`, and the nested lists (resource metrics, scope metrics,
metrics, data points) are flattened with Arrow kernels. A point's series is its metric's
name, its resource's attributes and its own, each part's text given a stable code once;
only a wave's distinct combinations of codes are looked up, and a new one is resolved to a
series id from its texts. The table is exactly :func:`schemas.ingest.otlp.decode_otlp`'s of each
message. Anything else (histograms, summaries, double or boolean attributes, a message on
several lines, a document without ``resourceMetrics``) raises, and the caller decodes the
set message by message.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from schemas.ingest.assemble import Points
from schemas.ingest.otlp import _DELTAS, _REG

_KV, _ATTR, _PART = "\x1f", "\x1e", "\x1d"  # within an attribute, between, between parts
_VALUES = ("stringValue", "intValue")


class NotSimple(ValueError):
    """The set holds something the joined reader does not take."""


def _field(arr: Any, name: str) -> Any:
    if name not in [f.name for f in arr.type]:
        return None
    return pc.struct_field(arr, name)


def _attr_text(attrs: Any) -> Any:
    """``k\\x1fv\\x1ek\\x1fv`` of each list of attributes (empty where none)."""
    if attrs is None:
        return None
    values = attrs.values
    if pa.types.is_null(values.type):
        return pa.array([""] * len(attrs), pa.string())
    key = pc.struct_field(values, "key")
    value = pc.struct_field(values, "value")
    names = [f.name for f in value.type]
    if any(n not in _VALUES for n in names):
        raise NotSimple(f"attribute values of {names}")
    parts = [pc.struct_field(value, n).cast(pa.string()) for n in names]
    if not parts:
        raise NotSimple("attributes without a value")
    text = pc.coalesce(*parts) if len(parts) > 1 else parts[0]
    if text.null_count:
        raise NotSimple("an attribute without a string or integer value")
    kv = pc.binary_join_element_wise(key, text, _KV)
    lists = pa.ListArray.from_arrays(attrs.offsets, kv)
    return pc.binary_join(lists, _ATTR).fill_null("")


def _child(parent: Any, name: str) -> tuple[Any, np.ndarray]:
    """The items of list field ``name`` of each struct of ``parent``, and each one's parent."""
    lists = _field(parent, name)
    if lists is None:
        raise NotSimple(f"no {name}")
    return pc.list_flatten(lists), pc.list_parent_indices(lists).to_numpy()


def _ints(arr: Any, n: int) -> np.ndarray:
    if arr is None:
        return np.zeros(n, dtype=np.int64)
    out: np.ndarray = arr.cast(pa.int64()).fill_null(0).to_numpy()
    return out


def _points(kind_body: Any, metric_idx: np.ndarray) -> dict[str, Any] | None:
    """The number points of one kind's bodies (gauge or sum structs) and their metric."""
    if kind_body is None:
        return None
    pts, parent = _child(kind_body, "dataPoints")
    extra = {f.name for f in pts.type} - {"attributes", "startTimeUnixNano", "timeUnixNano",
                                          "asDouble", "asInt", "flags", "exemplars"}  # fmt: skip
    if extra:
        raise NotSimple(f"points with {sorted(extra)}")
    n = len(pts)
    as_int = _field(pts, "asInt")
    has_int = (as_int.is_valid().to_numpy(zero_copy_only=False) if as_int is not None
               else np.zeros(n, dtype=bool))  # fmt: skip
    ints = _ints(as_int, n)
    dbl = _field(pts, "asDouble")
    value = (np.zeros(n) if dbl is None
             else dbl.cast(pa.float64()).fill_null(0.0).to_numpy())  # fmt: skip
    return {
        "metric": metric_idx[parent],
        "t": _ints(_field(pts, "timeUnixNano"), n),
        "start": _ints(_field(pts, "startTimeUnixNano"), n),
        "value": np.where(has_int, ints.astype(np.float64), value),
        "int": np.where(has_int, ints, -1),
        "attrs": _attr_text(_field(pts, "attributes")),
    }


def _kinds(metrics: Any) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Each metric's gauge and sum structs, and whether a sum is a counter or a rate."""
    names = {f.name for f in metrics.type}
    if names & {"histogram", "summary", "exponentialHistogram"}:
        raise NotSimple("histograms")
    gauge, sm = _field(metrics, "gauge"), _field(metrics, "sum")
    n = len(metrics)
    counter = np.zeros(n, dtype=bool)
    rate = np.zeros(n, dtype=bool)
    if sm is not None:
        mono = _field(sm, "isMonotonic")
        mono_np = (np.zeros(n, dtype=bool) if mono is None
                   else mono.fill_null(False).to_numpy(zero_copy_only=False))  # fmt: skip
        temp = _field(sm, "aggregationTemporality")
        delta = np.zeros(n, dtype=bool)
        if temp is not None:
            text = temp.cast(pa.string())
            delta = pc.is_in(text, pa.array([str(d) for d in _DELTAS])).to_numpy(
                zero_copy_only=False
            )
        is_sum = sm.is_valid().to_numpy(zero_copy_only=False)
        counter = is_sum & mono_np & ~delta
        rate = is_sum & mono_np & delta
    return gauge, sm, counter, rate


_BITS = 21  # a part's code in a series' composite key


class _Combos:
    """Series ids by their three parts (metric name and suffix, resource attributes, point
    attributes), each part's text given a stable code once: a wave's points hash their
    short attribute texts, and only its distinct combinations of codes are looked up."""

    def __init__(self) -> None:
        self.gen = -1
        self.codes: tuple[dict[str, int], ...] = ({}, {}, {})
        self.texts: tuple[list[str], ...] = ([], [], [])
        self.ids: dict[int, int] = {}

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]
        self.gen = _REG.generation

    def part(self, i: int, strings: Any) -> np.ndarray:
        """The stable code of each of ``strings`` as part ``i``."""
        enc = strings.dictionary_encode()
        codes, texts = self.codes[i], self.texts[i]
        local = []
        for t in enc.dictionary.to_pylist():
            c = codes.get(t)
            if c is None:
                c = codes[t] = len(texts)
                texts.append(t)
            local.append(c)
        got: np.ndarray = np.array(local, dtype=np.int64)[enc.indices.to_numpy()]
        return got

    def series(self, name: Any, res: Any, attrs: Any) -> np.ndarray:
        """The id in ``_REG`` of each point's series from its three parts' texts."""
        if (
            self.gen != _REG.generation
            or len(self.ids) > _REG.limit
            or any(len(t) >= 1 << _BITS for t in self.texts)
        ):
            self.reset()
        key = (self.part(0, name) << (2 * _BITS)) | (self.part(1, res) << _BITS)
        key |= self.part(2, attrs)
        uniq, inv = np.unique(key, return_inverse=True)
        ids = self.ids
        out = np.fromiter(map(ids.get, uniq.tolist(), repeat(-1)), np.int64, len(uniq))
        mask = (1 << _BITS) - 1
        for j in np.flatnonzero(out < 0).tolist():
            k = int(uniq[j])
            ns, r, a = (self.texts[i][(k >> (_BITS * (2 - i))) & mask] for i in range(3))
            name_text, suffix = ns.split(_PART)
            pairs = [cast(tuple[str, str], tuple(x.split(_KV, 1)))
                     for x in (r + _ATTR + a).split(_ATTR) if x]  # fmt: skip
            out[j] = ids[k] = _REG.id_of((name_text, tuple(sorted(pairs)), suffix))
        got: np.ndarray = out[inv]
        return got


_COMBOS = _Combos()


def decode_otlp_json_many(bodies: list[bytes]) -> tuple[Points, np.ndarray, list[str]]:
    """The points of every message, each one's message index (ascending) and each message's
    boot id (``start-<earliest cumulative start>`` or ``ingest``); raises
    :class:`NotSimple` (or Arrow's errors) for a set it does not take."""
    _REG.begin()  # the registry stays bounded: past its limit it starts over
    if any(b[:1] != b"{" or b"\n" in b for b in bodies):
        raise NotSimple("not one JSON object a line")
    buf = b"\n".join(bodies)
    if b"\r" in buf:
        raise NotSimple("not one JSON object a line")
    if b"\\u00" in buf and (b"\\u001" in buf or b"\\u0000" in buf):  # one scan when none
        raise NotSimple("control characters")
    opts = pj.ReadOptions(use_threads=False, block_size=max(len(buf) + 1, 1 << 16))
    tab = pj.read_json(pa.py_buffer(buf), read_options=opts)
    if tab.num_rows != len(bodies) or "resourceMetrics" not in tab.column_names:
        raise NotSimple("not OTLP metrics, one a line")
    top = tab.column("resourceMetrics").combine_chunks()
    if top.null_count:
        raise NotSimple("a document without resourceMetrics")
    rm, rm_msg = pc.list_flatten(top), pc.list_parent_indices(top).to_numpy()
    res = _field(rm, "resource")
    res_text = _attr_text(_field(res, "attributes")) if res is not None else None
    if res_text is None:
        res_text = pa.array([""] * len(rm), pa.string())
    sms, sm_rm = _child(rm, "scopeMetrics")
    metrics, m_sm = _child(sms, "metrics")
    m_rm = sm_rm[m_sm]
    gauge, sm, counter, rate = _kinds(metrics)
    metric_idx = np.arange(len(metrics))
    parts = [p for p in (_points(gauge, metric_idx), _points(sm, metric_idx)) if p is not None]
    if not parts:
        raise NotSimple("no gauge or sum")
    for p in parts:
        if p["attrs"] is None:
            p["attrs"] = pa.array([""] * len(p["t"]), pa.string())
    cols = {k: (np.concatenate([p[k] for p in parts]) if k != "attrs"
                else pa.concat_arrays([p[k] for p in parts])) for k in parts[0]}  # fmt: skip
    order = np.argsort(cols["metric"], kind="stable")  # points in document order
    m = cols["metric"][order]
    t, start, value, ival = (cols[k][order] for k in ("t", "start", "value", "int"))
    attrs = cols["attrs"].take(pa.array(order))
    is_counter, is_rate = counter[m], rate[m]
    span = (t - start) / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(is_rate, np.where(span > 0, value / span, np.nan), value)
    name = pc.struct_field(metrics, "name").cast(pa.string()).fill_null("")
    suffix = pa.array(np.where(rate, "rate", ""), pa.string())
    midx = pa.array(m)
    name_sfx = pc.binary_join_element_wise(name, suffix, _PART)
    series = _COMBOS.series(name_sfx.take(midx), res_text.take(pa.array(m_rm[m])), attrs)
    msg = rm_msg[m_rm[m]]
    ok = is_counter & (ival >= 0)
    exact = np.where(ok, ival, 0).astype(np.uint64)
    boots = _boots(msg, start, is_counter, len(bodies))
    pts = Points(_REG, series, t, value, exact=exact, exact_ok=ok)
    return pts, msg, boots


def _boots(msg: np.ndarray, start: np.ndarray, counter: np.ndarray, n: int) -> list[str]:
    """Each message's boot id: its cumulative points' earliest start time."""
    has = counter & (start != 0)
    least = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(least, msg[has], start[has])
    seen = np.zeros(n, dtype=bool)
    seen[msg[has]] = True
    return [f"start-{s}" if k else "ingest" for s, k in zip(least.tolist(), seen.tolist(),
                                                            strict=True)]  # fmt: skip
