"""Small vectorized helpers over Arrow arrays shared by the pure refining transforms.

Everything here is one or a few ``pyarrow.compute`` calls: no per-row Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Array = Any  # pyarrow ships no type stubs; arrays are passed around as Any


def column(table: pa.Table, name: str) -> Array:
    """A table column as one contiguous array (no chunk boundaries)."""
    col = table.column(name)
    if col.num_chunks == 1:
        return col.chunk(0)
    if col.num_chunks == 0:
        return pa.array([], col.type)
    return pa.concat_arrays(col.chunks)


class MetricRows:
    """The rows of one table by metric, after one hashing pass over its ``metric`` column:
    each rule then selects its metric with an integer comparison instead of comparing every
    row's string again (detect evaluates a dozen rules over each group of refined rows)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        enc = pc.dictionary_encode(column(table, "metric"))
        self._codes = enc.indices
        self._index = {v: i for i, v in enumerate(enc.dictionary.to_pylist())}

    def of(self, metrics: list[str]) -> pa.Table:
        """The rows whose metric is one of ``metrics``, in table order."""
        ids = [self._index[m] for m in metrics if m in self._index]
        if not ids:
            return self.table.slice(0, 0)
        if len(ids) == 1:
            mask = pc.equal(self._codes, pa.scalar(ids[0], self._codes.type))
        else:
            mask = pc.is_in(self._codes, value_set=pa.array(ids, self._codes.type))
        return self.table.filter(mask)


def prev(arr: Array) -> Array:
    """``arr`` shifted down by one: ``prev(a)[i] == a[i - 1]``, NULL at 0."""
    n = len(arr)
    if n == 0:
        return arr
    return pa.concat_arrays([pa.nulls(1, arr.type), arr.slice(0, n - 1)])


def nxt(arr: Array) -> Array:
    """``arr`` shifted up by one: ``nxt(a)[i] == a[i + 1]``, NULL at the end."""
    n = len(arr)
    if n == 0:
        return arr
    return pa.concat_arrays([arr.slice(1), pa.nulls(1, arr.type)])


def take(values: Any, indices: Any) -> Any:
    """``pc.take`` for indices this code built itself (codes of a dictionary it encoded, a
    sort or ``index_in`` over the same values, positions it counted): in range by
    construction, so Arrow's pass over them to check the bounds is skipped. NULL indices
    give NULL. Never pass it indices that came from input."""
    return pc.take(values, indices, boundscheck=False)


def repeat_strings(values: list[str], counts: Any) -> Array:
    """A string array of ``values[j]`` repeated ``counts[j]`` times, built from its two
    buffers (each string's bytes repeated, its offsets a cumulative sum): a take over the
    distinct values costs a bounds check and an append per row."""
    raw = [v.encode() for v in values]
    lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    reps = np.asarray(counts, dtype=np.int64)
    if int(lengths @ reps) >= 1 << 31:  # the offsets are int32
        raise ValueError("repeated strings exceed 2 GiB")
    offsets = np.empty(int(reps.sum()) + 1, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(np.repeat(lengths.astype(np.int32), reps), dtype=np.int32, out=offsets[1:])
    data = b"".join([b * int(c) for b, c in zip(raw, reps, strict=True)])
    return pa.StringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(data))


_TRUE = pa.array(np.ones(1 << 16, dtype=bool))


def all_true(n: int) -> Array:
    """A boolean array of ``n`` True values: a slice of one kept array (``pa.repeat`` of a
    scalar took ~25 us a call)."""
    if n <= len(_TRUE):
        return _TRUE.slice(0, n)
    return pa.array(np.ones(n, dtype=bool))


def true_mask(mask: Array) -> Array:
    """A boolean mask with NULL read as False."""
    return pc.fill_null(mask, False)


def where(mask: Array) -> Array:
    """Indices (int64) where ``mask`` is true; NULL counts as false."""
    return pc.indices_nonzero(true_mask(mask)).cast(pa.int64())


def any_true(mask: Array) -> bool:
    return bool(pc.any(true_mask(mask)).as_py()) if len(mask) else False


def merge_keyed(state: pa.Table, update: pa.Table, key: str) -> pa.Table:
    """Rows of ``state`` whose ``key`` is not in ``update``, followed by ``update``.

    This is the upsert used for per-series state tables: O(series) in C per batch.
    """
    if state.num_rows == 0:
        return update
    if update.num_rows == 0:
        return state
    keep = pc.invert(pc.is_in(column(state, key), value_set=column(update, key)))
    return pa.concat_tables([state.filter(keep), update.select(state.column_names)])
