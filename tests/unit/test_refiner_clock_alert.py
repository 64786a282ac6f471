"""The worker's clock alert: its id comes from the data (the broker time of the record that
flipped it), so a replay or a restart from the checkpointed state names the same alert."""

from __future__ import annotations

import json

import pyarrow as pa

from pipelines.refine.enrich import TopologyIndex
from schemas.codec import ARROW, encode
from schemas.topics import TOPICS
from services.worker.refiner import RawRecord, Refiner
from services.worker.state import StreamState
from tests.unit.test_refine import CAT, NOW, TOPO, S, batch, ctr


def _records(offset_ns: int, n: int) -> list[RawRecord]:
    out = []
    for i in range(n):
        t = NOW + i * S
        b = batch([ctr(100 + i, t + offset_ns)], i + 1, sent=t + offset_ns + 2_000_000)
        ct, body = encode(b.envelope, b.table, ARROW)
        out.append(RawRecord("raw", 0, i, b"n1", body, [("content-type", ct.encode())],
                             (t + 3_000_000) // 1_000_000))  # fmt: skip
    return out


def _alerts(refiner: Refiner, recs: list[RawRecord], now: int) -> list[dict[str, object]]:
    out = []
    for o in refiner.process_group(recs, now):
        out += [json.loads(m.value) for m in o.messages if m.topic == "telemetry.alerts"]
    return out


def _refiner(blobs: dict[str, bytes] | None = None) -> Refiner:
    topo: TopologyIndex = TOPO
    store = blobs or {}
    return Refiner(CAT, TOPICS, lambda: topo, store.get, lambda _: None)


def test_clock_alert_id_is_the_same_on_a_replay_and_after_a_restart() -> None:
    recs = _records(5 * S, 4)  # a source 5 s ahead
    first = _alerts(_refiner(), recs, NOW + 10 * S)
    again = _alerts(_refiner(), recs, NOW + 99 * S)  # replayed later: same id
    assert [a["state"] for a in first] == ["firing"]
    assert [a["id"] for a in again] == [first[0]["id"]]

    live = _refiner()
    _alerts(live, recs, NOW)
    streams, _ = live.dirty_blobs()
    (blob,) = streams.values()
    state = StreamState.decode(blob)
    assert state.clock_flagged and state.clock_onset == first[0]["starts_ns"]


def test_a_batch_without_rows_is_refined_and_its_exchange_bounds_the_next() -> None:
    """An exporter's greeting (``BatchProducer.greet``): a batch with no rows is no error
    (nothing dead-lettered, its seq taken), and the next batch, carrying its exchange,
    is aligned on that exchange, not on an assumed delay."""
    from schemas.wire import SAMPLES_SCHEMA, ClockBlock

    def record(offset: int, b: object, append_ms: int) -> RawRecord:
        ct, body = encode(b.envelope, b.table, ARROW)  # type: ignore[attr-defined]
        return RawRecord("raw", 0, offset, b"n1", body, [("content-type", ct.encode())],
                         append_ms)  # fmt: skip

    ahead = 5 * S  # the source's clock is 5 s ahead of the broker's
    hello = batch([], 0, sent=NOW + ahead)
    assert hello.table.schema.equals(SAMPLES_SCHEMA) and hello.table.num_rows == 0
    append_ms = (NOW + 4_000_000) // 1_000_000  # appended 4 ms after it was sent
    ex = (NOW + ahead, append_ms, NOW + ahead + 9_000_000, 0)  # acknowledged 9 ms after
    data = batch([ctr(100, NOW + S + ahead)], 1, sent=NOW + S + ahead,
                 clock=ClockBlock(source="none", exchanges=[ex]))  # fmt: skip
    outs = _refiner().process_group(
        [record(0, hello, append_ms), record(1, data, append_ms + 1_000)], NOW + 10 * S
    )
    assert [o.outcome for o in outs] == ["refined", "refined"]
    assert not [m for o in outs for m in o.messages if m.topic == "telemetry.deadletter"]
    rows = [
        r
        for m in outs[1].messages
        if m.topic == "telemetry.refined"
        for r in pa.ipc.open_stream(m.value).read_all().to_pylist()
    ]
    assert len(rows) == 1 and rows[0]["clock_basis"] == "exchange"
    # the true offset (5 s) is inside the exchange's interval, and the row within its bound
    assert abs(rows[0]["ts"] - (NOW + S)) <= rows[0]["clock_error_ns"] <= 10_100_000
