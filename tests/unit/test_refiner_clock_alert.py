"""The worker's clock alert: its id comes from the data (the broker time of the record that
flipped it), so a replay or a restart from the checkpointed state names the same alert."""

from __future__ import annotations

import json

from pipelines.refine.enrich import TopologyIndex
from schemas.codec import ARROW, encode
from services.worker.refiner import OutputTopics, RawRecord, Refiner
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
    return Refiner(CAT, OutputTopics(), lambda: topo, store.get, lambda _: None)


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
