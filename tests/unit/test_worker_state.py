"""The worker's state blobs: a stream's state round-trips, its seq window packed, its clock
window packed or (past int64) in JSON, and blobs written before the counter state kept source
times or before the seq window or the clock points were packed still load; a node's overlap
state round-trips per source, a source's series list stored once while it sends the same
series, and blobs of the two earlier overlap layouts still load."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipelines.clock import ClockEstimator
from pipelines.counters import STATE_SCHEMA, CounterState
from pipelines.dedupe import POINTS_SCHEMA, OverlapState, SeqWindow, drop_overlaps
from schemas.codec import ipc_stream_parts
from services.worker.state import (
    StreamState,
    _frame,
    decode_overlap,
    encode_overlap,
    node_of_key,
)


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
    table = encode_overlap("n1", st)
    assert list(table)[-1] == "n1"  # the node's blob after the series lists it names
    assert {node_of_key(k) for k in table} == {"n1"}
    back = decode_overlap(table["n1"], table.get)
    assert list(back.sources) == list(st.sources)
    for src, t in st.sources.items():
        assert back.sources[src].equals(t)


def test_a_source_sending_the_same_series_stores_only_its_timestamps() -> None:
    a = [("gpu.temp", f"gpu{i}", 10) for i in range(8)]
    b = [("nic.rx", f"mlx5_{i}", 10) for i in range(4)]
    st = OverlapState()
    for src, rows in (("n1|dcgm|0|b", a), ("n1|nic|0|b", b)):
        _, st = drop_overlaps(*_columns(rows), src, st)
    table = encode_overlap("n1", st)
    assert len(table) == 3  # two series lists and the blob
    # the next batch of one source: the same series at a later time
    later = [(m, d, 20) for m, d, _ in a]
    _, st = drop_overlaps(*_columns(later), "n1|dcgm|0|b", st)
    again = encode_overlap("n1", st)
    assert list(again) == ["n1"]  # no series list written again
    assert len(again["n1"]) < len(table["n1"]) + 100
    table.update(again)
    back = decode_overlap(table["n1"], table.get)
    assert back.sources["n1|dcgm|0|b"].column("ts").to_pylist() == [20] * 8
    assert back.sources["n1|nic|0|b"].equals(st.sources["n1|nic|0|b"])
    # a source whose series change gets a new list; the restored state knows its lists
    changed = [*later[:4], ("gpu.power", "gpu0", 30)]
    _, back = drop_overlaps(*_columns(changed), "n1|dcgm|0|b", back)
    third = encode_overlap("n1", back)
    (new_key,) = [k for k in third if k != "n1"]
    assert new_key not in table and node_of_key(new_key) == "n1"


def test_an_overlap_blob_naming_a_series_list_not_stored_is_refused() -> None:
    st = OverlapState({"a": _points(("m", "d", 1))})
    table = encode_overlap("n1", st)
    with pytest.raises(ValueError, match="not stored"):
        decode_overlap(table["n1"], lambda _: None)


def test_overlap_blob_with_each_source_as_an_arrow_table_still_loads() -> None:
    st = OverlapState({"a": _points(("m", "d", 1)), "b": _points(("m", "d", 2), ("m", "e", 3))})
    # the previous layout: each source's points as one Arrow IPC stream
    old = _frame({"sources": ["a", "b"]}, [ipc_stream_parts(t) for t in st.sources.values()])
    back = decode_overlap(old, lambda _: None)
    assert back.sources["a"].equals(st.sources["a"])
    assert back.sources["b"].equals(st.sources["b"])


def test_overlap_blob_with_a_src_column_per_point_still_loads() -> None:
    st = OverlapState({"a": _points(("m", "d", 1)), "b": _points(("m", "d", 2), ("m", "e", 3))})
    # the earlier layout: one table, src on every row
    old = _frame({}, [ipc_stream_parts(st.table)])
    back = decode_overlap(old, lambda _: None)
    assert sorted(back.sources) == ["a", "b"]
    assert back.sources["b"].equals(st.sources["b"])


def _columns(rows: list[tuple[str, str, int]]) -> tuple[pa.Array, pa.Array, pa.Array]:
    t = _points(*rows)
    return (
        t.column("metric").combine_chunks(),
        t.column("device").combine_chunks(),
        t.column("ts").combine_chunks(),
    )
