"""Counters → deltas and per-second rates; bitmask/enum readings → names.

:func:`derive_rates` turns cumulative counter readings into ``delta`` (in the catalog unit)
and ``rate`` (per second of *aligned* time), wrap- and reset-aware, with per-series state
held in a :class:`CounterState` (one per source stream ``node|exporter|instance``; its size
grows with the number of series of that source, never with samples).

Rules (``max = 2**width - 1``, ``d = (cur - prev) mod 2**width``):

- first sample of a series: ``delta`` NULL, ``null_reason = first_sample``.
- ``boot_id`` of the series changed since its last sample: ``reset``, ``delta`` NULL.
- ``cur >= prev``: ``delta = cur - prev``.
- ``cur < prev`` on a **wrap** counter: a wrap iff ``d <= max // 2`` (serial-number arithmetic,
  RFC 1982: the forward distance is the plausible one when it is under half the range), then
  ``delta = d``; otherwise a reset.
- ``cur < prev`` on a **saturate** counter: always a reset (they are cleared, never wrap).
- a saturate counter reading exactly ``max``: ``delta`` NULL, ``null_reason = saturated``.
- a reset sets ``reset = True``, ``delta`` NULL, ``null_reason = reset``.
- **out of order**: a sample whose aligned ``ts`` is not after the series' last accepted ``ts``
  (from state or earlier in the batch, equal timestamps included) gets ``late = True``,
  ``delta``/``rate`` NULL, and does not move the state back. Rates are therefore never negative
  and never computed over ``dt <= 0``.
- ``scale`` multiplies the delta (e.g. 4-byte words → bytes); ``value`` is scaled in validate.

Everything is vectorized: one sort of the batch's counter rows by (series, ts), shifted
arrays for "previous", one ``index_in`` into the state table, one upsert of the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import Array, any_true, column, merge_keyed, nxt, prev, true_mask, where
from pipelines.validate import BITMASK, COUNTER, ENUM, lookup
from schemas.catalog import Catalog, Kind, Metric
from schemas.reasons import NullReason

STATE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),  # metric|device
        pa.field("raw", pa.uint64()),  # last accepted raw reading
        pa.field("ts", pa.int64()),  # its aligned ts
        pa.field("boot", pa.string()),  # boot_id it was read under
    ]
)

_NULL_F64 = pa.scalar(None, pa.float64())
_NULL_STR = pa.scalar(None, pa.string())


@dataclass(frozen=True)
class _Layout:
    metric: Array
    device: Array
    cmask: Array
    ci: Array  # positions of counter rows
    keys: Array  # their series keys, unique, = state.table["key"]
    mx: Array
    sat: Array
    scale: Array
    inv: Array  # permutation from [counter rows, other rows] back to row order
    boot: str

    def matches(self, table: pa.Table, cmask: Array, boot_id: str) -> bool:
        return bool(
            boot_id == self.boot
            and column(table, "metric").equals(self.metric)
            and column(table, "device").equals(self.device)
            and cmask.equals(self.cmask)
        )


@dataclass
class CounterState:
    """Last accepted reading per counter series of one source stream."""

    table: pa.Table = field(default_factory=STATE_SCHEMA.empty_table)
    # When the state holds exactly the counter series of the last batch, in its row order,
    # the next batch with the same layout is computed positionally (no sort, no lookup).
    layout: _Layout | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def to_dict(self) -> dict[str, list[Any]]:
        """Plain lists, for a Faust table's JSON serializer."""
        return {name: self.table.column(name).to_pylist() for name in STATE_SCHEMA.names}

    @classmethod
    def from_dict(cls, doc: dict[str, list[Any]]) -> CounterState:
        return cls(pa.table(doc, schema=STATE_SCHEMA))


@dataclass(frozen=True)
class CounterColumns:
    """Per-row results aligned with the input rows (non-counter rows: NULL/False)."""

    delta: Array  # float64, in the catalog unit
    rate: Array  # float64, unit per second
    reset: Array  # bool
    late: Array  # bool: out of order within its series
    null_reason: Array  # string: input null_reason, or first_sample/reset/saturated


def derive_rates(
    table: pa.Table, ts: Array, boot_id: str, state: CounterState
) -> tuple[CounterColumns, CounterState]:
    """Deltas and rates for the counter rows of ``table``.

    ``table`` has the columns of :data:`pipelines.validate.ACCEPTED_SCHEMA` (``metric``,
    ``device``, ``raw``, ``kind``, ``scale``, ``max_raw``, ``saturate``, ``null_reason``);
    ``ts`` is the aligned time of each row. Returns the per-row columns and the new state;
    ``state`` itself is not modified. Never raises on data.
    """
    n = table.num_rows
    null_reason = column(table, "null_reason")
    raw_all = column(table, "raw")
    cmask = pc.and_(
        pc.and_(pc.equal(column(table, "kind"), COUNTER), pc.is_valid(raw_all)),
        pc.is_null(null_reason),  # a sentinel reading is no reading
    )
    if n == 0 or not any_true(cmask):
        false = pa.repeat(pa.scalar(False), n) if n else pa.array([], pa.bool_())
        nulls = pa.nulls(n, pa.float64())
        return CounterColumns(nulls, nulls, false, false, null_reason), state

    lay = state.layout
    if lay is not None and lay.matches(table, cmask, boot_id):
        fast = _positional(table, ts, state, lay, null_reason)
        if fast is not None:
            return fast
    ci = where(cmask)
    key = pc.binary_join_element_wise(
        pc.take(column(table, "metric"), ci), pc.take(column(table, "device"), ci), "|"
    )
    sub = pa.table(
        {
            "pos": ci,
            "key": key,
            "ts": pc.take(ts, ci),
            "raw": pc.take(raw_all, ci),
            "max": pc.take(column(table, "max_raw"), ci),
            "sat": pc.take(column(table, "saturate"), ci),
            "scale": pc.take(column(table, "scale"), ci),
        }
    )
    s = sub.take(pc.sort_indices(sub, sort_keys=[("key", "ascending"), ("ts", "ascending")]))
    k, tt = column(s, "key"), column(s, "ts")
    dup_ts = true_mask(pc.and_(pc.equal(k, prev(k)), pc.equal(tt, prev(tt))))

    st = state.table
    sidx = pc.index_in(k, value_set=column(st, "key"))
    st_raw = pc.take(column(st, "raw"), sidx)
    st_ts = pc.take(column(st, "ts"), sidx)
    same_boot = true_mask(pc.equal(pc.take(column(st, "boot"), sidx), boot_id))
    late = pc.or_(dup_ts, pc.and_(same_boot, true_mask(pc.less_equal(tt, st_ts))))

    if any_true(late):
        good = pc.invert(late)
        late_pos = column(s.filter(late), "pos")
        s = s.filter(good)
        st_raw, st_ts, same_boot = st_raw.filter(good), st_ts.filter(good), same_boot.filter(good)
    else:
        late_pos = pa.array([], pa.int64())

    ku, tu, cur = column(s, "key"), column(s, "ts"), column(s, "raw")
    gstart = pc.invert(true_mask(pc.equal(ku, prev(ku))))
    prev_raw = pc.if_else(gstart, st_raw, prev(cur))
    prev_ts = pc.if_else(gstart, st_ts, prev(tu))
    boot_change = pc.and_(gstart, pc.invert(same_boot))
    delta, rate, reset, reason = _deltas(
        cur, prev_raw, tu, prev_ts, column(s, "max"), column(s, "sat"), column(s, "scale"),
        boot_change,
    )  # fmt: skip

    is_last = pc.invert(true_mask(pc.equal(ku, nxt(ku))))
    upd = pa.table(
        {
            "key": ku.filter(is_last),
            "raw": cur.filter(is_last),
            "ts": tu.filter(is_last),
            "boot": pa.repeat(pa.scalar(boot_id), pc.sum(is_last).as_py() or 0),
        },
        schema=STATE_SCHEMA,
    )
    new_state = CounterState(merge_keyed(st, upd, "key"))
    if (
        not len(late_pos)
        and new_state.table.num_rows == len(ci)
        and not any_true(pc.equal(ku, prev(ku)))
    ):  # the state is exactly this batch's series: keep it in row order for the fast path
        other = where(pc.invert(cmask))
        new_state = CounterState(
            pa.table(
                {
                    "key": key,
                    "raw": column(sub, "raw"),
                    "ts": column(sub, "ts"),
                    "boot": pa.repeat(pa.scalar(boot_id), len(ci)),
                },
                schema=STATE_SCHEMA,
            ),
            _Layout(
                column(table, "metric"), column(table, "device"), cmask, ci, key,
                column(sub, "max"), column(sub, "sat"), column(sub, "scale"),
                pc.sort_indices(pa.concat_arrays([ci, other])), boot_id,
            ),
        )  # fmt: skip

    # scatter back to input order: computed rows, late rows, then non-counter rows
    other_pos = where(pc.invert(cmask))
    nl, no = len(late_pos), len(other_pos)
    all_pos = pa.concat_arrays([column(s, "pos"), late_pos, other_pos])
    inv = pc.sort_indices(all_pos)

    def back(computed: Array, late_fill: Any, other: Any, typ: pa.DataType) -> Array:
        parts = [computed.cast(typ)]
        if nl:
            parts.append(pa.repeat(pa.scalar(late_fill, typ), nl))
        if no:
            parts.append(
                other if isinstance(other, pa.Array) else pa.repeat(pa.scalar(other, typ), no)
            )
        return pc.take(pa.concat_arrays(parts), inv)

    base_reason = pc.take(null_reason, pa.concat_arrays([column(s, "pos"), late_pos]))
    merged_reason = pc.coalesce(
        base_reason, pa.concat_arrays([reason.cast(pa.string()), pa.nulls(nl, pa.string())])
    )
    reasons = pc.take(pa.concat_arrays([merged_reason, pc.take(null_reason, other_pos)]), inv)
    cols = CounterColumns(
        delta=back(delta, None, None, pa.float64()),
        rate=back(rate, None, None, pa.float64()),
        reset=back(reset, False, False, pa.bool_()),
        late=back(pa.repeat(pa.scalar(False), len(s)), True, False, pa.bool_()),
        null_reason=reasons,
    )
    return cols, new_state


def _deltas(
    cur: Array,
    prev_raw: Array,
    tu: Array,
    prev_ts: Array,
    mx: Array,
    sat: Array,
    scale: Array,
    boot_change: Array,
) -> tuple[Array, Array, Array, Array]:
    """The module rules over aligned arrays: ``(delta, rate, reset, null_reason)``."""
    has_prev = pc.is_valid(prev_raw)
    d = pc.bit_wise_and(pc.subtract(cur, prev_raw), mx)  # uint64 arithmetic wraps mod 2**64
    decreased = true_mask(pc.less(cur, prev_raw))
    wrap_ok = pc.and_(
        pc.invert(sat), true_mask(pc.less_equal(d, pc.shift_right(mx, pa.scalar(1, pa.uint64()))))
    )
    reset = pc.and_(has_prev, pc.or_(boot_change, pc.and_(decreased, pc.invert(wrap_ok))))
    saturated = pc.and_(sat, pc.equal(cur, mx))
    no_delta = pc.or_(pc.or_(reset, pc.invert(has_prev)), saturated)
    delta = pc.if_else(
        no_delta, _NULL_F64, pc.multiply(pc.cast(d, pa.float64(), safe=False), scale)
    )
    rate = pc.divide(delta, pc.divide(pc.cast(pc.subtract(tu, prev_ts), pa.float64()), 1e9))
    reason = pc.if_else(
        reset,
        NullReason.RESET.value,
        pc.if_else(
            saturated,
            NullReason.SATURATED.value,
            pc.if_else(has_prev, _NULL_STR, NullReason.FIRST_SAMPLE.value),
        ),
    )
    return delta, rate, reset, reason


def _positional(
    table: pa.Table, ts: Array, state: CounterState, lay: _Layout, null_reason: Array
) -> tuple[CounterColumns, CounterState] | None:
    """Fast path: same series in the same order as the state; None if any sample is late."""
    raw_all = column(table, "raw")
    cur = pc.take(raw_all, lay.ci)
    tu = pc.take(ts, lay.ci)
    st = state.table
    prev_ts = column(st, "ts")
    if any_true(pc.less_equal(tu, prev_ts)):
        return None
    no_boot_change = pa.repeat(pa.scalar(False), len(lay.ci))
    delta, rate, reset, reason = _deltas(
        cur, column(st, "raw"), tu, prev_ts, lay.mx, lay.sat, lay.scale, no_boot_change
    )
    m, n = len(lay.ci), table.num_rows
    fill = n - m

    def back(arr: Array, typ: pa.DataType, other: Any) -> Array:
        if not fill:
            return pc.take(arr, lay.inv)
        return pc.take(pa.concat_arrays([arr.cast(typ), pa.repeat(pa.scalar(other, typ), fill)]),
                       lay.inv)  # fmt: skip

    cols = CounterColumns(
        delta=back(delta, pa.float64(), None),
        rate=back(rate, pa.float64(), None),
        reset=back(reset, pa.bool_(), False),
        late=pa.repeat(pa.scalar(False), n),
        null_reason=pc.coalesce(null_reason, back(reason, pa.string(), None)),
    )
    new = pa.table({"key": lay.keys, "raw": cur, "ts": tu, "boot": column(st, "boot")},
                   schema=STATE_SCHEMA)  # fmt: skip
    return cols, CounterState(new, lay)


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
        out = None if m is None else _decode_one(m, int(num))
        if len(self._memo) < self._max:
            self._memo[key] = out
        return out


def _decode_one(m: Metric, v: int) -> str:
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
