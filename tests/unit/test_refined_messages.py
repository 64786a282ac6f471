"""Refined messages: one per node and wave, its rows those of refining each raw record alone,
its lineage header one entry per record; and the row-level replay skip detect applies to
them."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa

from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.codec import ARROW, encode
from schemas.records import compact_json, lineage_header, refined_lineage
from schemas.topics import TOPICS
from schemas.wire import SAMPLES_SCHEMA, Batch, Envelope, SourceId
from services.detect.core import DetectCore
from services.detect.detector import Detector
from services.kafka.outputs import OutMessage
from services.telemetry import ServiceTelemetry
from services.worker.refiner import RawRecord, Refiner

S = 1_000_000_000
NOW = 1_700_000_000 * S
CAT = default_catalog()
TOPO = TopologyIndex([], [])


def _record(node: str, exporter: str, seq: int, offset: int, raw: int) -> RawRecord:
    t = NOW + seq * S
    port = 1 if exporter == "a" else 2  # two sources of a node, not overlapping
    rows = [
        {"ts_ns": t + i, "metric": "rdma.np_cnp_sent", "device": f"mlx5_{i}/{port}", "raw": raw + i}
        for i in range(3)
    ]
    cols = {f.name: [r.get(f.name) for r in rows] for f in SAMPLES_SCHEMA}
    src = SourceId(node=node, exporter=exporter, instance="0", boot_id="b0")
    b = Batch(
        envelope=Envelope(source=src, seq=seq, sent_ns=t + 1_000_000),
        table=pa.table(cols, schema=SAMPLES_SCHEMA),
    )
    ct, body = encode(b.envelope, b.table, ARROW)
    partition = 0 if node == "n1" else 1
    return RawRecord("telemetry.raw", partition, offset, node.encode(), body,
                     [("content-type", ct.encode())], (t + 2_000_000) // 1_000_000)  # fmt: skip


def _refiner() -> Refiner:
    return Refiner(CAT, TOPICS, lambda: TOPO, lambda _: None, lambda _: None)


def _refined(msgs: list[OutMessage]) -> list[OutMessage]:
    return [m for m in msgs if m.topic == "telemetry.refined"]


def _rows(m: OutMessage) -> pa.Table:
    return pa.ipc.open_stream(m.value).read_all()


def test_a_nodes_records_of_a_wave_go_out_as_one_message() -> None:
    # two nodes, two exporters each, interleaved; then n1's first exporter again (a new wave)
    recs = [
        _record("n1", "a", 1, 10, 100),
        _record("n2", "a", 1, 20, 100),
        _record("n1", "b", 1, 11, 500),
        _record("n2", "b", 1, 21, 500),
        _record("n1", "a", 2, 12, 200),
    ]
    outs = _refiner().process_group(recs, NOW + 10 * S)
    per_record = [_refined(o.messages) for o in outs]
    # each node's message is listed with the last of its records in the wave
    assert [len(x) for x in per_record] == [0, 0, 1, 1, 1]
    n1, n2, n1_again = (x[0] for x in per_record[2:])
    assert (n1.key, n2.key, n1_again.key) == (b"n1", b"n2", b"n1")
    lineage = [[(x["exporter"], x["raw_offset"]) for x in refined_lineage(m.headers)]
               for m in (n1, n2, n1_again)]  # fmt: skip
    assert lineage == [[("a", 10), ("b", 11)], [("a", 20), ("b", 21)], [("a", 12)]]
    assert all(x["refined_samples"] == 3 for m in (n1, n2) for x in refined_lineage(m.headers))

    # the rows are those of refining each record alone, in raw order
    alone = _refiner()
    single = [_rows(_refined(alone.process(r, NOW + 10 * S).messages)[0]) for r in recs]
    assert _rows(n1).equals(pa.concat_tables([single[0], single[2]]))
    assert _rows(n2).equals(pa.concat_tables([single[1], single[3]]))
    assert _rows(n1_again).equals(single[4])
    assert _rows(n1_again).column("delta").to_pylist() == [100.0] * 3  # after seq 1's


def test_lineage_header_reads_a_list_and_a_single_object() -> None:
    one = {"raw_partition": 2, "raw_offset": 7}
    assert refined_lineage([("lineage", lineage_header([one, one]))]) == [one, one]
    assert refined_lineage({"lineage": json.dumps(one).encode()}) == [one]
    assert refined_lineage([("content-type", b"x")]) == []
    assert refined_lineage(None) == []


def test_detect_skips_the_replayed_rows_of_a_message_and_keeps_the_rest() -> None:
    core = DetectCore(TOPICS, Detector(CAT), ServiceTelemetry("test"))
    recs = [_record("n1", "a", 1, 10, 100), _record("n1", "b", 1, 11, 500)]
    (first,) = [
        m for o in _refiner().process_group(recs, NOW + 10 * S) for m in _refined(o.messages)
    ]
    # refined again after a crash, from offset 11 on: its first message mixes the replay of
    # offset 11 with the new offset 12
    again = [recs[1], _record("n1", "a", 2, 12, 200), _record("n1", "b", 2, 13, 600)]
    second = [
        m for o in _refiner().process_group(again, NOW + 10 * S) for m in _refined(o.messages)
    ]
    offsets = [sorted(set(_rows(m).column("raw_offset").to_pylist())) for m in second]
    assert offsets == [[11, 12], [13]]

    got = core._refined(0, 0, bytes(first.value))
    assert got is not None and sorted(set(got.column("raw_offset").to_pylist())) == [10, 11]
    assert core._refined(0, 1, bytes(first.value)) is None  # all of it seen already
    got = core._refined(0, 2, bytes(second[0].value))
    assert got is not None and got.column("raw_offset").to_pylist() == [12] * 3
    got = core._refined(0, 3, bytes(second[1].value))
    assert got is not None and got.column("raw_offset").to_pylist() == [13] * 3


def test_compact_json_writes_the_bytes_json_dumps_does() -> None:
    docs = [
        {"boot_id": "b-1", "seqs": {"window": 4096, "hwm": 7}, "clock": None, "x": [1.5, -0.0]},
        [{"raw_partition": 3, "raw_offset": 2**40, "note": "näive ✓ \u2028"}],
        {"nan": float("nan"), "inf": float("inf"), "big": 10**30, "t": True},
    ]
    for doc in docs:
        assert compact_json(doc) == json.dumps(doc, separators=(",", ":")).encode()


def test_refined_rows_name_their_raw_topic_and_detect_skips_replays_per_topic() -> None:
    """An ingest topic's offsets are its own: its record at an offset below telemetry.raw's
    in the same partition is not a replay, in one message with raw's or alone."""
    core = DetectCore(TOPICS, Detector(CAT), ServiceTelemetry("test"))
    ingest = "telemetry.ingest.otlp"
    raw = _record("n1", "a", 1, 50, 100)
    recs = [raw, replace(_record("n1", "b", 1, 10, 500), topic=ingest)]
    (mixed,) = [
        m for o in _refiner().process_group(recs, NOW + 10 * S) for m in _refined(o.messages)
    ]
    rows = _rows(mixed)
    topics, offsets = rows.column("raw_topic").to_pylist(), rows.column("raw_offset").to_pylist()
    got = set(zip(topics, offsets, strict=True))
    assert got == {("telemetry.raw", 50), (ingest, 10)}
    assert [e["raw_topic"] for e in refined_lineage(mixed.headers)] == ["telemetry.raw", ingest]

    kept = core._refined(0, 0, bytes(mixed.value))
    assert kept is not None and kept.num_rows == 6
    assert core._refined(0, 1, bytes(mixed.value)) is None  # a replay of both
    later = replace(_record("n1", "b", 2, 11, 600), topic=ingest)
    (alone,) = [
        m for o in _refiner().process_group([later], NOW + 10 * S) for m in _refined(o.messages)
    ]
    kept = core._refined(0, 2, bytes(alone.value))  # 11 < 50: raw's mark is not the ingest's
    assert kept is not None and kept.column("raw_offset").to_pylist() == [11] * 3
    assert set(kept.column("raw_topic").to_pylist()) == {ingest}


def test_detect_reads_rows_without_raw_topic_as_telemetry_raw() -> None:
    core = DetectCore(TOPICS, Detector(CAT), ServiceTelemetry("test"))
    (m,) = [
        m
        for o in _refiner().process_group([_record("n1", "a", 1, 5, 100)], NOW + 10 * S)
        for m in _refined(o.messages)
    ]
    rows = _rows(m)
    old = rows.drop_columns(["raw_topic"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as w:
        w.write_table(old)
    assert core._refined(0, 0, sink.getvalue().to_pybytes()) is not None
    assert core._refined(0, 1, bytes(m.value)) is None  # the same raw record, naming its topic
