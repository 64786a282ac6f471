"""What counter derivation keeps per source stream between batches: the last accepted
reading of each series (:class:`CounterState`, checkpointed) and the shape of the stream's
last batch (:class:`CounterLayout`, a cache). See :mod:`pipelines.refine.counters`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipelines._arrow import Array, column

STATE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),  # metric|device
        pa.field("raw", pa.uint64()),  # last accepted raw reading
        pa.field("ts", pa.int64()),  # its aligned ts
        pa.field("boot", pa.string()),  # boot_id it was read under
        pa.field("src", pa.int64()),  # its ts on the source's own clock
    ]
)

_NO_STATE = STATE_SCHEMA.empty_table()  # shared: building one costs ~20 µs a time


@dataclass
class CounterState:
    """Last accepted reading per counter series of one source stream."""

    table: pa.Table = field(default_factory=lambda: _NO_STATE)  # tables are immutable

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def to_dict(self) -> dict[str, list[Any]]:
        """Plain lists, for a Faust table's JSON serializer."""
        return {name: self.table.column(name).to_pylist() for name in STATE_SCHEMA.names}

    @classmethod
    def from_dict(cls, doc: dict[str, list[Any]]) -> CounterState:
        return cls(pa.table(doc, schema=STATE_SCHEMA))


@dataclass
class CounterLayout:
    """What one source stream's last batch looked like to :func:`derive_rates_group` (a cache,
    not state): exporters send the same series in the same order every batch, and then the
    series of each row, their order by (series, source ts) and their rows in the state are
    those of last time, found by comparing arrays instead of joining and hashing key strings
    and sorting."""

    metric: Array = None  # the batch's metric and device columns (all its rows)
    device: Array = None
    counters: Array = None  # which of its rows were counter readings
    names: Array = None  # the stream's state keys after that batch, in state order
    pos: Any = None  # numpy: its counter rows (in the batch), in (series, source ts) order
    codes: Any = None  # numpy: the series of each, as an index into ``names``
    hits: int = 0  # batches that used it
    # the validation layout generation (:attr:`pipelines.refine.validate.LayoutCache.gen`) of the
    # batch it was made from, when that batch's rows were all kept: a later batch of the same
    # generation whose rows were all kept has the same metric and device columns
    known: int | None = None

    def matches(
        self, view: Callable[[], tuple[Array, Array]], counters: Array, state: CounterState,
        known: int | None = None,
    ) -> bool:  # fmt: skip
        """Whether a batch fits: ``view`` gives its metric and device columns (not called
        when ``known`` vouches for them), ``counters`` its counter-row mask."""
        if self.names is None or not self.counters.equals(counters):
            return False
        if known is None or known != self.known:
            metric, device = view()
            if not (self.metric.equals(metric) and self.device.equals(device)):
                return False
            if known is not None:  # its columns are this generation's too
                self.known = known
        return bool(self.names.equals(column(state.table, "key")))


@dataclass(frozen=True)
class CounterPart:
    """One source stream's consecutive rows in a :func:`derive_rates_group` table, and the
    stream's :class:`CounterLayout` cache if the caller keeps one (it is updated in place)."""

    rows: int
    boot_id: str
    state: CounterState
    layout: CounterLayout | None = None
    known: int | None = None  # see CounterLayout.known: the batch's, when all its rows were kept
