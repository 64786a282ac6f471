"""The worker's state blobs: a stream's state round-trips, and a blob written before the
counter state kept source times still loads (its aligned times stand in)."""

from __future__ import annotations

import pyarrow as pa

from pipelines.counters import STATE_SCHEMA, CounterState
from pipelines.dedupe import SeqWindow
from services.worker.state import StreamState


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
