"""The counter rows of a batch in (series, source ts) order, with each row's state row: by
joining and hashing ``metric|device`` keys (:func:`front_by_keys`), or from the streams'
:class:`~pipelines.refine.counter_state.CounterLayout` caches (:func:`front_from_layouts`),
which :func:`remember` fills."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, column, take, where
from pipelines.refine.counter_state import CounterLayout, CounterPart, CounterState

SID = 1 << 32  # series id = stream index * SID + code of "metric|device" in the batch


def front_by_keys(
    table: pa.Table, ts: Array, cmask: Array, k: int, counts: Any, st: pa.Table, st_sid: Any
) -> tuple[pa.Table, Array, Array, Array]:
    """The counter rows sorted by (series, source ts), the series names, the state rows'
    series ids and each sorted row's state row: by joining and hashing ``metric|device``."""
    ci = where(cmask)
    sid = np.repeat(np.arange(k, dtype=np.int64), counts)[ci.to_numpy()]
    key = pc.binary_join_element_wise(
        pc.take(column(table, "metric"), ci), pc.take(column(table, "device"), ci), "|"
    )
    enc = key.dictionary_encode()
    names = enc.dictionary
    g = sid * SID + enc.indices.to_numpy().astype(np.int64)
    sub = counter_rows(table, ts, ci, g, sid)
    s = sub.take(pc.sort_indices(sub, sort_keys=[("g", "ascending"), ("src", "ascending")]))
    # the streams' states keyed the same way (a state series not in this batch: NULL)
    st_code = pc.cast(pc.index_in(column(st, "key"), value_set=names), pa.int64())
    st_g = pc.add(pa.array(st_sid * SID), st_code)
    return s, names, st_g, pc.index_in(column(s, "g"), value_set=st_g)


def front_from_layouts(
    table: pa.Table,
    ts: Array,
    parts: list[CounterPart],
    starts: Any,
    st_counts: Any,
    st_sid: Any,
) -> tuple[pa.Table, Array, Array, Array] | None:
    """What :func:`front_by_keys` returns, from every stream's :class:`CounterLayout` (each matched
    its batch and its state): the series names are the states' keys, so a row's series is
    its state row. None when this batch's source timestamps do not keep last time's order
    (then :func:`front_by_keys` sorts)."""
    offsets = np.concatenate([[0], np.cumsum(st_counts)])
    lays = [p.layout for p in parts if p.layout is not None]
    assert len(lays) == len(parts)
    pos = np.concatenate([x.pos + a for x, a in zip(lays, starts[:-1], strict=True)])
    code = np.concatenate([x.codes + o for x, o in zip(lays, offsets[:-1], strict=True)])
    sid = np.repeat(np.arange(len(parts), dtype=np.int64), [len(x.pos) for x in lays])
    src = column(table, "ts_ns").to_numpy()[pos]
    same = code[1:] == code[:-1]
    back = (src[1:] < src[:-1]) | ((src[1:] == src[:-1]) & (pos[1:] < pos[:-1]))
    if (same & back).any():
        return None
    names = pa.concat_arrays([x.names for x in lays]) if len(lays) > 1 else lays[0].names
    st_g = pa.array(st_sid * SID + np.arange(int(offsets[-1]), dtype=np.int64))
    s = counter_rows(table, ts, pa.array(pos), sid * SID + code, sid)
    for x in lays:
        x.hits += 1
    return s, names, st_g, pa.array(code)


def counter_rows(table: pa.Table, ts: Array, pos: Array, g: Any, sid: Any) -> pa.Table:
    """The counter rows at ``pos`` with their series ``g`` and stream ``sid``."""
    return pa.table(
        {
            "pos": pos,
            "g": pa.array(g),
            "sid": pa.array(sid),
            "ts": take(ts, pos),  # pos: rows of this table
            "src": take(column(table, "ts_ns"), pos),
            "raw": take(column(table, "raw"), pos),
            "max": take(column(table, "max_raw"), pos),
            "sat": take(column(table, "saturate"), pos),
            "scale": take(column(table, "scale"), pos),
        }
    )


def remember(
    layout: CounterLayout,
    metric: Array,
    device: Array,
    counters: Array,
    mine: pa.Table,
    names: Array,
    start: int,
    state: CounterState,
) -> None:
    """Fill ``layout`` from a stream's rows of a sorted :func:`front_by_keys` result (``mine``) and
    its new state, when a later batch of the same layout can use it: its series are in the
    state in the order they first appear in its rows, the order :func:`front_by_keys` would give."""
    layout.names = None
    keys = pc.take(names, pa.array(column(mine, "g").to_numpy() % SID))
    state_keys = column(state.table, "key")
    code = pc.index_in(keys, value_set=state_keys)
    if code.null_count:
        return
    # the series of the batch, by first appearance in its rows
    in_rows = pc.unique(pc.take(keys, pc.sort_indices(column(mine, "pos"))))
    in_state = state_keys.filter(pc.is_in(state_keys, value_set=in_rows))
    codes = code.to_numpy().astype(np.int64)
    if not in_state.equals(in_rows) or (codes[1:] < codes[:-1]).any():
        return
    # copies of the slices: a view would keep its whole wave's buffers alive with the cache
    layout.metric, layout.device, layout.counters, layout.names = (
        pa.concat_arrays([a]) for a in (metric, device, counters, state_keys)
    )
    layout.pos = column(mine, "pos").to_numpy() - start
    layout.codes = codes
