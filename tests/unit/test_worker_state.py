"""The worker's state blobs: a stream's state round-trips, and a blob written before the
counter state kept source times still loads (its aligned times stand in); a node's
overlap state round-trips per source, and one written with a src column per point loads."""

from __future__ import annotations

import pyarrow as pa

from pipelines.counters import STATE_SCHEMA, CounterState
from pipelines.dedupe import POINTS_SCHEMA, OverlapState, SeqWindow
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


def test_a_blob_without_source_times_still_loads() -> None:
    old = _counters().table.drop_columns(["src"])
    blob = StreamState(boot_id="b", counters=CounterState(old)).encode()
    back = StreamState.decode(blob)
    assert back.counters.table.schema.equals(STATE_SCHEMA)
    assert back.counters.table.column("src").to_pylist() == [100]


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
