"""The bound from producer exchanges holds by construction: any delays, steps and slews of
the time daemon at any rate (chrony's 83,333 ppm and beyond), two steps between two sends, an
oscillator drifting up to ±500 ppm, a machine paused (its clocks standing still), millisecond
append times (property tests of pipelines.refine.clock_bounds and of the estimator bounded by
them). They run unseeded: a failure is a defect of the product, never of the seed."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ms). The source's raw monotonic clock is its oscillator, ``t + off0 + drift x (t - T0)``
    less the time it stood still in pauses; its wall clock is the raw one plus what its time
    daemon did: every step and every slew (a rate over a span) so far."""

    off0: int
    ppm: float
    steps: list[tuple[int, int]]  # (true time, size)
    slews: list[tuple[int, int, float]] = field(default_factory=list)  # (start, end, ppm)
    pauses: list[tuple[int, int]] = field(default_factory=list)  # (start, length)

    def raw(self, t: int) -> int:
        # the time stood still before t: the pauses' union (two that overlap stop the clock
        # once; counted twice, the raw clock would run backwards, which no clock does)
        lost, end = 0, None
        for at, n in sorted(self.pauses):
            a, b = max(at, end) if end is not None else at, min(at + n, t)
            if b > a:
                lost += b - a
            end = max(end, at + n) if end is not None else at + n
        return t + self.off0 + round(self.ppm * 1e-6 * (t - T0)) - lost

    def adj(self, t: int) -> int:
        stepped = sum(z for at, z in self.steps if t >= at)
        slewed = sum(round(r * 1e-6 * min(max(t - a, 0), b - a)) for a, b, r in self.slews)
        return stepped + slewed

    def wall(self, t: int) -> int:
        return self.raw(t) + self.adj(t)

    def offset(self, t: int) -> int:
        return self.wall(t) - t

    def mono(self, t: int) -> int:
        return self.raw(t)

    def paused(self, t: int) -> bool:
        return any(at <= t < at + n for at, n in self.pauses)


delays = st.one_of(
    st.integers(0, 2 * MS),  # an idle loopback
    st.integers(0, 30 * S),  # a loaded broker, a failover: anything
    st.floats(0, 8).map(lambda x: int(10**x)),  # ns .. 100 ms, log-uniform
)
# a daemon's slew: ntpd's 500 ppm, chrony's maxslewrate 83,333 ppm, and more
slew_rates = st.one_of(
    st.floats(-500, 500), st.floats(-83_333, 83_333), st.floats(-200_000, 200_000)
)


@st.composite
def runs(draw: st.DrawFn, pauses: bool = False) -> tuple[World, list[tuple[int, int, int, int]]]:
    """A source and its sends: (true send, delay to append, delay to ack report, rows back)."""
    off0 = draw(st.integers(-3600 * S, 3600 * S))
    ppm = draw(st.floats(-500, 500))
    n = draw(st.integers(2, 40))
    gaps = draw(st.lists(st.integers(1, 5 * S), min_size=n, max_size=n))
    sends, t = [], T0
    for g in gaps:
        t += g
        sends.append((t, draw(delays), draw(delays), draw(st.integers(0, 3 * S))))
    span = st.integers(T0, t)
    sizes = st.one_of(
        st.integers(-30 * S, 30 * S), st.integers(-2 * STEP_TOL_NS, 2 * STEP_TOL_NS)
    ).filter(bool)
    step_list = draw(st.lists(st.tuples(span, sizes), max_size=4))
    slews = [
        (a, a + d, r)
        for a, d, r in draw(
            st.lists(st.tuples(span, st.integers(1, 60 * S), slew_rates), max_size=3)
        )
    ]
    stops = draw(st.lists(st.tuples(span, st.integers(1, 5 * S)), max_size=2)) if pauses else []
    return World(off0, ppm, step_list, slews, stops), sends


def _exchange(w: World, t: int, d_app: int, d_ack: int, part: int = 0) -> tuple[Exchange, int, int]:
    app, ack = t + d_app, t + d_app + d_ack
    return Exchange(w.wall(t), app // MS, w.wall(ack), part), w.mono(t), w.mono(ack)


def _stamps(prev: int, t: int, back: int) -> list[int]:
    """When a batch sent at ``t`` stamped its rows: after its batch before (``prev``)."""
    return sorted({max(prev, t - back), max(prev, t - back // 2), t})


@settings(max_examples=600, deadline=None)
@given(runs())
def test_true_offset_inside_the_hard_interval(
    run: tuple[World, list[tuple[int, int, int, int]]],
) -> None:
    """Every row of a batch, stamped on whatever setting the daemon had put the wall clock
    (two steps between two sends, a slew while the rows were gathered), lies inside the hard
    interval its batch's exchanges give at its own stamp."""
    w, sends = run
    log = ExchangeLog()
    pending: list[tuple[int, tuple[Exchange, int, int]]] = []
    prev = T0
    for t, d_app, d_ack, back in sends:
        rows = _stamps(prev, t, back)
        for t_row in rows:  # the exporter reads its clocks at each stamp
            for done in [p for p in pending if p[0] <= t_row]:
                log.add(*done[1])
                pending.remove(done)
            log.check(w.wall(t_row), w.mono(t_row))
        carried = log.for_batch("s")
        for t_row in rows:
            hard = hard_interval(carried, w.wall(t_row))
            if hard is not None:
                lo, hi, _ = hard
                assert lo <= w.offset(t_row) <= hi
        pending.append((t + d_app + d_ack, _exchange(w, t, d_app, d_ack)))
        prev = t


@settings(max_examples=400, deadline=None)
@given(runs(pauses=True))
def test_aligned_rows_inside_their_stated_bound(
    run: tuple[World, list[tuple[int, int, int, int]]],
) -> None:
    """The estimator with exchanges and its own record's append time: every aligned row is
    within its own error_at of the truth, whatever the one-way delays the minimum-delay model
    sees, and when the machine stood still since the exchanges (a paused VM)."""
    w, sends = run
    log, est = ExchangeLog(), ClockEstimator()
    pending: list[tuple[int, tuple[Exchange, int, int]]] = []
    prev = T0
    for t, d_app, d_ack, back in sends:
        if w.paused(t):
            continue  # a paused machine sends nothing
        rows = [r for r in _stamps(prev, t, back) if not w.paused(r)]
        for t_row in rows:
            for done in [p for p in pending if p[0] <= t_row]:
                log.add(*done[1])
                pending.remove(done)
            log.check(w.wall(t_row), w.mono(t_row))
        carried = log.for_batch("s")
        block = ClockBlock(
            source="none",
            exchanges=[tuple(e.as_list()) for e in carried],
            stamps_ns=log.last_stamps if carried else None,
        )
        e = est.observe(w.wall(t), (t + d_app) // MS * MS, block, 0)
        pending.append((t + d_app + d_ack, _exchange(w, t, d_app, d_ack)))
        prev = t
        if e.basis != "exchange":
            assert not carried
            continue
        for t_row in rows:
            ts_source = w.wall(t_row)
            aligned = ts_source - e.offset_at(ts_source)
            assert abs(aligned - t_row) <= e.error_at(ts_source)


def test_two_steps_between_two_sends_netting_under_the_tolerance_leave_every_row_inside() -> None:
    """+1,588,381 ns and -1,538,389 ns between two sends net 49,992 ns: a row stamped on the
    setting between them is read on it, and its batch covers it."""
    w = World(0, 0.0, [(T0 + 1_300 * MS, 1_588_381), (T0 + 1_600 * MS, -1_538_389)])
    log = ExchangeLog()
    log.add(*_exchange(w, T0, 100_000, 100_000))
    for t_row in (T0 + S, T0 + 1_400 * MS, T0 + 2 * S):
        log.check(w.wall(t_row), w.mono(t_row))
    carried = log.for_batch("s")
    assert log.last_stamps[1] >= 1_588_381 - 50_000
    lo, hi, _ = hard_interval(carried, w.wall(T0 + 1_400 * MS)) or (0, 0, 0)
    assert lo <= w.offset(T0 + 1_400 * MS) <= hi


def test_a_chrony_slew_at_its_maxslewrate_is_carried_exactly() -> None:
    """chrony slews 0.5 s away at 83,333 ppm for 6 s, and no exchange can be had meanwhile:
    the exchanges of before, carried by the setting the exporter reads, stay tight."""
    w = World(0, 20.0, [], [(T0 + 5 * S, T0 + 11 * S, -83_333.0)])
    log = ExchangeLog()
    for i in range(5):
        log.add(*_exchange(w, T0 + i * S, 100_000, 100_000))
    t = T0 + 8 * S
    log.check(w.wall(t), w.mono(t))
    lo, hi, _ = hard_interval(log.for_batch("s"), w.wall(t)) or (0, 0, 0)
    assert lo <= w.offset(t) <= hi
    assert w.offset(t) < -200 * MS and hi - lo < 8 * MS


def test_intervals_intersect_over_time_and_a_round_trip_sets_the_width() -> None:
    w = World(5 * MS, 150.0, [])
    log = ExchangeLog()
    for i in range(10):
        t = T0 + i * S
        assert log.add(*_exchange(w, t, 300_000, 200_000))
    carried = log.carried()
    # the newest three; the tightest from below and from above are among them (equal round
    # trips: the newest is widened least)
    assert len(carried) == 3
    lo, hi, used = hard_interval(carried, w.wall(T0 + 10 * S)) or (0, 0, 0)
    assert used == 3
    assert lo <= w.offset(T0 + 10 * S) <= hi
    # 0.5 ms round trip + 1 ms of append resolution + drift (1 s, both sides) and step tolerance
    assert hi - lo <= 1_500_000 + 2 * STEP_TOL_NS + 2 * 501 * 1_000


def test_a_step_seen_by_the_exporter_carries_the_older_exchanges_onto_the_new_setting() -> None:
    """The clock steps +2 s and no exchange can be had after it (a broker failover): the
    exchanges of before, moved by the step the exporter measured against its monotonic
    clock, still bound the new offset tightly; one straddling the step too."""
    w = World(0, 0.0, [(T0 + 5 * S + 1, 2 * S)])
    log = ExchangeLog()
    for i in range(5):
        log.add(*_exchange(w, T0 + i * S, 100_000, 100_000))
    assert log.add(*_exchange(w, T0 + 5 * S - 50_000, 100_000, 100_000))  # straddles
    log.check(w.wall(T0 + 6 * S), w.mono(T0 + 6 * S))
    carried = log.carried()
    lo, hi, used = hard_interval(carried, w.wall(T0 + 6 * S)) or (0, 0, 0)
    assert used == len(carried) >= 3 and lo <= 2 * S <= hi and hi - lo < 3 * MS
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
    assert lo <= step <= hi and hi - lo < 4 * MS  # 2 s of 500 ppm drift: 2 ms
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
    # the bound grows off the newest exchange's ack (the rows were stamped after it), not off
    # the send: the older row is 1 s nearer the exchanges
    assert older["clock_error_ns"] < newer["clock_error_ns"]
    for r, true_ts in zip(rows, (t1 - S, t1), strict=True):
        assert isinstance(r["ts"], int) and isinstance(r["clock_error_ns"], int)
        assert abs(r["ts"] - true_ts) <= r["clock_error_ns"] < 3 * MS
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


def test_a_record_appended_late_widens_the_bound_down_to_its_own_floor() -> None:
    """The exchanges say the offset is ~7 ms; the batch's own record was appended 40 ms after
    its send stamp, which a machine paused for 40 ms since the exchanges (its clocks standing
    still) would also give: the bound reaches down to the record's own floor, the point stays
    where the exchanges put it."""
    off = 7 * MS
    exs = [Exchange(T0 - k * S + off, (T0 - k * S + 100_000) // MS, T0 - k * S + 300_000 + off, 0)
           for k in (3, 2, 1)]  # fmt: skip
    block = ClockBlock(source="none", exchanges=[tuple(e.as_list()) for e in exs])
    prompt = ClockEstimator().observe(T0 + off, T0 + 400_000, block, 0)
    late = ClockEstimator().observe(T0 + off, T0 + 40 * MS, block, 0)
    assert prompt.error_ns < 2 * MS
    assert abs(late.offset_ns - prompt.offset_ns) <= 1
    assert late.offset_ns - late.error_ns <= off - 40 * MS + MS
    # a paused machine: 40 ms behind since the exchanges; its row is inside
    assert abs((off - 40 * MS + MS) - late.offset_ns) <= late.error_ns
    # another partition's append time says nothing of this leader's clock
    other = ClockEstimator().observe(T0 + off, T0 + 40 * MS, block, 1)
    assert other.error_ns < 2 * MS


def test_an_exchange_acknowledged_after_the_rows_were_stamped_is_not_carried() -> None:
    """Rows stamped, then the machine paused for 2 s (its clocks standing still), then an
    exchange acknowledged after it, then the send: that exchange tells the offset after the
    pause, 2 s below the rows'. Only exchanges acknowledged before the first stamp are
    carried, and the rows are inside the bound their batch gets."""
    w = World(0, 0.0, [], pauses=[(T0 + 5 * S, 2 * S)])
    log = ExchangeLog()
    log.add(*_exchange(w, T0 + 3 * S, 100_000, 100_000))
    log.check(w.wall(T0 + 3 * S + MS), w.mono(T0 + 3 * S + MS))
    log.for_batch("s")  # the batch before
    t_row = T0 + 4 * S  # stamped before the pause
    log.check(w.wall(t_row), w.mono(t_row))
    log.add(*_exchange(w, T0 + 7 * S + 100 * MS, 100_000, 100_000))  # after the pause
    t = T0 + 7 * S + 500 * MS
    log.check(w.wall(t), w.mono(t))
    carried = log.for_batch("s")
    assert [e.sent_ns for e in carried] == [w.wall(T0 + 3 * S)]
    lo, hi, _ = hard_interval(carried, w.wall(t_row)) or (0, 0, 0)
    assert lo <= w.offset(t_row) <= hi
    # the exchange acknowledged after the pause would have put the rows 2 s off
    late = log.carried()
    lo, hi, _ = hard_interval(late, w.wall(t_row)) or (0, 0, 0)
    assert not lo <= w.offset(t_row) <= hi
