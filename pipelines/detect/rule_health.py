"""Pipeline-health and clock rules: silent/frozen sources, dead-letter rate, freshness, clocks.

Per-source state (:class:`SourceState`) is a few numbers per ``node|exporter|instance``;
batches are summarized with one ``group_by`` per refined table (per source and ``seq``:
count, sum, min, max of the values, max aligned ts, raw partition and offset), so the
per-batch Python is per source, never per sample.

Silence is judged on the pipeline's own progress, in the broker's time. Per raw topic and
partition, :class:`PartitionProgress` holds the broker append time of every raw record the
refiner has accounted for (``telemetry.accounting``, :meth:`RuleEngine.on_progress`); per raw
topic and node, :class:`NodeProgress` how far its records are accounted for and how far its
refined rows have been read (a node's rows come in raw order, whichever refined partition
carries them). A source's partition has *reached* the newest accounted append time when every
accounted record of its node has been read refined; otherwise the append time of its node's
newest row read. A source is silent when that is more than ``intervals`` of its intervals past
its own newest record: records were appended to its partition, refined and read meanwhile, none
of them its own; a pause of the partition's appends longer than two of the source's intervals
(a leader failover: nobody's records were appended, then all producers' queued ones at once)
restarts the count when the partition resumes. The count is also no more than how far the data
reached has moved past the source's newest ts (the accounting's ``ts_max``, the newest aligned
ts of each record's rows, else its node's newest row read): a producer falling behind (a loaded
host getting everyone's records to the broker later and later) spaces them in broker time, not
in the time they tell; that cap can only delay a judgement. The wall clock never enters, so a
refiner that is behind, restarting or catching up, a refined partition read ahead of another, a
leader failover, or a clock that jumps, makes nobody silent. A partition with no record at all
judges nobody (the freshness rule reports a pipeline gone quiet). Without any accounting (an
engine fed refined rows only) silence falls back to data time: the engine's ``now`` against the
source's newest aligned ts.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from pipelines._arrow import column
from pipelines.detect.alerts import HI, LO, MID, AlertBook, Firing, alert_id
from pipelines.detect.rule_config import (
    ClockRule,
    DeadletterRule,
    FreshnessRule,
    FrozenRule,
    SilentRule,
    render,
)
from schemas.records import Alert


class ClockStatus(BaseModel):
    """The refiner's view of one source's clock, handed to :meth:`RuleEngine.on_clock`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="node|exporter|instance")
    offset_ns: int
    error_ns: int = 0
    flagged: bool = False
    ts_ns: int = Field(description="when the estimate was made (common clock)")


@dataclass
class SourceState:
    last_ts: int = 0  # newest aligned ts seen
    last_seen_ns: int = 0  # engine time (now_ns) of the newest batch
    interval_ns: int = 0  # learned scrape interval (EWMA of batch-to-batch gaps)
    fingerprint: list[float] = field(default_factory=list)
    repeats: int = 0
    topic: str = ""  # raw topic of its records (telemetry.raw or an ingest topic)
    partition: int = -1  # raw partition of its records (-1: not known)
    offset: int = -1  # raw offset of its newest record
    # its interval in broker time (EWMA of append-time gaps, per batch): silence is judged in
    # broker time, where a producer's pace, not the source's clock, spaces its records
    broker_interval_ns: int = 0
    fold_offset: int = -1  # the newest record folded into broker_interval_ns
    fold_append_ns: int = 0
    fold_batches: int = 0  # new batches seen since that record


@dataclass
class NodeProgress:
    """One node's raw records as far as the engine has read them."""

    accounted: int = -1  # newest raw offset of its records with refined rows, accounted for
    refined: int = -1  # newest raw offset of its refined rows read
    refined_ts: int = 0  # newest aligned ts of its refined rows read


GAP_NS = 100_000_000  # pauses of a partition's appends kept (PartitionProgress.gaps)


@dataclass
class PartitionProgress:
    """One raw partition as far as the engine has read it: the broker append time of each raw
    record accounted for, as ``(offset, append_ns)`` runs (one entry per run of records with
    one append time, at its last offset; at most ``cap`` entries, the oldest dropped)."""

    offsets: list[int] = field(default_factory=list)
    appends: list[int] = field(default_factory=list)
    cap: int = 100_000
    # (last append before, first append after) of each pause of the partition's appends
    # longer than GAP_NS (a leader failover, an outage, an idle spell), the newest last
    gaps: list[tuple[int, int]] = field(default_factory=list)
    # the newest aligned ts of the refined rows of the records accounted for (0: none said):
    # how far in data time the refiner has come on the partition, any node's records
    data_ts: int = 0

    def accounted(self, offset: int, append_ns: int) -> None:
        """The refiner accounted for the record at ``offset``, appended at ``append_ns``.
        Records arrive in offset order; an older one (a replay) is known already."""
        if self.offsets and offset <= self.offsets[-1]:
            return
        append_ns = max(append_ns, self.appends[-1]) if self.appends else append_ns
        if self.appends and append_ns == self.appends[-1]:
            self.offsets[-1] = offset
            return
        if self.appends and append_ns - self.appends[-1] > GAP_NS:
            self.gaps.append((self.appends[-1], append_ns))
            del self.gaps[: -self.cap // 100]
        self.offsets.append(offset)
        self.appends.append(append_ns)
        if len(self.offsets) > self.cap:
            del self.offsets[: self.cap // 2], self.appends[: self.cap // 2]

    def newest_ns(self) -> int | None:
        return self.appends[-1] if self.appends else None

    def resumed(self, since_ns: int, longer_than_ns: int) -> int:
        """When the partition last resumed, after ``since_ns``, from a pause of its appends
        longer than ``longer_than_ns``; ``since_ns`` when it did not pause so long since."""
        for before, after in reversed(self.gaps):
            if after <= since_ns:
                break
            if after - max(before, since_ns) > longer_than_ns:
                return after
        return since_ns

    def append_of(self, offset: int) -> int | None:
        """Append time of the record at ``offset`` (of an older one than those kept: the
        oldest kept, later than its own); None when not accounted for yet."""
        i = bisect_left(self.offsets, offset)
        return self.appends[i] if i < len(self.appends) else None


def entity_node(source: str) -> str:
    """The node of a source key (``node|exporter|...``)."""
    return source.split("|", 1)[0]


def _fire(
    book: AlertBook,
    rule: Any,
    entity: str,
    onset: int,
    now: int,
    vals: dict[str, Any],
    evidence: dict[str, Any],
    node: str | None = None,
) -> Alert:
    v = {"rule": rule.name, "severity": rule.severity.value, "entity": entity, "node": node}
    v |= {"device": None, "job": None, **vals}
    f = Firing(
        id=alert_id(rule.name, entity, onset),
        starts_ns=onset,
        summary=render(rule.summary, v),
        severity=rule.severity.value,
        node=node,
        evidence=evidence,
    )
    return book.fire(rule.name, entity, f, now)


def summarize_batches(table: pa.Table) -> list[dict[str, Any]]:
    """One row per (source, seq) of a refined table, in time order: source, ts, n, sum,
    min, max of ``value``, raw topic ("": not carried), partition and newest raw offset.
    Grouped on the source's three names themselves: joining them into one key first built
    a string per row, where only one per group is needed."""
    if table.num_rows == 0:
        return []
    names = ["node", "exporter", "instance", "seq", "ts", "value", "raw_partition", "raw_offset"]
    t = pa.table([column(table, c) for c in names], names=names)
    topic = (
        pc.fill_null(column(table, "raw_topic"), "")
        if "raw_topic" in table.column_names
        else pa.repeat(pa.scalar("", pa.string()), table.num_rows)
    )
    t = t.append_column("raw_topic", topic)
    g = t.group_by(
        ["node", "exporter", "instance", "seq", "raw_topic"], use_threads=False
    ).aggregate(
        [
            ("ts", "max"),
            ("value", "count"),
            ("value", "sum"),
            ("value", "min"),
            ("value", "max"),
            ("raw_partition", "max"),
            ("raw_offset", "max"),
        ]
    )
    source = pc.binary_join_element_wise(g["node"], g["exporter"], g["instance"], "|")
    g = g.drop_columns(["node", "exporter", "instance"]).add_column(0, "source", source)
    rows: list[dict[str, Any]] = g.sort_by([("ts_max", "ascending")]).to_pylist()
    return rows


def observe_sources(
    rows: list[dict[str, Any]],
    sources: dict[str, SourceState],
    silent: list[SilentRule],
    frozen: list[FrozenRule],
    book: AlertBook,
    now_ns: int,
    nodes: dict[tuple[str, str], NodeProgress] | None = None,
    raw_topic: str = "",
) -> list[Alert]:
    """Update per-source state from batch summaries; resolves silent alerts of sources that
    speak again, fires/resolves frozen alerts. ``nodes``: how far each node's refined rows
    of each raw topic read have come (updated here); ``raw_topic``: the topic of rows that
    do not name theirs."""
    out: list[Alert] = []
    for r in rows:
        src, ts = r["source"], int(r["ts_max"])
        st = sources.setdefault(src, SourceState())
        part, off = r.get("raw_partition_max"), r.get("raw_offset_max")
        if part is not None and off is not None:
            topic = r.get("raw_topic") or raw_topic
            if topic != st.topic:  # offsets of another topic: not comparable
                st.topic, st.offset = topic, -1
            st.partition, st.offset = int(part), max(st.offset, int(off))
            if nodes is not None:
                np_ = nodes.setdefault((topic, entity_node(src)), NodeProgress())
                np_.refined = max(np_.refined, st.offset)
                np_.refined_ts = max(np_.refined_ts, ts)
        for rule in silent:  # it spoke, whatever its clock says of the time
            a = book.resolve(rule.name, src, max(ts, st.last_ts), now_ns)
            if a is not None:
                out.append(a)
        if ts <= st.last_ts:
            continue  # a second batch at the same instant (or late): not a new interval
        st.fold_batches += 1
        if st.last_ts:
            gap = ts - st.last_ts
            # a clock step must not teach the source a long interval at once
            gap = min(gap, 4 * st.interval_ns) if st.interval_ns else gap
            st.interval_ns = gap if not st.interval_ns else (st.interval_ns + gap) // 2
        st.last_ts, st.last_seen_ns = ts, now_ns
        out += _frozen(r, src, st, frozen, book, ts, now_ns)
    return out


def _frozen(
    r: dict[str, Any],
    src: str,
    st: SourceState,
    frozen: list[FrozenRule],
    book: AlertBook,
    ts: int,
    now_ns: int,
) -> list[Alert]:
    out: list[Alert] = []
    fp = [float(r[k] or 0.0) for k in ("value_count", "value_sum", "value_min", "value_max")]
    # no non-NULL values: nothing to judge (not "identical")
    st.repeats = st.repeats + 1 if fp[0] and fp == st.fingerprint else 0
    st.fingerprint = fp
    for fr in frozen:
        if st.repeats >= fr.intervals and not book.is_firing(fr.name, src):
            onset = ts - st.repeats * max(st.interval_ns, 1)
            vals = {"source": src, "intervals": st.repeats}
            ev = {"repeats": st.repeats, "series": int(fp[0])}
            out.append(_fire(book, fr, src, onset, now_ns, vals, ev, entity_node(src)))
        elif st.repeats == 0:
            a = book.resolve(fr.name, src, ts, now_ns)
            if a is not None:
                out.append(a)
    return out


def _quiet(
    src: str,
    st: SourceState,
    progress: dict[tuple[str, int], PartitionProgress],
    nodes: dict[tuple[str, str], NodeProgress],
    now_ns: int,
    interval_ns: int = 0,
) -> tuple[int, int] | None:
    """(how long the source has been quiet, since when) on its partition's progress in broker
    time (see the module); on data time when no accounting was ever read (``progress``
    empty); None: not judged now."""
    if not progress:
        return (now_ns - st.last_ts, st.last_ts) if st.last_ts else None
    pp = progress.get((st.topic, st.partition))
    np_ = nodes.get((st.topic, entity_node(src)))
    if pp is None or np_ is None or st.offset < 0:
        return None
    # every accounted record of its node read refined: the partition's newest, else its node's
    whole = np_.refined >= np_.accounted
    reached = pp.newest_ns() if whole else pp.append_of(np_.refined)
    last = pp.append_of(st.offset)
    if reached is None or last is None:
        return None
    # a partition that took nothing from anyone for longer than two of the source's
    # intervals was down (a leader failover) or idle: its producers' queued records come in
    # a burst after it, the source's among them; its silence counts from then
    start = pp.resumed(last, 2 * interval_ns) if interval_ns else last
    quiet = reached - start
    # and no longer than the data reached has moved past the source's own newest (the
    # partition's accounted for, else its node's read): a producer that falls behind (a
    # loaded host getting everyone's records to the broker later and later, slower than they
    # are made) spaces them in broker time, not in the time they tell; a source that stopped
    # while others go on is behind in both
    data = pp.data_ts if whole else np_.refined_ts
    if data:
        quiet = min(quiet, data - st.last_ts)
    return quiet, last


def tick_silent(
    sources: dict[str, SourceState],
    rules: list[SilentRule],
    book: AlertBook,
    now_ns: int,
    progress: dict[tuple[str, int], PartitionProgress] | None = None,
    nodes: dict[tuple[str, str], NodeProgress] | None = None,
    memo: dict[str, tuple[Any, ...]] | None = None,
) -> list[Alert]:
    """Fire for sources quiet for ``intervals`` intervals: their raw partition was refined
    and read that much broker time past their newest record (see the module). ``memo``
    (kept by the caller between ticks): per source, what :func:`_cannot_fire` needs."""
    out: list[Alert] = []
    if not rules:
        return out
    progress = {p: pp for p, pp in (progress or {}).items() if pp.offsets}
    for src, st in sources.items():
        pp = progress.get((st.topic, st.partition))
        _fold_broker_interval(st, pp)
        if pp is not None and memo is not None and _cannot_fire(src, st, rules, pp, memo):
            continue
        for rule in rules:
            interval = rule.interval_ns or max(st.interval_ns, st.broker_interval_ns)
            if not interval or book.is_firing(rule.name, src):
                continue
            q = _quiet(src, st, progress, nodes or {}, now_ns, interval)
            if q is None:
                continue
            quiet, since = q
            if quiet > rule.intervals * interval:
                vals = {"source": src, "intervals": rule.intervals, "silent_s": quiet / 1e9}
                ev = {"last_ts": st.last_ts, "interval_ns": interval, "quiet_ns": quiet}
                ev |= {"raw_partition": st.partition, "raw_offset": st.offset}
                out.append(_fire(book, rule, src, since, now_ns, vals, ev, entity_node(src)))
    return out


def _cannot_fire(
    src: str,
    st: SourceState,
    rules: list[SilentRule],
    pp: PartitionProgress,
    memo: dict[str, tuple[Any, ...]],
) -> bool:
    """True when no rule can find ``src`` silent at this tick: its partition's newest append
    is no further past the append of the source's newest record than the shortest span a
    rule waits. That bounds :func:`_quiet` from above (it counts from that append or later,
    to that newest or earlier), so skipping the source changes nothing; a tick then looks
    up the quiet time of only the few sources near their span. The append of the
    source's record and the spans are kept per source until its record, partition or
    intervals change."""
    key = (st.topic, st.partition, st.offset, st.interval_ns, st.broker_interval_ns)
    got = memo.get(src)
    if got is None or got[0] != key or got[1] is not pp:
        last = pp.append_of(st.offset) if st.offset >= 0 else None
        spans = [
            r.intervals * iv
            for r in rules
            if (iv := r.interval_ns or max(st.interval_ns, st.broker_interval_ns))
        ]
        if last is None or not spans:
            memo.pop(src, None)
            return not spans
        got = memo[src] = (key, pp, last, min(spans))
    return bool(pp.appends[-1] - got[2] <= got[3])


def _fold_broker_interval(st: SourceState, pp: PartitionProgress | None) -> None:
    """Fold the append-time gap since the last folded record of ``st``, per batch between,
    into its broker-time interval. Its clock may space its batches otherwise: a clock run
    fast, or a producer that cannot keep the exporter's pace."""
    if pp is None or st.offset < 0 or st.offset == st.fold_offset:
        return
    append = pp.append_of(st.offset)
    if append is None:
        return
    if st.fold_offset >= 0 and append > st.fold_append_ns and st.fold_batches > 0:
        gap = (append - st.fold_append_ns) // st.fold_batches
        bi = st.broker_interval_ns
        st.broker_interval_ns = gap if not bi else (bi + gap) // 2
    st.fold_offset, st.fold_append_ns, st.fold_batches = st.offset, append, 0


def _level(
    book: AlertBook,
    rule: Any,
    entity: str,
    cls: int,
    ts: int,
    for_ns: int,
    now: int,
    vals: dict[str, Any],
    ev: dict[str, Any],
    node: str | None = None,
) -> Alert | None:
    if cls != HI and (rule.name, entity) not in book.states:
        return None
    st = book.get(rule.name, entity)
    action = st.step(cls, ts, for_ns)
    if action == "fire" and st.pending_since is not None:
        return _fire(book, rule, entity, st.pending_since, now, vals, ev, node)
    if action == "resolve":
        return book.resolve(rule.name, entity, ts, now)
    return None


def _cls(hi: bool, lo: bool) -> int:
    return HI if hi else (LO if lo else MID)


def eval_clock(
    statuses: list[ClockStatus], rules: list[ClockRule], book: AlertBook, now_ns: int
) -> list[Alert]:
    out = []
    for s in sorted(statuses, key=lambda s: (s.ts_ns, s.source)):
        for rule in rules:
            resolve = rule.above_ns if rule.resolve_ns is None else rule.resolve_ns
            off = abs(s.offset_ns)
            flag = rule.flagged and s.flagged
            cls = _cls(off > rule.above_ns or flag, off < resolve and not flag)
            vals = {"source": s.source, "offset_ms": s.offset_ns / 1e6}
            vals |= {"error_ms": s.error_ns / 1e6, "threshold_ms": rule.above_ns / 1e6}
            ev = {"offset_ns": s.offset_ns, "error_ns": s.error_ns, "flagged": s.flagged}
            a = _level(
                book, rule, s.source, cls, s.ts_ns, 0, now_ns, vals, ev, entity_node(s.source)
            )
            if a is not None:
                out.append(a)
    return out


def eval_freshness(
    table: pa.Table, rules: list[FreshnessRule], book: AlertBook, now_ns: int
) -> list[Alert]:
    """Lag = ``now_ns`` - newest aligned ts of the batch, against each rule."""
    if table.num_rows == 0 or not rules:
        return []
    lag = now_ns - int(pc.max(column(table, "ts")).as_py())
    out = []
    for rule in rules:
        resolve = rule.above_ns if rule.resolve_ns is None else rule.resolve_ns
        cls = _cls(lag > rule.above_ns, lag < resolve)
        vals = {"lag_s": lag / 1e9, "threshold_s": rule.above_ns / 1e9}
        a = _level(book, rule, "pipeline", cls, now_ns, rule.for_ns, now_ns, vals, {"lag_ns": lag})
        if a is not None:
            out.append(a)
    return out


@dataclass
class DeadletterWindow:
    """Dead letters counted per second of engine time; bounded by the window."""

    buckets: dict[int, int] = field(default_factory=dict)

    def add(self, n: int, ts_ns: int) -> None:
        s = ts_ns // 1_000_000_000
        self.buckets[s] = self.buckets.get(s, 0) + n

    def rate(self, now_ns: int, window_ns: int) -> float:
        lo = (now_ns - window_ns) // 1_000_000_000
        return sum(v for k, v in self.buckets.items() if k > lo) / (window_ns / 1e9)

    def prune(self, now_ns: int, window_ns: int) -> None:
        lo = (now_ns - window_ns) // 1_000_000_000
        for k in [k for k in self.buckets if k <= lo]:
            del self.buckets[k]

    def to_dict(self) -> dict[str, Any]:
        return {str(k): v for k, v in asdict(self)["buckets"].items()}


def eval_deadletters(
    window: DeadletterWindow, rules: list[DeadletterRule], book: AlertBook, now_ns: int
) -> list[Alert]:
    out = []
    if rules:
        window.prune(now_ns, max(r.window_ns for r in rules))
    for rule in rules:
        rate = window.rate(now_ns, rule.window_ns)
        resolve = rule.above if rule.resolve is None else rule.resolve
        cls = _cls(rate > rule.above, rate < resolve)
        vals = {"rate": rate, "threshold": rule.above, "window_s": rule.window_ns / 1e9}
        a = _level(book, rule, "pipeline", cls, now_ns, 0, now_ns, vals, {"rate_per_s": rate})
        if a is not None:
            out.append(a)
    return out
