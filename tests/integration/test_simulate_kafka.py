"""Simulator → real broker → plain confluent-kafka consumer, compared with the truth files."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow.compute as pc
import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, Message

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import Topics, bench_publish, publish
from lab.simulate.truth import load_truth
from schemas.codec import content_type_of, decode
from schemas.errors import RejectedInput
from schemas.records import EntityKind
from services.settings import KafkaSettings

pytestmark = pytest.mark.kafka

LOG_APPEND = {"message.timestamp.type": "LogAppendTime", "max.message.bytes": "16777216"}


def consume_all(bootstrap: str, topic: str, expected: int, group: str) -> list[Message]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "fetch.max.bytes": 52_428_800,
        }
    )
    c.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + 60
    idle = 0
    try:
        while time.monotonic() < deadline:
            msgs = c.consume(500, 1.0)
            good = [m for m in msgs if m.error() is None]
            out.extend(good)
            idle = 0 if good else idle + 1
            if len(out) >= expected and idle >= 2:
                break
    finally:
        c.close()
    return out


def test_everything_acknowledged_arrives_and_duplicates_are_as_declared(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    topics = Topics(
        raw=unique_topic("raw", partitions=3, config=LOG_APPEND),
        events=unique_topic("events", partitions=2, config=LOG_APPEND),
        collectives=unique_topic("coll", partitions=2, config=LOG_APPEND),
        topology=unique_topic("topology"),
        jobs=unique_topic("jobs"),
        topology_nodes=unique_topic("topology.nodes"),
    )
    sim = Simulation(
        Cluster.build(6, seed=11),
        "all,dup:rate=0.02,late:rate=0.01,delay=2",
        seed=11,
        duration_ns=12 * 1_000_000_000,
    )
    truth_path = tmp_path / "truth.parquet"
    rep = publish(
        sim,
        KafkaSettings(bootstrap_servers=kafka_bootstrap),
        topics,
        truth_path,
        speed=4.0,
        progress_cb=None,
    )
    assert rep.unacked == 0 and rep.messages_failed == 0
    tr = load_truth(truth_path)
    sends = tr.sends.to_pylist()
    assert len(sends) == rep.messages_acked

    raw_sends = [s for s in sends if s["topic"] == topics.raw]
    got = consume_all(kafka_bootstrap, topics.raw, len(raw_sends), unique_group)
    by_pos = {(s["partition"], s["offset"]): s for s in raw_sends}
    assert {(m.partition(), m.offset()) for m in got} == set(by_pos)  # nothing missing or extra

    copies: Counter[str] = Counter()
    samples = 0
    for m in got:
        s = by_pos[(m.partition(), m.offset())]
        assert m.timestamp()[0] == TIMESTAMP_LOG_APPEND_TIME
        assert m.key() == s["node"].encode()
        try:
            batch = decode(m.value(), content_type_of(m.headers()))
        except RejectedInput as e:
            assert s["kind"] == "malformed" and e.reason.value == s["expected_reason"]
            continue
        assert s["kind"] != "malformed"
        tag = f"{batch.envelope.source.key()}|{batch.envelope.seq}"
        assert tag == s["tag"] and batch.table.num_rows == s["samples"]
        if copies[tag] == 0:
            samples += batch.table.num_rows
        copies[tag] += 1
    declared = Counter(s["tag"] for s in raw_sends if s["kind"] == "duplicate")
    assert declared, "the run must carry duplicates"
    for tag, n in copies.items():
        assert n == 1 + declared.get(tag, 0)
    assert samples == tr.samples.num_rows
    assert {s["expected_reason"] for s in raw_sends if s["kind"] == "malformed"} >= {
        "undecodable",
        "oversized",
        "bad_envelope",
        "unsupported_schema_version",
        "schema_mismatch",
        "unsupported_content_type",
    }

    # the true arrival time and the broker's LogAppendTime agree (speed 4: scaled wall time)
    start = rep.start_ns
    for m in got[:50]:
        s = by_pos[(m.partition(), m.offset())]
        wall_due_ms = (start + (s["due_true_ns"] - start) / 4) / 1e6
        assert abs(m.timestamp()[1] - wall_due_ms) < 1_000

    for topic, stream in ((topics.events, "events"), (topics.collectives, "collectives")):
        want = [s for s in sends if s["stream"] == stream]
        msgs = consume_all(kafka_bootstrap, topic, len(want), unique_group + stream)
        assert len(msgs) == len(want)
    n_events = sum(s["samples"] for s in sends if s["stream"] == "events")
    assert n_events == tr.events.num_rows
    straggled = tr.collectives.filter(pc.greater(tr.collectives.column("straggle_ns"), 0))
    storm_nodes = {r["node"] for r in tr.incidents.to_pylist() if r["kind"] == "pfc_storm"}
    assert straggled.num_rows == 0 or set(straggled.column("node").to_pylist()) <= (
        storm_nodes | {r["node"] for r in tr.incidents.to_pylist() if r["kind"] == "throttle"}
    )
    # the fabric on topology, the netdev facts the node exporters would report on topology.nodes
    ents = sim.cluster.topology()
    netdevs = [e for e in ents if e.kind == EntityKind.NETDEV]
    topo = consume_all(kafka_bootstrap, topics.topology, 1, unique_group + "topo")
    assert len(topo) == len(ents) - len(netdevs)
    nodes = consume_all(kafka_bootstrap, topics.topology_nodes, 1, unique_group + "nodes")
    assert sorted((m.key() or b"").decode() for m in nodes) == sorted(e.id for e in netdevs)
    assert netdevs


def test_bench_publish_reports_samples_per_second(kafka_bootstrap: str) -> None:
    rate = bench_publish(kafka_bootstrap, nodes=64, seconds=5.0)
    print(f"\nbench_publish(64 nodes, 5 s): {rate:,.0f} acknowledged samples/s")
    assert rate > 10_000
