"""Evaluate sample rules (threshold, bitmask, sample-borne events) and event rules.

Hot path: one sort of the rules' rows by (metric, series, ts) per refined batch
(:class:`MetricIndex`); per rule, a slice of it, one classification, the series it may step
(:func:`_hot`), and one vectorized pass that keeps only the rows where a series' class
changes (run starts and ends). Plain threshold rules do all that in one pass together
(:mod:`pipelines.detect.threshold_pass`). Python then walks those few rows — about one or two per
series per batch — through each series' :class:`~pipelines.detect.alerts.Hysteresis`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, column, nxt, prev, take, true_mask, where
from pipelines.detect.alerts import HI, LO, AlertBook, Firing, alert_id, classify
from pipelines.detect.rule_config import BitmaskRule, EventRule, ThresholdRule, render
from pipelines.detect.xid import xid_info
from schemas.catalog import Catalog
from schemas.records import Alert, Lineage

_ROW_COLS = ("node", "device", "ts", "job", "raw_partition", "raw_offset")
_ENRICH = ("rack", "pod", "leaf", "leaf_port", "spine", "rail", "nic", "gpu", "rank", "unit")
SEP = "\x1f"
# what an alert is made of: the columns of a run-boundary row (rules' summaries render them)
_ROW_READ = (*_ROW_COLS, *_ENRICH, "value", "rate", "clock_error_ns")


class MetricIndex:
    """Row positions of a refined table by metric, after one dictionary encoding of its
    ``metric`` column: each rule takes its rows' positions as a slice of one sort, then
    only the columns it reads at those positions, and the whole row only at the few rows
    where a series' class changes. (Filtering the table by metric copied every column of
    every row of the metric for each rule.)"""

    def __init__(self, table: pa.Table, metrics: frozenset[str] | None = None) -> None:
        """``metrics``: the only metrics :meth:`positions` is asked for (None: any)."""
        self.table = table
        self.metrics = metrics
        self._encoded: dict[str, Array] = {}
        enc = self.encoded("metric")
        self._codes = enc.indices
        self._index = {v: i for i, v in enumerate(enc.dictionary.to_pylist())}
        self._series: Array | None = None
        self._order: Array | None = None
        self._slices: dict[int, tuple[int, int]] | None = None
        self._ranks: list[dict[str, int]] | None = None

    def encoded(self, name: str) -> Array:
        """Column ``name`` dictionary-encoded, once per table for every reader (the rules,
        the rollup's series codes, each node's newest ts): a hashing pass over a string
        column costs a few milliseconds per group of refined rows."""
        enc = self._encoded.get(name)
        if enc is None:
            enc = self._encoded[name] = pc.dictionary_encode(column(self.table, name))
        return enc

    def rows_of(self, metrics: list[str], columns: list[str]) -> pa.Table:
        """The rows of ``metrics``, in table order, only their ``columns`` (those present)."""
        have = set(self.table.column_names)
        narrow = self.table.select([c for c in columns if c in have])
        ids = [self._index[m] for m in metrics if m in self._index]
        if not ids:
            return narrow.slice(0, 0)
        return narrow.filter(pc.is_in(self._codes, value_set=pa.array(ids, self._codes.type)))

    @property
    def series(self) -> Array:
        """Every row's series (node, device) as an int64 that sorts as ``node SEP device``
        does (:data:`SEP` sorts below any character of a name), built once for every rule:
        the rules sort their rows by series, and sorting integers costs a fraction of
        sorting the joined names."""
        if self._series is None:
            key = None
            for col in ("node", "device"):
                enc = self.encoded(col)
                rank = pc.rank(enc.dictionary, sort_keys="ascending", tiebreaker="first")
                part = take(rank.cast(pa.int64()), enc.indices)
                key = part if key is None else pc.add(pc.multiply(key, len(enc.dictionary)), part)
            self._series = key
        return self._series

    def positions(self, metric: str) -> Array:
        """Positions (int64) of the rows of ``metric``, in (series, ts) order (ties: table
        order). One stable sort of every row by (metric, series, ts) serves every rule: a
        rule's rows are a slice of it, already in the order its runs are read in."""
        if self._slices is None:
            t = self.table
            keyed = pa.table({"m": self._codes, "s": self.series, "ts": column(t, "ts")})
            rows = None
            if self.metrics is not None:  # the rules' metrics' rows only: most rows are not
                ids = [self._index[m] for m in self.metrics if m in self._index]
                rows = where(pc.is_in(self._codes, value_set=pa.array(ids, self._codes.type)))
                keyed = keyed.take(rows)
            order = pc.sort_indices(
                keyed, sort_keys=[("m", "ascending"), ("s", "ascending"), ("ts", "ascending")]
            ).cast(pa.int64())
            order = order if rows is None else take(rows, order)
            codes = take(self._codes, order).to_numpy(zero_copy_only=False)
            cut = [0, *(np.flatnonzero(codes[1:] != codes[:-1]) + 1).tolist(), len(codes)]
            self._order = order
            self._slices = {int(codes[a]): (a, b - a) for a, b in itertools.pairwise(cut) if b > a}
        if self.metrics is not None and metric not in self.metrics:
            raise ValueError(f"positions: {metric!r} is not among the index's metrics")
        i = self._index.get(metric)
        got = None if i is None else self._slices.get(i)
        if got is None:
            return pa.array([], pa.int64())
        assert self._order is not None
        return self._order.slice(*got)

    def series_of(self, entities: list[str]) -> list[int]:
        """The :attr:`series` codes of ``node/device`` entities that have rows here (a node
        name holds no ``/``; a device name may)."""
        if self._ranks is None:
            self._ranks = []
            for col in ("node", "device"):
                enc = self.encoded(col)
                rank = pc.rank(enc.dictionary, sort_keys="ascending", tiebreaker="first")
                names = enc.dictionary.to_pylist()
                self._ranks.append(dict(zip(names, rank.to_pylist(), strict=True)))
        nodes, devices = self._ranks
        out = []
        for e in entities:
            node, _, device = e.partition("/")
            a, b = nodes.get(node), devices.get(device)
            if a is not None and b is not None:
                out.append(a * len(devices) + b)
        return out


def _positions(
    index: MetricIndex, metric: str, field: str, where_: dict[str, Any], regex: str | None
) -> Array | None:
    """Positions of the rows of ``metric`` that pass ``where_`` and ``regex`` (on device)
    and have a ``field``; None when none does."""
    t = index.table
    pos = index.positions(metric)
    if len(pos) and (where_ or regex is not None):
        mask = None
        for col, want in where_.items():
            if col not in t.column_names:
                return None
            vals = want if isinstance(want, list) else [want]
            arr = take(column(t, col), pos)
            vs = pa.array(vals).cast(arr.type) if len(vals) else pa.array([], arr.type)
            m = pc.is_in(arr, value_set=vs)
            mask = m if mask is None else pc.and_(mask, m)
        if regex is not None:
            m = pc.match_substring_regex(take(column(t, "device"), pos), regex)
            mask = m if mask is None else pc.and_(mask, m)
        pos = pos.filter(true_mask(mask))
    if len(pos) == 0:
        return None
    pos = pos.filter(pc.is_valid(take(column(t, field), pos)))
    return pos if len(pos) else None


def _runs(index: MetricIndex, pos: Array, cls: Array) -> pa.Table:
    """The rows of ``index``'s table at ``pos`` (in (series, ts) order, as
    :meth:`MetricIndex.positions` gives them, any filtered subset of those), where a series'
    class ``cls`` (one per position) starts or ends a run, with their ``_key`` and ``_cls``.
    Whole rows are taken only at the run boundaries, and their keys joined there."""
    t = index.table
    k = take(index.series, pos)
    start = pc.or_(pc.not_equal(k, prev(k)), pc.not_equal(cls, prev(cls)))
    end = pc.or_(pc.not_equal(k, nxt(k)), pc.not_equal(cls, nxt(cls)))
    keep = where(pc.or_(pc.fill_null(start, True), pc.fill_null(end, True)))
    have = set(t.column_names)  # the property builds a new list at each access
    cols = [c for c in _ROW_READ if c in have]
    sel = t.select(cols).take(take(pos, keep))
    joined = pc.binary_join_element_wise(column(sel, "node"), column(sel, "device"), SEP)
    return sel.append_column("_key", joined).append_column("_cls", take(cls, keep))


def _rows(t: pa.Table) -> list[dict[str, Any]]:
    have = set(t.column_names)
    cols = [c for c in (*_ROW_READ, "_key") if c in have]
    rows: list[dict[str, Any]] = t.select(cols).to_pylist()
    return rows


def _lin(row: dict[str, Any], topic: str) -> list[Lineage]:
    p, o = row.get("raw_partition"), row.get("raw_offset")
    if p is None or o is None:
        return []
    return [Lineage(topic=topic, partition=int(p), offset_first=int(o), offset_last=int(o))]


def _hot(
    rule_name: str, index: MetricIndex, book: AlertBook, pos: Array, cls: Array
) -> tuple[Array, Array] | None:
    """``pos`` and ``cls`` of only the series :func:`_walk` may step: those with a HI row or
    a state in ``book`` (any other it skips, having no state and not HI); None when none.
    Most series are quiet: their runs are never built, nor their rows made Python."""
    key = take(index.series, pos)
    hot = pc.unique(key.filter(pc.equal(cls, HI)))
    known = [e for r, e in book.states if r == rule_name]
    codes = index.series_of(known) if known else []
    if len(hot) == 0 and not codes:
        return None
    wanted = pa.concat_arrays([hot, pa.array(codes, hot.type)]) if codes else hot
    keep = pc.is_in(key, value_set=wanted)
    return pos.filter(keep), cls.filter(keep)


def _walk(
    rule_name: str,
    for_ns: int,
    sel: pa.Table,
    book: AlertBook,
    now_ns: int,
    topic: str,
    make: Any,
) -> list[Alert]:
    """Step each run-boundary row through its series' hysteresis; ``make(row, onset)``
    returns ``(severity, summary, evidence)`` for a firing alert."""
    out: list[Alert] = []
    classes = column(sel, "_cls").to_pylist()
    for row, cls in zip(_rows(sel), classes, strict=True):
        entity = f"{row['node']}/{row['device']}"
        if cls != HI and (rule_name, entity) not in book.states:
            continue
        st = book.get(rule_name, entity)
        if row["ts"] < st.last_ts:
            continue  # late sample: the series already moved past it
        action = st.step(cls, int(row["ts"]), for_ns, _lin(row, topic))
        if action == "fire" and st.pending_since is not None:
            sev, summary, ev = make(row, st.pending_since)
            lineage = st.pending_lineage
            f = Firing(
                id=alert_id(rule_name, entity, st.pending_since),
                starts_ns=st.pending_since,
                summary=summary,
                severity=sev,
                node=row["node"],
                device=row["device"],
                job=row.get("job"),
                evidence=ev,
                lineage=lineage,
            )
            out.append(book.fire(rule_name, entity, f, now_ns))
        elif action == "resolve":
            a = book.resolve(rule_name, entity, int(row["ts"]), now_ns)
            if a is not None:
                out.append(a)
    return out


def threshold_limits(rule: ThresholdRule) -> tuple[float, float, bool]:
    """(fire, resolve, below) of ``rule``."""
    limit = rule.below if rule.below is not None else rule.above
    if limit is None:  # the rule loader requires exactly one of above and below
        raise ValueError(f"rule {rule.name}: sets neither above nor below")
    fire = float(limit)
    return fire, fire if rule.resolve is None else float(rule.resolve), rule.below is not None


def threshold_summary(rule: ThresholdRule, field: str) -> Any:
    """``make(row, onset)`` for :func:`_walk`: a firing threshold alert's severity, summary
    and evidence."""
    fire, resolve, _ = threshold_limits(rule)

    def make(row: dict[str, Any], onset: int) -> tuple[str, str, dict[str, Any]]:
        v = row.get(field)
        vals = {**row, "rule": rule.name, "severity": rule.severity.value}
        vals |= {"entity": f"{row['node']}/{row['device']}", "metric": rule.metric}
        vals |= {"value": v, "threshold": fire, "resolve": resolve, "for_s": rule.for_ns / 1e9}
        ev = {"metric": rule.metric, "field": field, "value": v, "threshold": fire}
        ev |= {"resolve": resolve, "onset_ns": onset}
        return rule.severity.value, render(rule.summary, vals), ev

    return make


def eval_threshold(
    rule: ThresholdRule,
    field: str,
    index: MetricIndex,
    book: AlertBook,
    now_ns: int,
    topic: str,
) -> list[Alert]:
    """State changes of ``rule`` over one refined batch (``index`` over it)."""
    pos = _positions(index, rule.metric, field, rule.where, rule.device_regex)
    if pos is None:
        return []
    fire, resolve, below = threshold_limits(rule)
    values = take(column(index.table, field), pos)
    hot = _hot(rule.name, index, book, pos, classify(values, fire, resolve, below))
    if hot is None:
        return []
    sel = _runs(index, *hot)
    make = threshold_summary(rule, field)
    return _walk(rule.name, rule.for_ns, sel, book, now_ns, topic, make)


def eval_bitmask(
    rule: BitmaskRule,
    catalog: Catalog,
    index: MetricIndex,
    book: AlertBook,
    now_ns: int,
    topic: str,
) -> list[Alert]:
    """Rising edge of any of ``rule.bits`` fires, all clear resolves (over one refined batch,
    ``index`` over it)."""
    pos = _positions(index, rule.metric, "value", rule.where, None)
    if pos is None:
        return []
    m = catalog[rule.metric]
    want = {name for name in rule.bits}
    mask = sum(1 << b for b, n in m.bits.items() if n in want)
    values = take(column(index.table, "value"), pos)
    hit = pc.not_equal(pc.bit_wise_and(pc.cast(values, pa.int64(), safe=False), mask), 0)
    cls = pc.if_else(hit, pa.scalar(HI, pa.int8()), pa.scalar(LO, pa.int8()))
    hot = _hot(rule.name, index, book, pos, cls)
    if hot is None:
        return []
    sel = _runs(index, *hot)

    def make(row: dict[str, Any], onset: int) -> tuple[str, str, dict[str, Any]]:
        v = int(row["value"])
        names = [n for n in m.decode_bits(v) if n in want]
        vals = {**row, "rule": rule.name, "severity": rule.severity.value}
        vals |= {"entity": f"{row['node']}/{row['device']}", "metric": rule.metric}
        vals |= {"value": f"0x{v:x}", "reasons": ",".join(names)}
        ev = {"metric": rule.metric, "value": v, "reasons": m.decode_bits(v), "onset_ns": onset}
        return rule.severity.value, render(rule.summary, vals), ev

    return _walk(rule.name, rule.for_ns, sel, book, now_ns, topic, make)


def _event_alert(
    rule: EventRule,
    book: AlertBook,
    node: str,
    device: str,
    ts: int,
    code: int | None,
    message: str | None,
    now_ns: int,
    lineage: list[Lineage],
    ts_error_ns: int | None = None,
) -> Alert | None:
    """``ts_error_ns``: the bound on the onset's ``ts`` (its row's ``clock_error_ns``), kept in
    the evidence: a clock that just stepped leaves it wide, and the alert says so."""
    entity = f"{node}/{device}"
    key = entity if rule.resolve_on or rule.event == "throttle" else f"{entity}#{code}@{ts}"
    if book.is_firing(rule.name, key):
        return None  # still open (a second link_down before link_up is the same outage)
    meaning = ""
    sev = rule.severity.value
    if rule.event == "xid" or (rule.metric or "").endswith("xid"):
        info = xid_info(code)
        meaning = info.meaning
        sev = info.severity.value if rule.severity_from_table else sev
    vals: dict[str, Any] = {"rule": rule.name, "severity": sev, "entity": entity, "node": node}
    vals |= {"device": device, "job": None, "event": rule.event or rule.metric, "code": code}
    vals |= {"meaning": meaning, "message": message}
    ev: dict[str, Any] = {"event": rule.event or rule.metric, "code": code, "ts_ns": ts}
    if ts_error_ns is not None:
        ev["ts_error_ns"] = int(ts_error_ns)
    if meaning:
        ev["meaning"] = meaning
    if message:
        ev["message"] = message[:512]
    deadline = None if rule.resolve_on or rule.event == "throttle" else ts + rule.resolve_after_ns
    ev_deadline = {"resolve_at_ns": deadline} if deadline is not None else {}
    f = Firing(
        id=alert_id(rule.name, f"{entity}#{code}", ts, bucket_ns=1),
        starts_ns=ts,
        summary=render(rule.summary, vals),
        severity=sev,
        node=node,
        device=device,
        entity=entity,
        evidence=ev | ev_deadline,
        lineage=[x.model_dump() for x in lineage],
    )
    return book.fire(rule.name, key, f, now_ns)


def eval_events(
    rule: EventRule,
    events: pa.Table,
    book: AlertBook,
    now_ns: int,
    lineage: list[Lineage],
) -> list[Alert]:
    """Alerts of one event rule over an events table (EVENTS_SCHEMA plus ``node``)."""
    kinds = [rule.event] + ([rule.resolve_on] if rule.resolve_on else [])
    t = events.filter(pc.is_in(column(events, "event"), value_set=pa.array(kinds)))
    if t.num_rows == 0:
        return []
    t = t.sort_by([("ts_ns", "ascending")])
    out: list[Alert] = []
    cols = ["node", "ts_ns", "event", "device", "code", "message"]
    cols += ["clock_error_ns"] if "clock_error_ns" in t.column_names else []
    for r in t.select(cols).to_pylist():
        entity = f"{r['node']}/{r['device']}"
        code = r["code"]
        ends = r["event"] == rule.resolve_on or (rule.event == "throttle" and not code)
        if ends:
            a = book.resolve(rule.name, entity, int(r["ts_ns"]), now_ns)
        elif rule.codes and code not in rule.codes:
            continue
        else:
            a = _event_alert(
                rule, book, r["node"], r["device"], r["ts_ns"], code, r["message"], now_ns, lineage,
                r.get("clock_error_ns"),
            )  # fmt: skip
        if a is not None:
            out.append(a)
    return out


def eval_metric_events(
    rule: EventRule,
    index: MetricIndex,
    last: dict[str, float],
    book: AlertBook,
    now_ns: int,
    topic: str,
) -> list[Alert]:
    """Sample-borne events (``gpu.xid``): an onset is a nonzero value that differs from the
    previous value of its series (``last`` holds it between batches). ``index``: over one
    refined batch."""
    assert rule.metric is not None
    pos = _positions(index, rule.metric, "value", {}, None)
    if pos is None:
        return []
    values = take(column(index.table, "value"), pos)
    sel = _runs(index, pos, pc.cast(values, pa.int64(), safe=False))
    out: list[Alert] = []
    for row in _rows(sel):
        key, v = row["_key"], float(row["value"])
        before = last.get(key)
        last[key] = v
        if v == 0 or v == before or (rule.codes and int(v) not in rule.codes):
            continue
        a = _event_alert(
            rule,
            book,
            row["node"],
            row["device"],
            int(row["ts"]),
            int(v),
            None,
            now_ns,
            _lin(row, topic),
            row.get("clock_error_ns"),
        )
        if a is not None:
            out.append(a)
    return out


def expire_events(rules: list[EventRule], book: AlertBook, now_ns: int) -> list[Alert]:
    """Resolve occurrence alerts whose ``resolve_after`` has passed at ``now_ns``."""
    names = {r.name for r in rules}
    out = []
    for (rule, key), st in list(book.states.items()):
        f = st.firing
        if rule not in names or f is None:
            continue
        at = f.evidence.get("resolve_at_ns")
        if at is not None and now_ns >= at:
            a = book.resolve(rule, key, int(at), now_ns)
            if a is not None:
                out.append(a)
    return out
