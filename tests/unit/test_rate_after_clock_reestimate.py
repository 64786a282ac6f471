"""A counter rate must not spike when the clock estimate of a source moves between two of its
batches (found by ``refinery bench --only alert_accuracy``, issue #6).

When the offset estimate grows by more than a sample interval between batches (0.17 s here;
seen on an unsynced, drifting node), the new batch's first *aligned* ts falls before the last
accepted one. Rates over aligned time then either dropped that sample as late and gave the next
one two intervals' delta over a few ms (6-22x the true rate: ``ib.port_xmit_wait`` crossing
1e6/s opened false congestion episodes), or squeezed the interval. The source's own clock
stamped both readings, so the interval is taken on it; across a step backwards of the source
clock the delta holds and the rate is NULL.
"""

from __future__ import annotations

import pyarrow as pa

from pipelines.refine.counters import CounterColumns, CounterState, derive_rates
from pipelines.refine.validate import validate_samples
from schemas.wire import SAMPLES_SCHEMA
from tests.unit.test_counters import CAT, NOW

MS = 1_000_000


def run(
    raws: list[int], source: list[int], aligned: list[int], state: CounterState
) -> tuple[CounterColumns, CounterState]:
    t = pa.table(
        {
            "ts_ns": pa.array(source, pa.int64()),
            "metric": ["c.w32"] * len(raws),
            "device": ["mlx5_0/1"] * len(raws),
            "value": pa.nulls(len(raws), pa.float64()),
            "raw": pa.array(raws, pa.uint64()),
            "text": pa.nulls(len(raws), pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    acc = validate_samples(t, CAT, NOW).accepted
    return derive_rates(acc, pa.array(aligned, pa.int64()), "b", state)


def test_rate_stays_true_when_the_offset_estimate_moves_between_batches() -> None:
    # 100 counts per 100 ms: 1000/s. Batch 1: source 0.0-0.9 s, aligned the same.
    src1 = [NOW + i * 100 * MS for i in range(10)]
    _, state = run([i * 100 for i in range(10)], src1, src1, CounterState())
    # Batch 2: the source's next readings (1.0-1.9 s of its clock), aligned with an offset
    # estimate 170 ms larger: 0.83-1.73 s.
    src2 = [NOW + 1000 * MS + i * 100 * MS for i in range(10)]
    al2 = [t - 170 * MS for t in src2]
    cols, state = run([1000 + i * 100 for i in range(10)], src2, al2, state)
    assert cols.late.to_pylist() == [False] * 10  # in order on the source's clock
    assert cols.rate.to_pylist() == [1000.0] * 10
    assert state.table.column("ts").to_pylist() == [al2[-1]]
    assert state.table.column("src").to_pylist() == [src2[-1]]


def test_a_source_clock_stepped_back_keeps_the_delta_and_states_no_rate_across_the_step() -> None:
    src1 = [NOW + i * 100 * MS for i in range(10)]
    _, state = run([i * 100 for i in range(10)], src1, src1, CounterState())
    # the source clock is stepped back an hour; the estimate already follows it
    src2 = [t - 3600 * 1000 * MS + 1000 * MS for t in src1]
    al2 = [t + 1000 * MS for t in src1]
    cols, _ = run([1000 + i * 100 for i in range(10)], src2, al2, state)
    assert cols.late.to_pylist() == [False] * 10
    assert cols.delta.to_pylist() == [100.0] * 10  # nothing lost across the step
    # neither clock gives the interval across the step (pipelines/refine/counters.py):
    # no rate there;
    # on the source's clock again after it
    assert cols.rate.to_pylist() == [None] + [1000.0] * 9


def test_a_reading_behind_on_both_clocks_is_late() -> None:
    src1 = [NOW + i * 100 * MS for i in range(10)]
    _, state = run([i * 100 for i in range(10)], src1, src1, CounterState())
    cols, _ = run([450], [NOW + 450 * MS], [NOW + 450 * MS], state)
    assert cols.late.to_pylist() == [True]
    assert cols.rate.to_pylist() == [None]
