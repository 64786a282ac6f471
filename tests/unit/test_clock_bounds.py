"""The bound from producer exchanges holds by construction: any delays, steps, drift up to
±200 ppm, millisecond append times (property tests of pipelines.refine.clock_bounds and of the
estimator bounded by them)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.clock import ClockEstimator
from pipelines.refine.clock_bounds import (
    STEP_TOL_NS,
    Exchange,
    ExchangeLog,
    exchanges_of,
    hard_interval,
)
from schemas.wire import ClockBlock

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000
MS = 1_000_000


@dataclass
class World:
    """True time ``t``; the broker's clock is true time (its append time truncated to the
    ms); the source's wall clock is ``t + off0 + drift x (t - T0) + steps``, its monotonic
    clock the same oscillator without the steps."""

    off0: int
    ppm: float
    steps: list[tuple[int, int]]  # (true time, size)

    def wall(self, t: int) -> int:
        return t + self.offset(t)

    def offset(self, t: int) -> int:
        return (
            self.off0
            + round(self.ppm * 1e-6 * (t - T0))
            + sum(z for at, z in self.steps if t >= at)
        )

    def mono(self, t: int) -> int:
        return t + round(self.ppm * 1e-6 * (t - T0))


delays = st.one_of(
    st.integers(0, 2 * MS),  # an idle loopback
    st.integers(0, 30 * S),  # a loaded broker, a failover: anything
    st.floats(0, 8).map(lambda x: int(10**x)),  # ns .. 100 ms, log-uniform
)


@st.composite
def runs(draw: st.DrawFn) -> tuple[World, list[tuple[int, int, int, int]]]:
    """A source and its sends: (true send, delay to append, delay to ack report, rows back)."""
    off0 = draw(st.integers(-3600 * S, 3600 * S))
    ppm = draw(st.floats(-200, 200))
    n = draw(st.integers(2, 40))
    gaps = draw(st.lists(st.integers(1, 5 * S), min_size=n, max_size=n))
    sends, t = [], T0
    for g in gaps:
        t += g
        sends.append((t, draw(delays), draw(delays), draw(st.integers(0, 3 * S))))
    step_list = draw(
        st.lists(
            st.tuples(st.integers(T0, t), st.integers(-30 * S, 30 * S).filter(bool)),
            max_size=3,
        )
    )
    return World(off0, ppm, step_list), sends


def _exchange(w: World, t: int, d_app: int, d_ack: int, part: int = 0) -> tuple[Exchange, int, int]:
    app, ack = t + d_app, t + d_app + d_ack
    return Exchange(w.wall(t), app // MS, w.wall(ack), part), w.mono(t), w.mono(ack)


@settings(max_examples=300, deadline=None)
@given(runs())
def test_true_offset_inside_the_hard_interval(
    run: tuple[World, list[tuple[int, int, int, int]]],
) -> None:
    w, sends = run
    log = ExchangeLog()
    pending: list[tuple[int, tuple[Exchange, int, int]]] = []
    prev = T0
    for t, d_app, d_ack, back in sends:
        # acks that arrived before this send join the log first
        for done in [p for p in pending if p[0] <= t]:
            log.add(*done[1])
            pending.remove(done)
        log.check(w.wall(t), w.mono(t))
        carried = log.for_batch("s")
        # every row stamped up to ``back`` before the send, on the source's clock then
        for t_row in (t - back, max(prev, t - back // 2), t):
            if t_row < prev and any(t_row < at <= t for at, _ in w.steps):
                continue  # stamped before the batch before, across a step: no batch's row
            hard = hard_interval(carried, w.wall(t_row))
            if hard is not None:
                lo, hi, _ = hard
                assert lo <= w.offset(t_row) <= hi
        ex = _exchange(w, t, d_app, d_ack)
        pending.append((t + d_app + d_ack, ex))
        prev = t


@settings(max_examples=200, deadline=None)
@given(runs())
def test_aligned_rows_inside_their_stated_bound(
    run: tuple[World, list[tuple[int, int, int, int]]],
) -> None:
    """The estimator with exchanges: every aligned row is within its own error_at of the
    truth, whatever the one-way delays the minimum-delay model sees."""
    w, sends = run
    log, est = ExchangeLog(), ClockEstimator()
    pending: list[tuple[int, tuple[Exchange, int, int]]] = []
    for t, d_app, d_ack, back in sends:
        for done in [p for p in pending if p[0] <= t]:
            log.add(*done[1])
            pending.remove(done)
        log.check(w.wall(t), w.mono(t))
        carried = log.carried()
        block = ClockBlock(source="none", exchanges=[tuple(e.as_list()) for e in carried])
        e = est.observe(w.wall(t), (t + d_app) // MS * MS, block)
        pending.append((t + d_app + d_ack, _exchange(w, t, d_app, d_ack)))
        if e.basis != "exchange":
            assert not carried
            continue
        for t_row in (t - back, t - back // 2, t):
            if any(t_row < at <= t for at, _ in w.steps):
                continue
            ts_source = w.wall(t_row)
            aligned = ts_source - e.offset_at(ts_source)
            assert abs(aligned - t_row) <= e.error_at(ts_source)


def test_intervals_intersect_over_time_and_a_round_trip_sets_the_width() -> None:
    w = World(5 * MS, 150.0, [])
    log = ExchangeLog()
    for i in range(10):
        t = T0 + i * S
        assert log.add(*_exchange(w, t, 300_000, 200_000))
    carried = log.carried()
    assert len(carried) == 4
    lo, hi, used = hard_interval(carried, w.wall(T0 + 10 * S)) or (0, 0, 0)
    assert used == 4
    assert lo <= w.offset(T0 + 10 * S) <= hi
    # 0.5 ms round trip + 1 ms of append resolution + drift (1 s, both sides) and step tolerance
    assert hi - lo <= 1_500_000 + 2 * STEP_TOL_NS + 2 * 201 * 1_000


def test_a_step_seen_by_the_exporter_carries_the_older_exchanges_onto_the_new_setting() -> None:
    """The clock steps +2 s and no exchange can be had after it (a broker failover): the
    exchanges of before, moved by the step the exporter measured against its monotonic
    clock, still bound the new offset tightly; one straddling the step is left out."""
    w = World(0, 0.0, [(T0 + 5 * S + 1, 2 * S)])
    log = ExchangeLog()
    for i in range(5):
        log.add(*_exchange(w, T0 + i * S, 100_000, 100_000))
    assert not log.add(*_exchange(w, T0 + 5 * S - 50_000, 100_000, 100_000))  # straddles
    log.check(w.wall(T0 + 6 * S), w.mono(T0 + 6 * S))
    lo, hi, used = hard_interval(log.carried(), w.wall(T0 + 6 * S)) or (0, 0, 0)
    assert used == 4 and lo <= 2 * S <= hi and hi - lo < 3 * MS
    # a batch stamped before the step (its setting given) gets them as taken
    lo, hi, _ = hard_interval(log.carried(skew=0), w.wall(T0 + 5 * S)) or (0, 0, 0)
    assert lo <= 0 <= hi and hi - lo < 3 * MS
    log.add(*_exchange(w, T0 + 6 * S, 100_000, 100_000))
    lo, hi, _ = hard_interval(log.carried(), w.wall(T0 + 7 * S)) or (0, 0, 0)
    assert lo <= 2 * S <= hi and hi - lo < 3 * MS


@pytest.mark.parametrize("step", [2 * S, -7 * S])
def test_the_first_batch_after_a_step_is_bounded_over_both_settings(step: int) -> None:
    """Rows of the first batch of a source after a step were stamped on either setting: its
    exchanges cover both (every row inside, the bound as wide as the step); the source's
    next batch, stamped after the step, is tight again. Another source's first batch after
    the step is widened too."""
    w = World(0, 0.0, [(T0 + 5 * S + 1, step)])
    log = ExchangeLog()
    for i in range(5):
        log.add(*_exchange(w, T0 + i * S, 100_000, 100_000))
        log.check(w.wall(T0 + i * S), w.mono(T0 + i * S))
        for src in ("a", "b"):
            log.for_batch(src)
    t = T0 + 6 * S
    log.check(w.wall(t), w.mono(t))
    first = log.for_batch("a")
    for t_row in (T0 + 5 * S - 10 * MS, T0 + 5 * S + 10 * MS):  # before and after the step
        lo, hi, _ = hard_interval(first, w.wall(t_row)) or (0, 0, 0)
        assert lo <= w.offset(t_row) <= hi
    assert hi - lo >= abs(step)
    lo, hi, _ = hard_interval(log.for_batch("a"), w.wall(t)) or (0, 0, 0)
    assert lo <= step <= hi and hi - lo < 3 * MS
    lo, hi, _ = hard_interval(log.for_batch("b"), w.wall(t)) or (0, 0, 0)
    assert lo <= 0 and step <= hi


def test_intervals_that_disagree_keep_the_newest() -> None:
    old = Exchange(T0, T0 // MS + 10_000, T0 + MS, 0)  # offset -10 s then
    new = Exchange(T0 + S, (T0 + S) // MS, T0 + S + MS, 0)  # offset ~0 now
    lo, hi, used = hard_interval([old, new], T0 + S) or (0, 0, 0)
    assert used == 1 and lo <= 0 <= hi


def test_exchanges_of_leaves_out_an_ack_before_its_send() -> None:
    assert exchanges_of([(10, 0, 5, 0), (10, 0, 20, 1)]) == [Exchange(10, 0, 20, 1)]


def test_a_createtime_record_adds_no_point() -> None:
    est = ClockEstimator()
    e = est.observe(T0, None, None)
    assert e.basis == "create_time" and e.points == 0
    assert est.points == type(est.points)()


def _refine(rows_ts: list[int], seq: int, sent: int, append_ns: int, clock: ClockBlock | None,
            state: object, log_append: bool = True) -> list[dict[str, object]]:  # fmt: skip
    import pyarrow as pa

    from lab.bench.synthetic_source import bench_catalog, bench_topology
    from pipelines.refine.batch import RawBatch, RefineState, refine_group
    from pipelines.refine.enrich import TopologyIndex
    from schemas.wire import SAMPLES_SCHEMA, Batch, Envelope, SourceId

    assert isinstance(state, RefineState)
    rows = [{"ts_ns": t, "metric": "gpu.sm_clock", "device": "gpu0", "value": 1.0} for t in rows_ts]
    cols = {f.name: [r.get(f.name) for r in rows] for f in SAMPLES_SCHEMA}
    src = SourceId(node="n1", exporter="node", instance="0", boot_id="b0")
    b = Batch(
        envelope=Envelope(source=src, seq=seq, sent_ns=sent, clock=clock),
        table=pa.table(cols, schema=SAMPLES_SCHEMA),
    )
    item = RawBatch(b, (0, seq), append_ns, log_append)
    topo = TopologyIndex(*bench_topology("n1"))
    (res,) = refine_group([item], state, bench_catalog(), topo, append_ns)
    out: list[dict[str, object]] = res.refined.to_pylist()
    return out


def test_refined_rows_say_what_their_bound_rests_on_and_grow_off_the_anchor() -> None:
    from pipelines.refine.batch import RefineState

    state = RefineState()
    off = 7 * MS  # the source is 7 ms ahead of the broker; 0.3 ms round trips
    rows = _refine([T0 - S + off, T0 + off], 1, T0 + off, T0 + 400_000, None, state)
    assert {r["clock_basis"] for r in rows} == {"assumed"}
    exs = [Exchange(T0 - k * S + off, (T0 - k * S + 100_000) // MS, T0 - k * S + 300_000 + off)
           for k in (3, 2, 1)]  # fmt: skip
    block = ClockBlock(source="none", exchanges=[tuple(e.as_list()) for e in exs])
    t1 = T0 + S
    rows = _refine([t1 - S + off, t1 + off], 2, t1 + off, t1 + 400_000, block, state)
    assert {r["clock_basis"] for r in rows} == {"exchange"}
    older, newer = rows
    assert older["clock_error_ns"] > newer["clock_error_ns"]  # 1 s further from the anchor
    for r, true_ts in zip(rows, (t1 - S, t1), strict=True):
        assert isinstance(r["ts"], int) and isinstance(r["clock_error_ns"], int)
        assert abs(r["ts"] - true_ts) <= r["clock_error_ns"] < 2 * MS
    # a CreateTime stamp: no point for the model; the exchanges still bound the rows
    points = len(state.clocks["n1|node|0"].points)
    rows = _refine([t1 + off], 3, t1 + off, t1 + 10 * S, block, state, log_append=False)
    assert rows[0]["clock_basis"] == "exchange"
    assert len(state.clocks["n1|node|0"].points) == points
    rows = _refine([t1 + off], 4, t1 + off, t1 + 10 * S, None, state, log_append=False)
    assert rows[0]["clock_basis"] == "create_time"
    assert len(state.clocks["n1|node|0"].points) == points


def test_exchanges_of_another_partition_leader_are_not_intersected() -> None:
    """Each partition's leader has its own clock: leader 1 runs 5 ms ahead of leader 0."""
    w = World(0, 0.0, [])
    log = ExchangeLog()
    for i in range(4):
        t = T0 + i * S
        ex, ms, ma = _exchange(w, t, 200_000, 200_000, part=i % 2)
        if ex.partition == 1:
            ex = Exchange(ex.sent_ns, ex.append_ms + 5, ex.ack_ns, 1)  # a leader 5 ms ahead
        log.add(ex, ms, ma)
    carried = log.carried()
    assert {e.partition for e in carried} == {1}  # the newest exchange's partition
    lo, hi, used = hard_interval([*carried, *log.carried(partition=0)], w.wall(T0 + 4 * S)) or (
        0, 0, 0,
    )  # fmt: skip
    assert used == len(carried) and lo <= -5 * MS <= hi
