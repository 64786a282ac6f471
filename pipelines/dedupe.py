"""Deduplication: transport duplicates (whole batches) and overlapping sources (samples).

**Transport duplicates.** A batch is identified by its source key
``node|exporter|instance|boot_id`` and ``seq``. :class:`SeqWindow` (one per source key) keeps
a high-water mark and, for the last ``window`` seqs, the Kafka position ``(partition,
offset)`` where each was first seen. :meth:`SeqWindow.observe` answers:

- ``new``: never seen (also a seq that fills a gap below the high-water mark);
- ``replay``: seen before *at the same position*: the same record reprocessed after a crash
  or rebalance; it is refined again (sinks are idempotent by lineage);
- ``duplicate``: seen before at a *different* position (producer retry, double publish);
- ``stale``: at or below ``hwm - window``, where nothing is remembered; treated as a
  duplicate. Seqs are monotonic per source and boot, so a seq that far behind is a resend of
  an old batch (an exporter replaying its spool), not a first delivery.

Memory per source is bounded by ``window`` entries.

**Overlapping sources.** The same series ``(node, device, metric)`` and the same ``ts_ns``
from two sources: the first seen wins, the later copy is counted as a duplicate.
:class:`OverlapState` (one per node) holds, per series, the source timestamps of the last
batch that delivered it and which source delivered them. A row is an overlap duplicate iff
its ``(series, ts_ns)`` is in that set *and* it comes from a different source. Distinct
readings are never dropped: a flat series (same value, different ts) differs in ts, and a
source repeating its own timestamp is not an overlap (counters mark it late instead). A copy
lagging by more than one batch of the other source is not recognised; it is kept (the safe
direction) rather than risking a distinct reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, merge_keyed, true_mask

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
    """Seen seqs of one source key: a high-water mark plus the first-seen position of each
    of the last ``window`` seqs."""

    window: int = 4096
    hwm: int = -1
    positions: dict[int, Position] = field(default_factory=dict)

    def observe(self, seq: int, position: Position) -> SeqOutcome:
        """Classify ``seq`` arriving at ``position`` and remember it if new. O(1) amortized."""
        if seq <= self.hwm - self.window:
            return SeqOutcome.STALE
        first = self.positions.get(seq)
        if first is not None:
            return SeqOutcome.REPLAY if first == tuple(position) else SeqOutcome.DUPLICATE
        self.positions[seq] = (int(position[0]), int(position[1]))
        if seq > self.hwm:
            self.hwm = seq
            self._prune()
        return SeqOutcome.NEW

    def _prune(self) -> None:
        floor = self.hwm - self.window
        pos = self.positions
        # seqs arrive nearly in order, so the oldest sit at the front of the dict
        while pos:
            oldest = next(iter(pos))
            if oldest > floor:
                break
            del pos[oldest]
        if len(pos) > 2 * self.window:  # out-of-order arrivals stuck behind newer ones
            self.positions = {s: p for s, p in pos.items() if s > floor}

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "hwm": self.hwm,
            "positions": [[s, p[0], p[1]] for s, p in self.positions.items()],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SeqWindow:
        return cls(
            window=int(doc["window"]),
            hwm=int(doc["hwm"]),
            positions={int(s): (int(p), int(o)) for s, p, o in doc["positions"]},
        )


OVERLAP_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),  # metric|device
        pa.field("point", pa.string()),  # metric|device|ts_ns
        pa.field("src", pa.string()),  # stream key of the source that delivered it
    ]
)


@dataclass
class OverlapState:
    """Per node: the (series, ts) points of the last batch that delivered each series."""

    table: pa.Table = field(default_factory=OVERLAP_SCHEMA.empty_table)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def to_dict(self) -> dict[str, list[Any]]:
        return {name: self.table.column(name).to_pylist() for name in OVERLAP_SCHEMA.names}

    @classmethod
    def from_dict(cls, doc: dict[str, list[Any]]) -> OverlapState:
        return cls(pa.table(doc, schema=OVERLAP_SCHEMA))


@dataclass(frozen=True)
class OverlapResult:
    keep: Array  # bool per row: False for an overlap duplicate
    duplicates: int


def drop_overlaps(
    metric: Array, device: Array, ts_source: Array, source: str, state: OverlapState
) -> tuple[OverlapResult, OverlapState]:
    """Find rows of one batch (all from ``source``, a stream key) already delivered by
    another source of the same node. Returns the keep mask and the new state; ``state`` is
    not modified. Never raises on data."""
    n = len(metric)
    if n == 0:
        return OverlapResult(pa.array([], pa.bool_()), 0), state
    key = pc.binary_join_element_wise(metric, device, "|")
    point = pc.binary_join_element_wise(key, pc.cast(ts_source, pa.string()), "|")
    st = state.table
    dup_count = 0
    keep = pa.repeat(pa.scalar(True), n)
    if st.num_rows:
        hit = pc.index_in(point, value_set=st.column("point"))
        other = true_mask(pc.not_equal(pc.take(st.column("src"), hit), source))
        if any_true(other):
            keep = pc.invert(other)
            dup_count = n - (pc.sum(keep).as_py() or 0)
    kept = pa.table(
        {"key": key, "point": point, "src": pa.repeat(pa.scalar(source), n)},
        schema=OVERLAP_SCHEMA,
    )
    if dup_count:
        kept = kept.filter(keep)
    return OverlapResult(keep, dup_count), OverlapState(merge_keyed(st, kept, "key"))
