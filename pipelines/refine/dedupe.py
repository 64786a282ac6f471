"""Deduplication: transport duplicates (whole batches) and overlapping sources (samples).

**Transport duplicates.** A batch is identified by its source key
``node|exporter|instance|boot_id`` and ``seq``. :class:`SeqWindow` (one per source key) keeps
every seq it has seen as a set of runs (contiguous seqs collapse into one ``[lo, hi]`` run, so
a source that delivers in order costs one run however long it lives), a high-water mark,
and, for the last ``window`` seqs below the mark, the Kafka position ``(partition, offset)``
where each was first seen. :meth:`SeqWindow.observe` answers:

- ``new``: never seen, however late or out of order it comes (a seq that fills a gap, a
  batch an exporter re-queued behind newer ones after an outage);
- ``replay``: seen before *at the same position*: the same record reprocessed after a crash
  or rebalance;
- ``duplicate``: seen before at a *different* position (producer retry, double publish);
- ``stale``: seen before, so long ago (at or below ``hwm - window``) that its position is
  no longer kept; treated as a duplicate.

Bounds, per source key: at most ``2 * window - 1`` positions; runs only for the gaps between
seen seqs, at most ``max_runs`` of them. A source whose seqs leave more gaps than that (lost
batches that never come) has its oldest gap filled, as if those seqs had been seen: a first
delivery of one of them after that is counted a duplicate. Every seq so given up is counted
in :attr:`SeqWindow.forgotten` (kept with the state; the worker reports the sum as
``worker.seq_gaps_forgotten``), never silently. At about 50 bytes a gap in a checkpoint, the
default 4096 gaps is ~0.2 MB a source at most; a gap is a batch its exporter never delivered.

**Overlapping sources.** The same series ``(node, device, metric)`` and the same ``ts_ns``
from two sources: the first seen wins, the later copy is counted as a duplicate.
:class:`OverlapState` (one per node) holds, per source and series, the source timestamps of
the last batch in which that source delivered the series. A row is an overlap duplicate iff
its ``(series, ts_ns)`` was delivered by a *different* source of the node. Distinct
readings are never dropped: a flat series (same value, different ts) differs in ts, and a
source repeating its own timestamp is not an overlap (counters mark it late instead). A copy
lagging by more than one batch of the other source is not recognised; it is kept (the safe
direction) rather than risking a distinct reading.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, all_true, any_true, column
from pipelines.refine._packed import PackedRows

Position = tuple[int, int]  # (partition, offset)


class SeqOutcome(StrEnum):
    NEW = "new"
    REPLAY = "replay"
    DUPLICATE = "duplicate"
    STALE = "stale"

    @property
    def is_duplicate(self) -> bool:
        return self in (SeqOutcome.DUPLICATE, SeqOutcome.STALE)


@dataclass
class SeqWindow:
    """Seen seqs of one source key: the runs of every seq seen, a high-water mark and the
    first-seen position of each of the last ``window`` seqs."""

    window: int = 4096
    hwm: int = -1
    positions: dict[int, Position] = field(default_factory=dict)
    # every seq seen: disjoint, non-adjacent runs [lo[i], hi[i]] in ascending order
    lo: list[int] = field(default_factory=list)
    hi: list[int] = field(default_factory=list)
    max_runs: int = 4096
    forgotten: int = 0  # seqs never seen but given up as seen when gaps exceeded max_runs
    # ``forgotten`` summed over every window of the process, for the worker's telemetry
    forgotten_total: ClassVar[int] = 0
    # :meth:`packed`'s cache: entries come at the dict's end and leave from its front, so a
    # checkpoint packs only the new ones
    _pack: PackedRows = field(
        default_factory=lambda: PackedRows(3), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.lo and self.positions:  # built from positions alone: they are seen
            for s in sorted(self.positions):
                self._add(s)

    def observe(self, seq: int, position: Position) -> SeqOutcome:
        """Classify ``seq`` arriving at ``position`` and remember it if new. O(1) for a seq
        next to the newest run, O(log runs) otherwise (plus a list insert for a new gap)."""
        first = self.positions.get(seq)
        if first is not None:
            return SeqOutcome.REPLAY if first == tuple(position) else SeqOutcome.DUPLICATE
        hi = self.hi
        if hi and seq == hi[-1] + 1:  # the common case: the next seq in order
            hi[-1] = seq
        elif self.seen(seq):
            return SeqOutcome.STALE if seq <= self.hwm - self.window else SeqOutcome.DUPLICATE
        else:
            self._add(seq)
        if seq <= self.hwm - self.window:  # a first delivery that came this late: no position
            return SeqOutcome.NEW
        where = (int(position[0]), int(position[1]))
        self.positions[seq] = where
        self._pack.append((seq, *where))
        if seq > self.hwm:
            self.hwm = seq
            self._prune()
        return SeqOutcome.NEW

    def seen(self, seq: int) -> bool:
        i = bisect_right(self.lo, seq) - 1
        return i >= 0 and seq <= self.hi[i]

    @property
    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self.lo, self.hi, strict=True))

    def _add(self, seq: int) -> None:
        """Add an unseen ``seq`` to the runs, joining its neighbours."""
        lo, hi = self.lo, self.hi
        i = bisect_right(lo, seq)  # runs before i start at or below seq
        left = i > 0 and hi[i - 1] == seq - 1
        right = i < len(lo) and lo[i] == seq + 1
        if left and right:
            hi[i - 1] = hi[i]
            del lo[i], hi[i]
        elif left:
            hi[i - 1] = seq
        elif right:
            lo[i] = seq
        else:
            lo.insert(i, seq)
            hi.insert(i, seq)
            while len(lo) > self.max_runs:  # fill the oldest gap: counted, never silent
                gap = lo[1] - hi[0] - 1
                self.forgotten += gap
                SeqWindow.forgotten_total += gap
                hi[0] = hi[1]
                del lo[1], hi[1]

    def discard(self, seq: int, hwm: int) -> None:
        """Undo the :meth:`observe` that made ``seq`` new (its record was not refined after
        all); ``hwm``: the mark before it."""
        if self.positions.pop(seq, None) is not None:
            self._pack.invalidate()
        self.hwm = hwm
        i = bisect_right(self.lo, seq) - 1
        if i < 0 or seq > self.hi[i]:
            return
        lo, hi = self.lo, self.hi
        if lo[i] == hi[i]:
            del lo[i], hi[i]
        elif seq == lo[i]:
            lo[i] = seq + 1
        elif seq == hi[i]:
            hi[i] = seq - 1
        else:
            lo.insert(i + 1, seq + 1)
            hi.insert(i + 1, hi[i])
            hi[i] = seq - 1

    def _prune(self) -> None:
        """Forget the positions at the front of the dict that fell out of the window. Seqs
        arrive nearly in order, so the oldest sit at the front; one that came late may stay
        behind a newer one, but never more than ``2 * window - 1`` entries remain: the first
        entry ``f`` left is in the window (``f > hwm - window``), and every entry after it
        came when the mark was at least ``f``, so above ``f - window`` (older ones get no
        position): all are distinct seqs in ``(f - window, f + window)``."""
        floor = self.hwm - self.window
        pos = self.positions
        while pos:
            oldest = next(iter(pos))
            if oldest > floor:
                break
            del pos[oldest]
            self._pack.drop_first()

    def packed(self) -> bytes:
        """The positions in order as little-endian int64 triples (seq, partition, offset),
        for a checkpoint: the bytes of the last call less the entries pruned since, plus
        those added (a full window of 512 packed anew took ~60 µs). Raises OverflowError for
        a value past int64."""
        pos = self.positions
        packed = self._pack.get(lambda: ((s, *p) for s, p in pos.items()), len(pos))
        if packed is None:
            raise OverflowError("a seq or position past int64")
        return packed

    def meta(self) -> dict[str, Any]:
        """Everything but the positions, as JSON values (the runs as ``[lo, hi]`` pairs)."""
        return {
            "window": self.window,
            "hwm": self.hwm,
            "runs": [[a, b] for a, b in zip(self.lo, self.hi, strict=True)],
            "forgotten": self.forgotten,
        }

    @classmethod
    def restore(cls, meta: dict[str, Any], positions: dict[int, Position]) -> SeqWindow:
        """The window :meth:`meta` and the positions describe. State written before runs were
        kept has none: every seq at or below ``hwm - window`` counted as seen then (a
        ``stale`` duplicate), and still does."""
        w = cls(window=int(meta["window"]), hwm=int(meta["hwm"]))
        w.positions = positions
        if "runs" in meta:
            w.lo = [int(a) for a, _ in meta["runs"]]
            w.hi = [int(b) for _, b in meta["runs"]]
            w.forgotten = int(meta.get("forgotten", 0))
            return w
        floor = w.hwm - w.window
        if floor >= 0:
            w.lo, w.hi = [0], [floor]
        for s in sorted(positions):
            if not w.seen(s):
                w._add(s)
        return w

    def to_dict(self) -> dict[str, Any]:
        return {**self.meta(), "positions": [[s, p[0], p[1]] for s, p in self.positions.items()]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SeqWindow:
        positions = {int(s): (int(p), int(o)) for s, p, o in doc["positions"]}
        return cls.restore(doc, positions)


POINTS_SCHEMA = pa.schema(
    [
        pa.field("metric", pa.string()),
        pa.field("device", pa.string()),
        pa.field("ts", pa.int64()),  # ts_ns as the source stamped it
    ]
)
# the whole state of a node as one table (for changelog encoding): points plus their source
OVERLAP_SCHEMA = pa.schema([*POINTS_SCHEMA, pa.field("src", pa.string())])


@dataclass
class OverlapState:
    """Per node: for each source (stream key), the (series, ts) points of the last batch in
    which it delivered each series. Only nodes with two or more sources pay for a check.

    Constructed from ``{source: points table}`` or from one :data:`OVERLAP_SCHEMA` table
    (as :attr:`table` gives it, for changelog encoding)."""

    sources: dict[str, pa.Table] = field(default_factory=dict)
    # the joined point keys of each source's table, computed once (a cache, not state)
    keys: dict[str, Array] = field(default_factory=dict, compare=False, repr=False)
    # the metrics of each source's table (a cache, not state): two sources that share no
    # metric share no point, which is the common case (a node's exporters measure different
    # things), and a batch is then kept whole without building or hashing point keys
    metrics: dict[str, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)
    # the validation layout generation (:attr:`pipelines.refine.validate.LayoutCache.gen`) whose
    # metric and device columns a source's table holds, when it holds a whole batch's rows (a
    # cache, not state): a batch of the same generation has the same series, uncompared
    gens: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.sources, pa.Table):
            whole = self.sources
            src = column(whole, "src")
            self.sources = {
                s: whole.filter(pc.equal(src, s)).select(POINTS_SCHEMA.names)
                for s in pc.unique(src).to_pylist()
            }

    @property
    def table(self) -> pa.Table:
        """All points of the node with their ``src``: :data:`OVERLAP_SCHEMA`."""
        parts = [
            t.append_column("src", pa.repeat(pa.scalar(s), t.num_rows))
            for s, t in self.sources.items()
        ]
        return pa.concat_tables(parts) if parts else OVERLAP_SCHEMA.empty_table()

    def __len__(self) -> int:
        return sum(int(t.num_rows) for t in self.sources.values())

    def to_dict(self) -> dict[str, list[Any]]:
        t = self.table
        return {name: t.column(name).to_pylist() for name in OVERLAP_SCHEMA.names}

    @classmethod
    def from_dict(cls, doc: dict[str, list[Any]]) -> OverlapState:
        return cls(pa.table(doc, schema=OVERLAP_SCHEMA))


@dataclass(frozen=True)
class OverlapResult:
    keep: Array  # bool per row: False for an overlap duplicate
    duplicates: int


def overlap_points(metric: Array, device: Array, ts: Array) -> Array:
    """The key :func:`drop_overlaps` compares rows by: ``metric|device|ts``."""
    key = pc.binary_join_element_wise(metric, device, "|")
    return pc.binary_join_element_wise(key, pc.cast(ts, pa.string()), "|")


def drop_overlaps(
    metric: Array,
    device: Array,
    ts_source: Array,
    source: str,
    state: OverlapState,
    known: int | None = None,
) -> tuple[OverlapResult, OverlapState]:
    """Find rows of one batch (all from ``source``, a stream key) already delivered by
    another source of the same node. Returns the keep mask and the new state; ``state`` is
    not modified. ``known``: the validation layout generation of the batch when these are
    all its rows (see :attr:`OverlapState.gens`). Never raises on data."""
    n = len(metric)
    if n == 0:
        return OverlapResult(pa.array([], pa.bool_()), 0), state
    old = state.sources.get(source)
    # a source sends the same series in the same order every time: its metrics are those of
    # its previous batch, found by its layout's generation or by comparing the columns
    # instead of hashing them again
    same_series = old is not None and (
        (known is not None and state.gens.get(source) == known)
        or (column(old, "metric").equals(metric) and column(old, "device").equals(device))
    )
    # the batch's metrics are needed only when the node has another source with points
    # (most nodes have one: then they are left for :func:`_metrics_of` to find if asked)
    mine_metrics: frozenset[str] | None = None
    if any(src != source and t.num_rows for src, t in state.sources.items()):
        mine_metrics = (
            _metrics_of(state, source) if same_series else frozenset(pc.unique(metric).to_pylist())
        )
    others = [
        src
        for src, t in state.sources.items()
        if src != source and t.num_rows and mine_metrics is not None
        and not mine_metrics.isdisjoint(_metrics_of(state, src))
    ]  # fmt: skip
    dup_count = 0
    keep = None
    points = None  # the rows' point keys, built only when another source shares a metric
    if others:
        points = overlap_points(metric, device, ts_source)
        seen = [_keys_of(state, src) for src in others]
        hit = pc.is_in(points, value_set=seen[0] if len(seen) == 1 else pa.concat_arrays(seen))
        if any_true(hit):
            keep = pc.invert(hit)
            dup_count = n - (pc.sum(keep).as_py() or 0)
    mine = pa.Table.from_arrays([metric, device, ts_source], schema=POINTS_SCHEMA)
    if keep is not None:
        mine = mine.filter(keep)
        assert points is not None
        points = points.filter(keep)
    sources = dict(state.sources)
    keys = {k: v for k, v in state.keys.items() if k != source}
    metrics = {k: v for k, v in state.metrics.items() if k != source}
    gens = {k: v for k, v in state.gens.items() if k != source}
    if old is None or (not dup_count and same_series):
        sources[source] = mine  # same series as last time: a plain replacement
        if points is not None:
            keys[source] = points
        if mine_metrics is not None:
            metrics[source] = mine_metrics
        elif same_series and source in state.metrics:
            metrics[source] = state.metrics[source]
        if known is not None and not dup_count:  # the batch's rows, all of them
            gens[source] = known
    else:
        sources[source] = _merge_series(old, mine)
    if keep is None:
        keep = all_true(n)
    return OverlapResult(keep, dup_count), OverlapState(sources, keys, metrics, gens)


def _metrics_of(state: OverlapState, source: str) -> frozenset[str]:
    got = state.metrics.get(source)
    if got is None:
        got = frozenset(pc.unique(column(state.sources[source], "metric")).to_pylist())
        state.metrics[source] = got
    return got


def _keys_of(state: OverlapState, source: str) -> Array:
    got = state.keys.get(source)
    if got is None:
        t = state.sources[source]
        got = state.keys[source] = overlap_points(
            column(t, "metric"), column(t, "device"), column(t, "ts")
        )
    return got


def _merge_series(old: pa.Table, new: pa.Table) -> pa.Table:
    """Points of ``old`` for series absent from ``new``, then all of ``new``."""
    if new.num_rows == 0:
        return old
    k_old = pc.binary_join_element_wise(column(old, "metric"), column(old, "device"), "|")
    k_new = pc.binary_join_element_wise(column(new, "metric"), column(new, "device"), "|")
    return pa.concat_tables([old.filter(pc.invert(pc.is_in(k_old, value_set=k_new))), new])
