"""The refiner decodes an ingest topic's records of a group together and refines each
source's as one unit: every record's outcome, accounting, dead letters and refined rows
(with their own raw position) are those of refining the records one at a time."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.ingest import IngestDecoder
from schemas.topics import TOPICS
from services.kafka.outputs import OutMessage
from services.worker.refiner import Outcome, RawRecord, Refiner
from services.worker.state import decode_overlap

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _refiner() -> Refiner:
    topo = TopologyIndex([], [])
    dec = IngestDecoder({"lp": "influx", "cd": "collectd_counters"})
    return Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None, lambda _: None,
                   ingest=dec)  # fmt: skip


def _line(k: int) -> bytes:
    host, cpu, t = f"h{k % 3}", (k // 3) % 2, T0 + (k // 6) * S
    return f"cpu,cpu=cpu{cpu},host={host} time_user={100 + k}.5,time_system={k}.25 {t}".encode()


def _value_list(k: int) -> bytes:
    vl = {"values": [10**6 + k * 4096, 10**6 + k * 2048], "dstypes": ["derive", "derive"],
          "dsnames": ["rx", "tx"], "time": (T0 + (k // 3) * S) / S, "interval": 1.0,
          "host": f"h{k % 3}", "plugin": "interface", "plugin_instance": "eth0",
          "type": "if_octets", "type_instance": ""}  # fmt: skip
    return json.dumps([vl]).encode()


def _records(topic: str, bodies: list[bytes]) -> list[RawRecord]:
    return [RawRecord(topic, 1, 50 + k, None, b, [], (T0 + k * S // 10) // 10**6 + 3000)
            for k, b in enumerate(bodies)]  # fmt: skip


def _refined(outs: list[Outcome]) -> pa.Table:
    tables = []
    for o in outs:
        for m in o.messages:
            if m.topic == TOPICS.refined:
                tables.append(pa.ipc.open_stream(m.value).read_all())
    keys = [("raw_offset", "ascending"), ("metric", "ascending"), ("device", "ascending")]
    return pa.concat_tables(tables).sort_by(keys)


def _of(outs: list[Outcome], topic: str) -> list[OutMessage]:
    return [m for o in outs for m in o.messages if m.topic == topic]


@pytest.mark.parametrize("topic", ["lp", "cd"])
def test_a_group_refines_as_its_records_one_at_a_time(topic: str) -> None:
    make = _line if topic == "lp" else _value_list
    bodies = [make(k) for k in range(36)]
    bodies[10] = b"cpu,host=h1 not line protocol" if topic == "lp" else b"[{broken"
    recs = _records(topic, bodies)
    now = T0 + 60 * S
    together = _refiner().process_group(recs, now)
    alone_r = _refiner()
    alone = [alone_r.process_group([r], now)[0] for r in recs]
    assert [o.outcome for o in together] == [o.outcome for o in alone]
    assert together[10].outcome == "deadletter" and together[10].reasons == {"undecodable": 1}
    for a, b in zip(together, alone, strict=True):
        assert (a.input_samples, a.refined, a.duplicate, a.quarantined, a.stream) == (
            b.input_samples, b.refined, b.duplicate, b.quarantined, b.stream)  # fmt: skip
        assert a.clock_offset_ns == b.clock_offset_ns and a.freshness_ns == b.freshness_ns
    rows, rows_alone = _refined(together), _refined(alone)
    assert rows.num_rows == sum(o.refined for o in alone) > 0
    assert rows.equals(rows_alone)
    # lineage: every row names its own record, the poison one none
    assert set(rows["raw_offset"].to_pylist()) == {50 + k for k in range(36) if k != 10}
    assert set(rows["raw_topic"].to_pylist()) == {topic}
    assert rows["delta"].drop_null().to_pylist()  # counters continue across the records
    acc = [json.loads(m.value) for m in _of(together, TOPICS.accounting)]
    assert [a["raw_offset"] for a in acc] == [50 + k for k in range(36)]
    dl = [json.loads(m.value) for m in _of(together, TOPICS.deadletter)]
    assert [(d["offset"], d["reason"]) for d in dl] == [(60, "undecodable")]
    # each node's rows of the group go out together, the lineage header naming each record
    assert len(_of(together, TOPICS.refined)) < len(_of(alone, TOPICS.refined))


def test_a_replayed_record_of_a_joined_set_is_skipped_alone() -> None:
    recs = _records("lp", [_line(k) for k in range(12)])
    r = _refiner()
    now = T0 + 60 * S
    first = r.process_group(recs[:6], now)
    again = r.process_group(recs, now)  # a crash before the checkpoint: the first six replay
    assert [o.outcome for o in first] == ["refined"] * 6
    assert [o.outcome for o in again] == ["replay"] * 6 + ["refined"] * 6
    alone_r = _refiner()
    alone = [alone_r.process_group([x], now)[0] for x in recs]
    assert _refined(again).equals(_refined(alone[6:]))


def test_a_late_record_in_a_joined_set_is_late_against_its_predecessors() -> None:
    bodies = [f"cpu,cpu=cpu0,host=h0 time_user={100 + k}.5 {T0 + k * 100 * S}".encode()
              for k in range(3)]  # fmt: skip
    bodies.append(f"cpu,cpu=cpu1,host=h0 time_user=1.5 {T0}".encode())  # 200 s behind
    recs = _records("lp", bodies)
    now = T0 + 400 * S
    together = _refined(_refiner().process_group(recs, now))
    alone_r = _refiner()
    alone = _refined([alone_r.process_group([x], now)[0] for x in recs])
    assert together.equals(alone)
    assert together.filter(pa.compute.equal(together["raw_offset"], 53))["late"].to_pylist() == [
        True
    ]


def test_groups_of_two_topics_on_shared_nodes_refine_as_their_records_one_at_a_time() -> None:
    """Line protocol and collectd from the same hosts (two sources a node), interleaved and
    cut into groups that split each source's records: every group's units (joined sets and
    records alone) give each record what refining it alone gives, across the groups."""
    lines = _records("lp", [_line(k) for k in range(30)])
    lists = [RawRecord("cd", 1, 500 + k, None, _value_list(k), [], r.append_ms)
             for k, r in enumerate(_records("cd", [b""] * 30))]  # fmt: skip
    recs = [r for pair in zip(lines, lists, strict=True) for r in pair]
    now = T0 + 60 * S
    r = _refiner()
    together = [o for lo in range(0, len(recs), 7) for o in r.process_group(recs[lo : lo + 7], now)]
    alone_r = _refiner()
    alone = [alone_r.process_group([x], now)[0] for x in recs]
    for a, b in zip(together, alone, strict=True):
        assert (a.outcome, a.input_samples, a.refined, a.duplicate, a.quarantined) == (
            b.outcome, b.input_samples, b.refined, b.duplicate, b.quarantined)  # fmt: skip
        assert a.clock_offset_ns == b.clock_offset_ns
    rows = _refined(together)
    assert rows.num_rows == sum(o.refined for o in alone) > 0
    assert rows.equals(_refined(alone))
    assert set(rows["raw_topic"].to_pylist()) == {"lp", "cd"}
    # each node's overlap state as checkpointed: both sources, each with the points of its
    # last record at least (of its last unit: docs/ingest.md)
    nodes, nodes_alone = r.dirty_blobs()[1], alone_r.dirty_blobs()[1]
    assert sorted(nodes) == sorted(nodes_alone) == ["h0", "h1", "h2"]
    for node, blob in nodes.items():
        ov, ov_alone = decode_overlap(blob), decode_overlap(nodes_alone[node])
        assert sorted(ov.sources) == sorted(ov_alone.sources) and len(ov.sources) == 2
        for src, t in ov.sources.items():
            points = set(zip(*t.to_pydict().values(), strict=True))
            assert set(zip(*ov_alone.sources[src].to_pydict().values(), strict=True)) <= points
