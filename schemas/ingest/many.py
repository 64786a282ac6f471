"""Many messages of one ingest topic decoded in one call: one table per source, each row's
message known.

One-metric messages (Telegraf's and collectd's shape) carry a few samples each; decoding
them one by one costs a fixed ~0.1 ms a message (Python per message, one Arrow table each).
:func:`assemble_many` takes the points a decoder read from *many* messages at once (each
sample with the index of its message) and builds the samples table once, then cuts it into
one :class:`Unit` per source (node, partition, boot id): the messages of that source, in
order, their rows adjacent. Identity per message is exactly :func:`assemble`'s (node from a
series label or the Kafka key, ``seq`` = offset, ``sent_ns`` = the message's newest sample).

A message that fails alone (a malformed line, two nodes, no node) is rejected alone with its
reason; a failure the joined pass cannot pin to one message makes the caller decode that
set message by message (:meth:`schemas.ingest.IngestDecoder.decode_many`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import count, repeat
from operator import attrgetter
from typing import cast

import numpy as np
import pyarrow as pa

from schemas.codec import MAX_ROWS
from schemas.errors import RejectedInput
from schemas.ingest.assemble import (
    INEXACT,
    Points,
    Position,
    RejectedSamples,
    SeriesRegistry,
    _node,
    _raw,
    _source,
    _valid,
    no_node,
)
from schemas.ingest.mapping import Family, Mapping
from schemas.ingest.unit import Unit
from schemas.reasons import Reason
from schemas.wire import (
    SAMPLES_SCHEMA,
)


@dataclass
class Decoded:
    """What :meth:`~schemas.ingest.IngestDecoder.decode_many` made of a list of messages:
    every message is a member of one unit or rejected, never both."""

    units: list[Unit]
    rejected: dict[int, RejectedInput]


class _Names:
    """Distinct strings by code, and as an Arrow array for a take."""

    def __init__(self) -> None:
        self.code: dict[str, int] = {}
        self.names: list[str] = []
        self._array: pa.Array | None = None

    def of(self, name: str) -> int:
        c = self.code.get(name)
        if c is None:
            c = self.code[name] = len(self.names)
            self.names.append(name)
            self._array = None
        return c

    def array(self) -> pa.Array:
        if self._array is None:
            self._array = pa.array(self.names, pa.string())
        return self._array


class _Resolved:
    """Each series id's target as columns by id: metric, device and node as codes."""

    def __init__(self, generation: int, mapping: Mapping) -> None:
        self.generation, self.mapping = generation, mapping
        self.done = np.zeros(0, dtype=bool)
        self.factor = np.zeros(0, dtype=np.float64)
        self.counter = np.zeros(0, dtype=bool)
        self.metric = np.zeros(0, dtype=np.int64)
        self.device = np.zeros(0, dtype=np.int64)
        self.node = np.zeros(0, dtype=np.int64)  # -1: no node label
        self.metrics, self.devices, self.nodes = _Names(), _Names(), _Names()

    def grow(self, n: int) -> None:
        extra = n - len(self.done)
        if extra > 0:
            self.done = np.concatenate([self.done, np.zeros(extra, dtype=bool)])
            self.factor = np.concatenate([self.factor, np.zeros(extra)])
            self.counter = np.concatenate([self.counter, np.zeros(extra, dtype=bool)])
            for f in ("metric", "device", "node"):
                setattr(self, f, np.concatenate([getattr(self, f), np.zeros(extra, np.int64)]))

    def resolve(self, reg: SeriesRegistry, ids: np.ndarray) -> None:
        self.grow(len(reg.keys))
        missing = ids[~self.done[ids]]
        for g in np.unique(missing).tolist() if missing.size else ():
            t = self.mapping.resolve(reg.keys[g])
            self.factor[g], self.counter[g] = t.factor, t.counter
            self.metric[g] = self.metrics.of(t.metric)
            self.device[g] = self.devices.of(t.device)
            self.node[g] = self.nodes.of(t.node) if t.node else -1
            self.done[g] = True


class _Targets:
    """The mapping's targets of a registry's series ids, as columns by id (a numpy index a
    series instead of hashing its key), for the registry's current generation."""

    def __init__(self) -> None:
        self.by: dict[tuple[int, int], _Resolved] = {}

    def of(self, reg: SeriesRegistry, mapping: Mapping, ids: np.ndarray) -> _Resolved:
        key = (id(reg), id(mapping))
        got = self.by.get(key)
        if got is None or got.generation != reg.generation or got.mapping is not mapping:
            got = self.by[key] = _Resolved(reg.generation, mapping)
        got.resolve(reg, ids)
        return got


_TARGETS = _Targets()
_NODES: dict[str, str | RejectedInput] = {}


def _checked_node(raw: str) -> str | RejectedInput:
    """:func:`assemble._node` of one node name, remembered (a valid name or why not)."""
    got = _NODES.get(raw)
    if got is None:
        try:
            got = _node({raw}, Position(0, 0, 0, None))
        except RejectedInput as e:
            got = e
        if len(_NODES) > 100_000:
            _NODES.clear()
        _NODES[raw] = got
    return got


def _message_nodes(
    node_code: np.ndarray,
    msg: np.ndarray,
    names: list[str],
    pos: list[Position],
    family: Family | None = None,
) -> tuple[list[str | None], dict[int, RejectedInput]]:
    """The node of each message (None: rejected, with why): its series' one node label,
    else its Kafka key when that is a host name."""
    m, width = len(pos), len(names) + 1
    has = node_code >= 0
    pairs, _ = _unique(msg[has] * width + node_code[has])
    owner, codes = pairs // width, pairs % width
    per = np.bincount(owner, minlength=m)
    code = np.full(m, -1, dtype=np.int64)
    code[owner] = codes
    bad: dict[int, RejectedInput] = {}
    for k in np.flatnonzero(per > 1).tolist():
        shown = sorted(names[c] for c in codes[owner == k])
        bad[k] = RejectedInput(Reason.BAD_ENVELOPE, f"one message carries samples of "
                               f"{len(shown)} nodes ({', '.join(shown[:4])})")  # fmt: skip
        code[k] = -2
    checked = [_checked_node(n) for n in names]
    got: list[str | RejectedInput | None] = [checked[c] if c >= 0 else None for c in code.tolist()]
    for k in np.flatnonzero(code == -1).tolist():  # no node label: the Kafka key
        key = pos[k].key
        keyed = _valid(key.decode("utf-8", "replace")) if key else None
        got[k] = keyed if keyed is not None else no_node(family, key)
    if any(not isinstance(c, str) for c in checked) or (code == -1).any():
        for k, g in enumerate(got):
            if isinstance(g, RejectedInput):
                bad[k] = g
                got[k] = None
    return cast(list[str | None], got), bad


def assemble_many(
    points: Points,
    msg: np.ndarray,
    mapping: Mapping,
    exporter: str,
    pos: list[Position],
    rejected: dict[int, RejectedInput],
    boot_ids: list[str] | None = None,
) -> Decoded:
    """The units of ``points`` read from the messages at ``pos`` (``msg``: each sample's
    message index, ascending), as :func:`assemble` would build each message's batch;
    ``rejected``: the messages the decoder rejected already (with no samples here)."""
    m = len(pos)
    counts = np.bincount(msg, minlength=m)
    rejected = dict(rejected)
    for k in np.flatnonzero(counts > MAX_ROWS).tolist():
        rejected[k] = RejectedInput(Reason.OVERSIZED, f"{int(counts[k])} samples > {MAX_ROWS}")
    got = _TARGETS.of(points.series, mapping, points.gid)
    node_s = got.node[points.gid]
    used, _ = _unique(node_s[node_s >= 0])
    code_s = np.searchsorted(used, node_s)  # a local code per node of the set
    code_s[node_s < 0] = -1
    nodes = [got.nodes.names[c] for c in used.tolist()]
    fast = None if rejected or boot_ids is not None else _by_label(code_s, msg, nodes, pos)
    if fast is None:
        node_of, bad = _message_nodes(code_s, msg, nodes, pos, mapping.family)
        for k, e in bad.items():  # decoded, then rejected: their samples are accounted for
            if k not in rejected:
                rejected[k] = RejectedSamples(e.reason, e.detail, int(counts[k]))
    append = np.fromiter(map(attrgetter("append_ns"), pos), np.int64, m)
    ts_all = np.where(points.ts < 0, append[msg], points.ts)
    sent = _newest(ts_all, counts, append)
    srcs, key, order = _sources(node_of, rejected, pos, boot_ids) if fast is None else fast
    rows = _order(key, msg)
    if rows is not None:  # the sources' messages interleave, or some are rejected
        points = _take(points, rows)
        msg, ts_all = msg[rows], ts_all[rows]
    gid = points.gid
    factor, counter = got.factor[gid], got.counter[gid]
    value = points.value * factor
    ok, raw, inexact = _raw(points, value, counter, factor)
    if inexact.any():
        for g in np.unique(gid[inexact]).tolist():
            name = got.metrics.names[int(got.metric[g])]
            INEXACT.inexact[name] = INEXACT.inexact.get(name, 0) + int((gid[inexact] == g).sum())
    value = np.where(ok, raw.astype(np.float64), value)
    metric = got.metrics.array().take(got.metric[gid].astype(np.int32))
    device = got.devices.array().take(got.device[gid].astype(np.int32))
    n = len(ts_all)
    text = pa.array(points.text, pa.string()) if points.text else pa.nulls(n, pa.string())
    table = pa.Table.from_arrays(
        [pa.array(ts_all), metric, device, pa.array(value), pa.array(raw, mask=~ok), text],
        schema=SAMPLES_SCHEMA,
    )
    cnt, sent_in = counts[order].tolist(), sent[order].tolist()
    starts = [0, *np.cumsum(counts[order]).tolist()]
    units, at = [], 0
    for (node, partition, boot), members in srcs:
        end = at + len(members)
        src = _source(node, exporter, partition, boot)
        table_rows = table.slice(starts[at], starts[end] - starts[at])
        units.append(Unit(src, table_rows, members, cnt[at:end], sent_in[at:end]))
        at = end
    return Decoded(units, rejected)


def _by_label(
    node_code: np.ndarray, msg: np.ndarray, names: list[str], pos: list[Position]
) -> tuple[list[tuple[tuple[str, int, str], list[int]]], np.ndarray, np.ndarray] | None:
    """:func:`_sources` where it is simple (None where not): every message has samples, all
    of one node label, a valid name; one partition, no boot ids, nothing rejected."""
    m = len(pos)
    parts = list(map(attrgetter("partition"), pos))
    if m == 0 or parts.count(parts[0]) != m or not (node_code >= 0).all():
        return None
    code = np.full(m, -1, dtype=np.int64)
    code[msg] = node_code
    if not ((code >= 0).all() and (code[msg] == node_code).all()):
        return None
    checked = [_checked_node(n) for n in names]
    canon: dict[str, int] = {}
    ids = []
    for c in checked:
        if not isinstance(c, str):
            return None
        ids.append(canon.setdefault(c, len(canon)))
    node, k = np.array(ids, dtype=np.int64)[code], len(canon)
    first = np.full(k, m, dtype=np.int64)  # each node's first message
    np.minimum.at(first, node, np.arange(m))
    by_first = np.argsort(first, kind="stable")
    rank = np.empty(k, dtype=np.int64)
    rank[by_first] = np.arange(k)
    key = rank[node]
    order = np.argsort(key, kind="stable")
    cuts = [0, *np.cumsum(np.bincount(key, minlength=k)).tolist()]
    members = order.tolist()
    by_rank = [f for f in first[by_first].tolist() if f < m]
    srcs = [((cast(str, checked[int(code[k])]), parts[0], "ingest"), members[cuts[i] : cuts[i + 1]])
            for i, k in enumerate(by_rank)]  # fmt: skip
    return srcs, key, order


def _sources(
    node_of: list[str | None],
    rejected: dict[int, RejectedInput],
    pos: list[Position],
    boot_ids: list[str] | None,
) -> tuple[list[tuple[tuple[str, int, str], list[int]]], np.ndarray, np.ndarray]:
    """Each source's messages, in order of first appearance, each message's source (its
    index there; -1: rejected) and the sources' messages one after the other. A rejected
    message's node is None."""
    m = len(pos)
    nodes = list(node_of)
    for k in rejected:
        nodes[k] = None
    parts = list(map(attrgetter("partition"), pos))
    items: Iterable[Hashable] = nodes  # one partition, no boot ids: the node says the source
    if boot_ids is not None or (m and parts.count(parts[0]) != m):
        items = zip(nodes, parts, boot_ids or repeat("ingest"), strict=False)  # boots: repeat
    seen: dict[Hashable, int] = {}
    first = np.fromiter(map(seen.setdefault, items, count()), np.int64, m)  # its first message
    valid = np.ones(m, dtype=bool)  # a message without a node is a rejected one
    valid[list(rejected)] = False
    key = np.full(m, -1, dtype=np.int64)
    if not valid.any():
        return [], key, np.zeros(0, dtype=np.int64)
    uniq, key[valid] = _unique(first[valid])  # ascending: in order of first appearance
    in_order = np.argsort(key, kind="stable")[m - int(valid.sum()) :]
    order = in_order.tolist()
    cuts = [0, *np.cumsum(np.bincount(key[valid], minlength=len(uniq))).tolist()]
    srcs = []
    for i, k in enumerate(uniq.tolist()):
        boot = boot_ids[k] if boot_ids else "ingest"
        srcs.append(((cast(str, nodes[k]), pos[k].partition, boot), order[cuts[i] : cuts[i + 1]]))
    return srcs, key, in_order


def _unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` of small non-negative ids, by a lookup table
    where the ids are few enough for one."""
    top = int(ids.max(initial=-1)) + 1
    if top > max(8 * len(ids), 1 << 16) or (len(ids) and int(ids.min()) < 0):
        uniq, inv = np.unique(ids, return_inverse=True)
        return uniq, inv
    seen = np.zeros(top, dtype=bool)
    seen[ids] = True
    uniq = np.flatnonzero(seen)
    lut = np.zeros(top, dtype=np.int64)
    lut[uniq] = np.arange(len(uniq))
    return uniq, lut[ids]


def _codes(items: list[str | None] | list[str], m: int) -> np.ndarray:
    """An integer per item, equal where the items are (sparse, not dense)."""
    seen: dict[str | None, int] = {}
    return np.fromiter(map(seen.setdefault, items, count()), np.int64, m)


def _order(key: np.ndarray, msg: np.ndarray) -> np.ndarray | None:
    """The samples' order with each source's together, rejected messages' left out (None:
    they already are)."""
    place = key[msg]
    if bool((place >= 0).all()) and bool((place[1:] >= place[:-1]).all()):
        return None
    rows = np.argsort(np.where(place < 0, len(key), place), kind="stable")
    return rows[: int(np.count_nonzero(place >= 0))]


def _take(points: Points, rows: np.ndarray) -> Points:
    def pick(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows]

    text = [points.text[i] for i in rows.tolist()] if points.text else None
    return Points(points.series, points.gid[rows], points.ts[rows], points.value[rows],
                  points.boot_id, pick(points.exact), pick(points.exact_ok), text)  # fmt: skip


def _newest(ts: np.ndarray, counts: np.ndarray, append: np.ndarray) -> np.ndarray:
    """Each message's newest sample time (its arrival where it has none), at least 0."""
    out = append.copy()
    nz = np.flatnonzero(counts)
    if nz.size:
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        out[nz] = np.maximum.reduceat(ts, starts[nz])
    newest: np.ndarray = np.maximum(out, 0)
    return newest
