"""The worker's state blobs: a stream's state round-trips, its seq window packed, its clock
window packed or (past int64) in JSON, and blobs written before the counter state kept source
times or before the seq window or the clock points were packed still load; a node's overlap
state round-trips per source, and one written with a src column per point loads."""

from __future__ import annotations

import pyarrow as pa

from pipelines.refine.clock import ClockEstimator
from pipelines.refine.counters import STATE_SCHEMA, CounterState
from pipelines.refine.dedupe import POINTS_SCHEMA, OverlapState, SeqWindow
from schemas.codec import ipc_stream_parts
from services.worker.state import StreamState, _frame, decode_overlap, encode_overlap


def _counters() -> CounterState:
    return CounterState(
        pa.table(
            {"key": ["m|d"], "raw": pa.array([5], pa.uint64()), "ts": [100], "boot": ["b"],
             "src": [90]},
            schema=STATE_SCHEMA,
        )
    )  # fmt: skip


def test_stream_state_round_trips() -> None:
    seqs = SeqWindow(window=8)
    seqs.observe(3, (1, 42))
    st = StreamState(boot_id="b", seqs=seqs, counters=_counters(), watermark=7)
    back = StreamState.decode(st.encode())
    assert back.counters.table.equals(st.counters.table)
    assert back.seqs is not None and back.seqs.positions == {3: (1, 42)}
    assert (back.boot_id, back.watermark) == ("b", 7)


def test_a_full_seq_window_round_trips_packed() -> None:
    seqs = SeqWindow(window=512)
    for i in range(700):  # past the window: the oldest leave
        seqs.observe(2**40 + i, (i % 12, 2**50 + 3 * i))
    blob = StreamState(boot_id="b", seqs=seqs, counters=_counters()).encode()
    meta_len = int.from_bytes(blob[4:8], "little")
    assert b'"packed":%d' % len(seqs.positions) in blob[8 : 8 + meta_len]
    back = StreamState.decode(blob).seqs
    assert back is not None
    assert (back.positions, back.hwm, back.window) == (seqs.positions, seqs.hwm, seqs.window)
    assert list(back.positions) == list(seqs.positions)  # in the order it was kept


def test_a_blob_with_its_seq_window_as_an_arrow_table_still_loads() -> None:
    table = pa.table(
        {"seq": pa.array([7, 9], pa.int64()), "partition": pa.array([2, 3], pa.int32()),
         "offset": pa.array([40, 41], pa.int64())}
    )  # fmt: skip
    meta = {"boot_id": "b", "seqs": {"window": 8, "hwm": 9}, "clock": None, "watermark": None,
            "clock_flagged": False}  # fmt: skip
    blob = _frame(meta, [ipc_stream_parts(_counters().table), ipc_stream_parts(table)])
    back = StreamState.decode(blob).seqs
    assert back is not None and back.positions == {7: (2, 40), 9: (3, 41)}
    assert (back.window, back.hwm) == (8, 9)


def test_a_blob_without_source_times_still_loads() -> None:
    old = _counters().table.drop_columns(["src"])
    blob = StreamState(boot_id="b", counters=CounterState(old)).encode()
    back = StreamState.decode(blob)
    assert back.counters.table.schema.equals(STATE_SCHEMA)
    assert back.counters.table.column("src").to_pylist() == [100]


def _clock(x0: int, n: int) -> ClockEstimator:
    est = ClockEstimator()
    for i in range(n):  # 10 ms apart, 1-3 ms of delay, one slow batch in seven
        x = x0 + i * 10_000_000
        est.observe(x, x + 1_000_000 + (i * 7919) % 2_000_000 + (50_000_000 if i % 7 == 0 else 0))
    return est


def _same_clock(a: ClockEstimator | None, b: ClockEstimator) -> None:
    assert a is not None
    assert (list(a.points), a.candidates, a.since_step) == (
        list(b.points), b.candidates, b.since_step
    )  # fmt: skip
    x = b.points[-1][0] + 10_000_000
    assert a.observe(x, x + 1_500_000) == b.observe(x, x + 1_500_000)  # the same from here


def test_clock_window_round_trips_packed() -> None:
    est = _clock(1_800_000_000 * 10**9, 300)
    assert len(est.points) == est.settings.window
    blob = StreamState(boot_id="b", clock=est, counters=_counters()).encode()
    meta_len = int.from_bytes(blob[4:8], "little")
    assert b'"points":%d' % len(est.points) in blob[8 : 8 + meta_len]  # a count, not a list
    _same_clock(StreamState.decode(blob).clock, est)


def test_clock_points_past_int64_stay_in_json() -> None:
    est = _clock(2**63 - 10**9, 120)  # a clock running past 2262: Python ints, as sent
    assert max(x for x, _ in est.points) >= 2**63
    blob = StreamState(boot_id="b", clock=est, counters=_counters()).encode()
    _same_clock(StreamState.decode(blob).clock, est)


def test_a_blob_with_its_clock_points_in_json_still_loads() -> None:
    est = _clock(1_800_000_000 * 10**9, 40)
    meta = {"boot_id": "b", "seqs": None, "clock": est.to_dict(), "watermark": None,
            "clock_flagged": False}  # fmt: skip
    blob = _frame(meta, [ipc_stream_parts(_counters().table), []])
    _same_clock(StreamState.decode(blob).clock, est)


def _points(*rows: tuple[str, str, int]) -> pa.Table:
    return pa.table(
        {"metric": [r[0] for r in rows], "device": [r[1] for r in rows],
         "ts": [r[2] for r in rows]},
        schema=POINTS_SCHEMA,
    )  # fmt: skip


def test_overlap_state_round_trips_per_source() -> None:
    st = OverlapState(
        {
            "n1|dcgm|0|b": _points(("gpu.temp", "gpu0", 10), ("gpu.temp", "gpu0", 20)),
            "n1|nvml|0|b": _points(("gpu.temp", "gpu1", 10)),
            "n1|idle|0|b": POINTS_SCHEMA.empty_table(),
        }
    )
    back = decode_overlap(encode_overlap(st))
    assert list(back.sources) == list(st.sources)
    for src, t in st.sources.items():
        assert back.sources[src].equals(t)


def test_overlap_blob_with_a_src_column_per_point_still_loads() -> None:
    st = OverlapState({"a": _points(("m", "d", 1)), "b": _points(("m", "d", 2), ("m", "e", 3))})
    # the earlier layout: one table, src on every row
    old = _frame({}, [ipc_stream_parts(st.table)])
    back = decode_overlap(old)
    assert sorted(back.sources) == ["a", "b"]
    assert back.sources["b"].equals(st.sources["b"])
