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

from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points, SeriesRegistry
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


def decode_collectd(body: bytes, store_rates: bool) -> Points:
    """Every data source of every value list; :class:`RejectedInput` ``undecodable`` for
    anything that is not write_kafka's JSON."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RejectedInput(Reason.UNDECODABLE, f"not JSON: {e}"[:300]) from e
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise RejectedInput(Reason.UNDECODABLE, "not a collectd value list array")
    _REG.begin()
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
        except (KeyError, TypeError, ValueError) as e:
            raise RejectedInput(Reason.UNDECODABLE, f"value list {n}: {e!r}"[:300]) from e
        for v, t, name in zip(values, types, names, strict=True):
            hint = "rate" if (t in _CUMULATIVE and store_rates) or t == "absolute" else ""
            x = float("nan") if v is None else float(v)
            if t == "absolute" and not store_rates:
                x = x / interval if interval > 0 else float("nan")
            k: SeriesKey = (base + str(name), labels, hint)
            sids.append(_REG.id_of(k))
            ts.append(when)
            vals.append(x)
            exact.append(v if isinstance(v, int) and 0 <= v < 2**64 and not hint else -1)
    ex = np.array(exact, dtype=object)
    ok = np.array([e >= 0 for e in exact], dtype=bool)
    return Points(
        _REG,
        np.array(sids, dtype=np.int64),
        np.array(ts, dtype=np.int64),
        np.array(vals, dtype=np.float64),
        exact=np.where(ok, ex, 0).astype(np.uint64),
        exact_ok=ok,
    )
