"""Bitmask and enum readings → names (the refined ``decoded`` column)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, where
from pipelines.refine.validate_layout import BITMASK, ENUM, lookup
from schemas.catalog import Catalog, Kind, Metric


class StateDecoder:
    """Bitmask/enum readings → comma-joined names, decoded once per distinct (metric, value)
    and memoized (bounded)."""

    def __init__(self, catalog: Catalog, max_entries: int = 65_536) -> None:
        self._catalog = catalog
        self._memo: dict[str, str | None] = {}
        self._max = max_entries

    def decode(self, table: pa.Table) -> Array:
        """The ``decoded`` column for ``table`` (ACCEPTED_SCHEMA columns): names for bitmask
        and enum rows with a reading, NULL elsewhere. A bitmask of 0 decodes to ``none``;
        unnamed bits to ``bitN``; an unknown enum value to ``unknown(N)``."""
        n = table.num_rows
        kind = column(table, "kind")
        mask = pc.or_(pc.equal(kind, BITMASK), pc.equal(kind, ENUM))
        raw = column(table, "raw")
        value = column(table, "value")
        as_int = pc.coalesce(raw, pc.cast(value, pa.uint64(), safe=False))
        mask = pc.and_(mask, pc.is_valid(as_int))
        if not any_true(mask):
            return pa.nulls(n, pa.string())
        pos = where(mask)
        key = pc.binary_join_element_wise(
            pc.take(column(table, "metric"), pos),
            pc.cast(pc.take(as_int, pos), pa.string()),
            "|",
        )
        enc = key.dictionary_encode()
        names = pa.array([self._name(k) for k in enc.dictionary.to_pylist()], pa.string())
        decoded = pc.take(names, enc.indices)
        if len(pos) == n:
            return decoded
        # scatter back: rows in ``mask`` take their name in order, the others NULL
        slot = pc.subtract(pc.cumulative_sum(pc.cast(mask, pa.int64())), 1)
        return pc.take(decoded, pc.if_else(mask, slot, pa.scalar(None, pa.int64())))

    def _name(self, key: str) -> str | None:
        hit = self._memo.get(key)
        if hit is not None or key in self._memo:
            return hit
        metric_name, _, num = key.rpartition("|")
        m = lookup(self._catalog, metric_name)
        out = None if m is None else decode_one(m, int(num))
        if len(self._memo) < self._max:
            self._memo[key] = out
        return out


def decode_one(m: Metric, v: int) -> str:
    if m.kind is Kind.ENUM:
        return m.values.get(v, f"unknown({v})")
    if v == 0:
        return "none"
    names = []
    bit = 0
    while v >> bit:
        if v >> bit & 1:
            names.append(m.bits.get(bit, f"bit{bit}"))
        bit += 1
    return ",".join(names)
