"""Counter deltas and rates: wraps (32/64 bit), resets, saturation, out-of-order samples."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.counters import (
    CounterColumns,
    CounterPart,
    CounterState,
    derive_rates,
    derive_rates_group,
)
from pipelines.refine.decode import StateDecoder
from pipelines.refine.validate import validate_samples
from schemas.catalog import Catalog, Kind, Metric, Origin, Overflow
from schemas.wire import SAMPLES_SCHEMA

NOW = 1_700_000_000_000_000_000
S = 1_000_000_000
ORIGIN = Origin(simulator=True)
CAT = Catalog(
    [
        Metric(name="c.w64", unit="B", kind=Kind.COUNTER, width=64, overflow=Overflow.WRAP,
               scale=4.0, description="64-bit wrapping words", origin=ORIGIN),
        Metric(name="c.w32", unit="1", kind=Kind.COUNTER, width=32, overflow=Overflow.WRAP,
               description="32-bit wrapping count", origin=ORIGIN),
        Metric(name="c.sat32", unit="1", kind=Kind.COUNTER, width=32,
               overflow=Overflow.SATURATE, description="32-bit saturating count", origin=ORIGIN),
        Metric(name="g.reasons", unit="1", kind=Kind.BITMASK, bits={0: "idle", 3: "hw_slowdown"},
               description="clock event reasons", origin=ORIGIN),
        Metric(name="g.state", unit="1", kind=Kind.ENUM, values={0: "ok", 1: "degraded"},
               description="health state", origin=ORIGIN),
    ]
)  # fmt: skip


def run(
    metric: str, raws: list[int | None], ts: list[int], state: CounterState, boot: str = "b"
) -> tuple[CounterColumns, CounterState]:
    t = pa.table(
        {
            "ts_ns": pa.array(ts, pa.int64()),
            "metric": [metric] * len(raws),
            "device": ["mlx5_0/1"] * len(raws),
            "value": pa.nulls(len(raws), pa.float64()),
            "raw": pa.array(raws, pa.uint64()),
            "text": pa.nulls(len(raws), pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    v = validate_samples(t, CAT, NOW)
    assert v.rejected == []
    return derive_rates(v.accepted, pa.array(ts, pa.int64()), boot, state)


def test_first_sample_wrap_and_reset_32bit() -> None:
    m = 2**32 - 1
    cols, st_ = run("c.w32", [m - 10, 5, 3, 100], [NOW + i * S for i in range(4)], CounterState())
    assert cols.delta.to_pylist() == [None, 16.0, None, 97.0]
    assert cols.rate.to_pylist() == [None, 16.0, None, 97.0]
    assert cols.reset.to_pylist() == [False, False, True, False]
    assert cols.null_reason.to_pylist() == ["first_sample", None, "reset", None]
    assert len(st_) == 1


def test_a_counter_row_without_an_aligned_time_is_no_reading() -> None:
    """NULL aligned ts (validated rows never have one): the row gets no delta and leaves the
    state alone; its neighbours are derived as if it were not there."""
    ts = [NOW, NOW + S, NOW + 2 * S]
    t = pa.table(
        {
            "ts_ns": pa.array(ts, pa.int64()),
            "metric": ["c.w32"] * 3,
            "device": ["mlx5_0/1"] * 3,
            "value": pa.nulls(3, pa.float64()),
            "raw": pa.array([10, 20, 40], pa.uint64()),
            "text": pa.nulls(3, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    acc = validate_samples(t, CAT, NOW).accepted
    cols, st_ = derive_rates(acc, pa.array([ts[0], None, ts[2]], pa.int64()), "b", CounterState())
    assert cols.delta.to_pylist() == [None, None, 30.0]
    assert cols.rate.to_pylist() == [None, None, 15.0]
    assert cols.late.to_pylist() == [False, False, False]
    assert cols.null_reason.to_pylist() == ["first_sample", None, None]
    assert st_.table.column("raw").to_pylist() == [40]


def test_scale_applies_to_delta_and_rate_over_aligned_time() -> None:
    cols, _ = run("c.w64", [100, 350], [NOW, NOW + 2 * S], CounterState())
    assert cols.delta.to_pylist() == [None, 1000.0]
    assert cols.rate.to_pylist() == [None, 500.0]


def test_saturating_counter() -> None:
    m = 2**32 - 1
    cols, _ = run("c.sat32", [10, m, m, 4], [NOW + i * S for i in range(4)], CounterState())
    assert cols.null_reason.to_pylist() == ["first_sample", "saturated", "saturated", "reset"]
    assert cols.reset.to_pylist() == [False, False, False, True]
    assert cols.delta.to_pylist() == [None, None, None, None]


def test_boot_change_is_a_reset() -> None:
    _, st_ = run("c.w64", [1000], [NOW], CounterState(), boot="b1")
    cols, _ = run("c.w64", [2000], [NOW + S], st_, boot="b2")
    assert cols.reset.to_pylist() == [True]
    assert cols.null_reason.to_pylist() == ["reset"]


def test_out_of_order_is_late_and_does_not_move_state() -> None:
    _, st_ = run("c.w64", [1000], [NOW + 10 * S], CounterState())
    cols, st2 = run("c.w64", [900, 1100, 1100], [NOW + 5 * S, NOW + 11 * S, NOW + 11 * S], st_)
    assert cols.late.to_pylist() == [True, False, True]
    assert cols.delta.to_pylist() == [None, 400.0, None]
    assert st2.table.column("raw").to_pylist() == [1100]
    # state persisted and restored gives the same answer
    again = CounterState.from_dict(st2.to_dict())
    cols3, _ = run("c.w64", [1200], [NOW + 12 * S], again)
    assert cols3.delta.to_pylist() == [400.0]


def test_bitmask_and_enum_decoded_once_per_value() -> None:
    t = pa.table(
        {
            "ts_ns": [NOW] * 4,
            "metric": ["g.reasons", "g.reasons", "g.state", "g.reasons"],
            "device": ["gpu0"] * 4,
            "value": [9.0, 0.0, 1.0, 9.0 + 64],
        }
    )
    v = validate_samples(t, CAT, NOW)
    dec = StateDecoder(CAT)
    assert dec.decode(v.accepted).to_pylist() == [
        "idle,hw_slowdown", "none", "degraded", "idle,hw_slowdown,bit6"
    ]  # fmt: skip
    assert len(dec._memo) == 4


@st.composite
def counter_runs(draw: st.DrawFn) -> tuple[str, int, list[int], list[bool], list[int], list[int]]:
    """A counter series with increments under half the range, some resets, split into
    batches. Returns metric, width, raws, is_reset, expected raw increments, batch sizes."""
    metric, width = draw(st.sampled_from([("c.w32", 32), ("c.w64", 64)]))
    mod = 1 << width
    half = (mod - 1) // 2
    n = draw(st.integers(2, 40))
    cur = draw(st.integers(0, mod - 1))
    raws, resets, incs = [cur], [False], [0]
    for _ in range(n - 1):
        if cur > 0 and draw(st.integers(0, 9)) == 0:  # a reset: a decrease, not a wrap
            cur = cur - draw(st.integers(1, min(cur, half)))
            raws.append(cur)
            resets.append(True)
            incs.append(0)
        else:
            inc = draw(st.one_of(st.integers(0, 1000), st.integers(0, half)))
            cur = (cur + inc) % mod
            raws.append(cur)
            resets.append(False)
            incs.append(inc)
    sizes = []
    left = n
    while left:
        k = draw(st.integers(1, left))
        sizes.append(k)
        left -= k
    return metric, width, raws, resets, incs, sizes


@settings(max_examples=300, deadline=None)
@given(counter_runs(), st.lists(st.integers(1, 10 * S), min_size=40, max_size=40))
def test_property_rates_across_wraps_and_resets(
    run_: tuple[str, int, list[int], list[bool], list[int], list[int]], gaps: list[int]
) -> None:
    metric, _width, raws, resets, incs, sizes = run_
    scale = CAT[metric].scale
    ts = [NOW]
    for g in gaps[: len(raws) - 1]:
        ts.append(ts[-1] + g)
    state = CounterState()
    deltas: list[float | None] = []
    rates: list[float | None] = []
    flags: list[bool] = []
    i = 0
    for k in sizes:
        cols, state = run(metric, raws[i : i + k], ts[i : i + k], state)
        deltas += cols.delta.to_pylist()
        rates += cols.rate.to_pylist()
        flags += cols.reset.to_pylist()
        assert not pc.any(cols.late).as_py()
        i += k
    assert flags == resets
    for j in range(1, len(raws)):
        if resets[j]:
            assert deltas[j] is None
        else:
            assert deltas[j] == float(incs[j]) * scale
            assert rates[j] is not None and rates[j] >= 0
            assert abs(rates[j] - incs[j] * scale / ((ts[j] - ts[j - 1]) / 1e9)) <= 1e-9 * max(
                1.0, rates[j]
            )
    assert deltas[0] is None and len(state) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2**32 - 1)), min_size=1, max_size=30))
def test_property_shuffled_timestamps_never_give_negative_rates(pts: list[tuple[int, int]]) -> None:
    state = CounterState()
    for t, raw in pts:
        cols, state = run("c.w32", [raw], [NOW + t * S], state)
        r = cols.rate.to_pylist()[0]
        assert r is None or r >= 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(  # rounds; in each, every stream sends one batch
        st.lists(  # streams
            st.tuples(
                st.lists(st.integers(0, 2**32 - 1), min_size=6, max_size=6),
                st.lists(st.integers(-2, 5), min_size=6, max_size=6),  # per-row ts steps
                st.booleans(),  # boot change
                st.integers(0, 6),  # rows kept (series missing from a batch)
            ),
            min_size=3,
            max_size=3,
        ),
        min_size=1,
        max_size=8,
    )
)
def test_property_group_equals_one_stream_at_a_time(
    rounds: list[list[tuple[list[int], list[int], bool, int]]],
) -> None:
    """derive_rates_group over several streams' rows at once gives each stream the columns
    and state that derive_rates gives it alone, through wraps, resets, boot changes, repeated
    and out-of-order timestamps and series that come and go."""
    metrics = ["c.w32", "c.w64", "c.sat32", "c.w32", "c.w32", "g.state"]
    devices = ["mlx5_0/1", "mlx5_0/1", "mlx5_0/1", "mlx5_1/1", "mlx5_1/1", "gpu0"]
    alone = [CounterState() for _ in range(3)]
    grouped = [CounterState() for _ in range(3)]
    t = NOW
    for streams in rounds:
        t += S
        accs, tss, boots = [], [], []
        for raws, steps, boot_change, keep in streams:
            ts = [t + d * S // 2 for d in steps][:keep]
            tbl = pa.table(
                {
                    "ts_ns": pa.array(ts, pa.int64()),
                    "metric": metrics[:keep],
                    "device": devices[:keep],
                    "value": pa.nulls(keep, pa.float64()),
                    "raw": pa.array(raws[:keep], pa.uint64()),
                    "text": pa.nulls(keep, pa.string()),
                },
                schema=SAMPLES_SCHEMA,
            )
            accs.append(validate_samples(tbl, CAT, NOW).accepted)
            tss.append(pa.array(ts, pa.int64()))
            boots.append("b2" if boot_change else "b1")
        want = []
        for j in range(3):
            cols, alone[j] = derive_rates(accs[j], tss[j], boots[j], alone[j])
            want.append(cols)
        parts = [
            CounterPart(a.num_rows, b, g) for a, b, g in zip(accs, boots, grouped, strict=True)
        ]
        got, grouped = derive_rates_group(pa.concat_tables(accs), pa.concat_arrays(tss), parts)
        for name in ("delta", "rate", "reset", "late", "null_reason"):
            expect = [x for c in want for x in getattr(c, name).to_pylist()]
            assert getattr(got, name).to_pylist() == expect, name
        for j in range(3):
            assert grouped[j].table.equals(alone[j].table)


def test_a_rate_across_a_step_back_of_the_source_clock_is_null() -> None:
    """A source stepped back 11 s between two readings 1 s apart: its own clock says -10 s,
    and an aligned clock squeezed by the estimates around the step (here 0.1 s) would make
    the link's 1 kB/s look like 10 kB/s. The delta holds, the rate is NULL; the reading after
    it has its rate on the source's clock again."""

    def batch(raw: int, src: int, aligned: int, state: CounterState) -> tuple[Any, CounterState]:
        t = pa.table(
            {
                "ts_ns": pa.array([src], pa.int64()),
                "metric": ["c.w32"],
                "device": ["mlx5_0/1"],
                "value": pa.nulls(1, pa.float64()),
                "raw": pa.array([raw], pa.uint64()),
                "text": pa.nulls(1, pa.string()),
            },
            schema=SAMPLES_SCHEMA,
        )
        v = validate_samples(t, CAT, NOW)
        cols, state = derive_rates(v.accepted, pa.array([aligned], pa.int64()), "b", state)
        return cols, state

    st_ = CounterState()
    _, st_ = batch(0, NOW, NOW, st_)
    cols, st_ = batch(1000, NOW + S, NOW + S, st_)
    assert cols.rate.to_pylist() == [1000.0]
    cols, st_ = batch(2000, NOW + 2 * S - 11 * S, NOW + S + S // 10, st_)  # the step back
    assert cols.delta.to_pylist() == [1000.0] and cols.rate.to_pylist() == [None]
    assert cols.late.to_pylist() == [False]
    cols, st_ = batch(3000, NOW + 3 * S - 11 * S, NOW + 3 * S, st_)
    assert cols.rate.to_pylist() == [1000.0]
