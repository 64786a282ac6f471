"""The throughput benchmark's backlog preload carries the exchanges of its simulated timeline
(run before the benchmark smoke test, on a broker no benchmark has loaded yet)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import Topics, publish
from lab.simulate.truth import load_truth
from pipelines.refine.clock_bounds import exchanges_of, hard_interval
from schemas.codec import content_type_of, decode
from schemas.errors import RejectedInput
from services.settings import KafkaSettings

pytestmark = pytest.mark.kafka


def test_backlog_preload_carries_the_exchanges_of_its_timeline(
    kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str, tmp_path: Path
) -> None:
    """The throughput benchmark's preload (speed 0, CreateTime stamped with the simulated
    arrival): every batch carries exchanges on its own record's partition, and the bound they
    give holds its node's true clock offset, clock steps and late batches included."""
    create_time = {"message.timestamp.type": "CreateTime", "max.message.bytes": "16777216"}
    topics = Topics(
        raw=unique_topic("raw", partitions=3, config=create_time),
        events=unique_topic("events", partitions=2, config=create_time),
        collectives=unique_topic("coll", partitions=2, config=create_time),
        topology=unique_topic("topology"),
        jobs=unique_topic("jobs"),
    )
    sim = Simulation(
        Cluster.build(6, seed=5),
        "clock,late:rate=0.05,delay=2",
        seed=5,
        start_ns=time.time_ns() - 20 * 1_000_000_000,
        duration_ns=12 * 1_000_000_000,
    )
    truth_path = tmp_path / "truth.parquet"
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    rep = publish(sim, kafka, topics, truth_path, speed=0, progress_cb=None, stamp_due=True)
    assert rep.unacked == 0
    sends = {(s["partition"], s["offset"]): s for s in load_truth(truth_path).sends.to_pylist()
             if s["topic"] == topics.raw}  # fmt: skip
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": unique_group,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})  # fmt: skip
    c.subscribe([topics.raw])
    seen, deadline = 0, time.monotonic() + 60
    batches = late = cleared = 0
    clocks = sim.clocks

    def stepped(i: int, t: int) -> bool:  # node i's clock stepped within 2 s before t
        steps = zip(clocks.step_node, clocks.step_at, strict=True)
        return any(n == i and t - 2 * 10**9 <= at <= t for n, at in steps)

    try:
        while seen < len(sends) and time.monotonic() < deadline:
            for m in c.consume(500, 1.0):
                if m.error() is not None:
                    continue
                seen += 1
                s = sends[(m.partition(), m.offset())]
                assert m.timestamp() == (TIMESTAMP_CREATE_TIME, s["due_true_ns"] // 1_000_000)
                try:
                    env = decode(m.value(), content_type_of(m.headers())).envelope
                except RejectedInput:
                    continue
                if s["kind"] not in ("batch", "late"):
                    continue
                batches += 1
                late += s["kind"] == "late"
                assert env.clock is not None
                i = sim.cluster.node_names.index(s["node"])
                if not env.clock.exchanges:  # its clock stepped: the exchanges before are void
                    assert stepped(i, s["sent_true_ns"]), s
                    cleared += 1
                    continue
                ex = exchanges_of(env.clock.exchanges)
                assert max(ex, key=lambda e: e.sent_ns).partition == m.partition()
                bound = hard_interval(ex, env.sent_ns)
                assert bound is not None
                true_offset = int(sim.clocks.offsets(s["sent_true_ns"])[i])
                assert bound[0] <= true_offset <= bound[1], (s, bound, true_offset)
    finally:
        c.close()
    assert seen == len(sends) and batches > 60 and late > 0 and cleared < batches / 20
    assert len(sim.clocks.step_node) > 0  # the run stepped clocks
