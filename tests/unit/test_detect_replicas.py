"""Detect replicas split the partitions: a job's stragglers are judged by the replica owning
its collectives, against the episodes another replica tracks on the ranks' paths, with what
each replica tells the others (progress records) — and the judgement is the one a single
process owning everything makes."""

from __future__ import annotations

import json

import pyarrow as pa

from schemas.catalog import default_catalog
from schemas.codec import ipc_stream
from schemas.records import Alert
from schemas.topics import TOPICS
from services.detect.core import DetectCore
from services.detect.detector import Detector, Emitted
from services.detect.progress import Marker, PartitionProgress, ProgressView
from services.telemetry import ServiceTelemetry
from tests.unit.derived_helpers import T0, S, batches
from tests.unit.test_detect_time import other_node, storm_rows
from tests.unit.test_stragglers import PLACEMENT, Topo, collectives

REFINED, COLL = TOPICS.refined, TOPICS.collectives_aligned


class Replica:
    """One detect replica: its core, its view and what it has published."""

    def __init__(self, name: str) -> None:
        self.view = ProgressView(name, partitions=2)
        self.detector = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
        self.detector.set_jobs([PLACEMENT])
        self.detector.judge_on(self.view)
        self.core = DetectCore(TOPICS, self.detector, ServiceTelemetry("t"), self.view, "p")
        self.offsets: dict[tuple[str, int], int] = {}
        self.out = Emitted()

    def feed(self, topic: str, partition: int, tables: list[pa.Table], now: int) -> None:
        recs = []
        for t in tables:
            off = self.offsets.get((topic, partition), 0)
            self.offsets[(topic, partition)] = off + 1
            recs.append((topic, partition, off, ipc_stream(t)))
        self.out.extend(self.core.route_group(recs, now))

    def publish(self, now: int) -> Marker:
        """The progress record (applied to its own view), then the watermark's judgement."""
        msg = self.core.progress(lambda p: self.offsets.get((REFINED, p), 0), now)
        assert msg is not None and msg.topic == "p"
        wm = self.core.watermark(lambda p: self.offsets.get((REFINED, p), 0))
        if wm is not None:
            self.out.extend(self.detector.advance(wm, now))
        return Marker.from_json(msg.value)


def stragglers(out: Emitted) -> list[Alert]:
    return [a for a in out.alerts if a.rule == "nccl_straggler"]


def single_process() -> list[Alert]:
    d = Detector(default_catalog(), topology=Topo(), grace_ns=3 * S)
    d.set_jobs([PLACEMENT])
    out = Emitted()
    for t in collectives(range(10)):
        out.extend(d.on_collectives(t, T0))
    for t in other_node(0, 30):
        out.extend(d.on_refined(t, T0))
    for now, t in batches(storm_rows(20)):
        out.extend(d.on_refined(t, now))
        out.extend(d.advance(int(t.column("ts")[0].as_py()), now))
    return stragglers(out)


def test_a_replica_judges_stragglers_on_the_episodes_another_replica_tracks() -> None:
    a, b = Replica("a"), Replica("b")
    a.core.own([(REFINED, 0)])  # the storm's node n2
    b.core.own([(REFINED, 1), (COLL, 0)])  # the clean node n0, and the job's collectives
    b.feed(COLL, 0, collectives(range(10)), T0)
    b.feed(REFINED, 1, other_node(0, 30), T0)
    b.view.apply(b.publish(T0))
    assert stragglers(b.out) == []  # partition 0 not heard of: nothing is judged
    for now, t in batches(storm_rows(20)):
        a.feed(REFINED, 0, [t], now)
        b.view.apply(a.publish(now))  # what a tells through the progress topic
        b.publish(now)
    (got,) = stragglers(b.out)
    assert stragglers(a.out) == []  # a owns no collectives
    (want,) = single_process()
    assert got.cause is not None and got.cause.startswith("PFC storm on leaf-p0-r3 port 2")
    assert (got.id, got.cause, got.starts_ns) == (want.id, want.cause, want.starts_ns)


def test_collectives_are_judged_as_far_as_the_partition_of_their_congestion_covers_them() -> None:
    a, b = Replica("a"), Replica("b")
    a.core.own([(REFINED, 0)])
    b.core.own([(REFINED, 1), (COLL, 0)])
    b.feed(COLL, 0, collectives(range(10)), T0)
    b.feed(REFINED, 1, other_node(0, 30), T0)
    storm = batches(storm_rows(20))
    for now, t in storm[:2]:  # a has read 2 s of the storm only: its partition is behind
        a.feed(REFINED, 0, [t], now)
        m = a.publish(now)
        m.refined[0].behind = True
        b.view.apply(m)
        b.publish(now)
    # the ops of 0-1 s are covered: two straggling collectives, one short of an alert; the
    # later ones wait for the storm's partition
    assert stragglers(b.out) == []
    assert b.core.detector.collectives.holding > 0
    for now, t in storm[2:]:  # caught up: the rest are judged, with their cause
        a.feed(REFINED, 0, [t], now)
        b.view.apply(a.publish(now))
        b.publish(now)
    (got,) = stragglers(b.out)
    (want,) = single_process()
    assert got.cause is not None and got.cause.startswith("PFC storm on leaf-p0-r3 port 2")
    assert (got.id, got.cause, got.starts_ns) == (want.id, want.cause, want.starts_ns)


def test_a_record_about_a_partition_a_replica_owns_is_not_taken_from_others() -> None:
    v = ProgressView("me", partitions=1)
    v.own([0], [])
    v.apply(Marker("me", 1, {0: PartitionProgress(False, 100 * S)}))
    v.apply(Marker("old-owner", 2, {0: PartitionProgress(True, 10 * S)}))
    assert v.watermark() == 100 * S and not v.pending()
    v.own([], [])  # moved away: the new owner's record counts
    v.apply(Marker("new-owner", 3, {0: PartitionProgress(False, 120 * S)}))
    assert v.watermark() == 120 * S


def test_progress_records_round_trip() -> None:
    m = Marker("r", 5, {3: PartitionProgress(True, 7, {"n1": 7})})
    assert Marker.from_json(m.to_json()) == m


def deadletters(partition: int, n: int, t0_s: int) -> list[tuple[str, int, int, bytes]]:
    """``n`` dead-lettered raw records accounted on ``partition``, one every 250 ms."""
    out = []
    for i in range(n):
        doc = {"outcome": "deadletter", "append_ms": (T0 // 1_000_000) + t0_s * 1000 + i * 250,
               "raw_partition": partition, "raw_offset": i, "node": f"n{partition}"}  # fmt: skip
        out.append((TOPICS.accounting, partition, i, json.dumps(doc).encode()))
    return out


def test_the_dead_letter_rate_is_the_clusters_judged_by_the_owner_of_partition_0() -> None:
    a, b = Replica("a"), Replica("b")
    a.core.own([(TOPICS.accounting, 0)])
    b.core.own([(TOPICS.accounting, 1)])
    # 4/s on each partition over a minute: 8/s in all, above the rule's 5/s; neither alone is
    a.core.route_group(deadletters(0, 240, 0), T0)
    b.core.route_group(deadletters(1, 240, 0), T0)
    for r, other in ((a, b), (b, a)):
        other.view.apply(r.publish(T0 + 60 * S))
    a.publish(T0 + 60 * S)
    b.publish(T0 + 60 * S)
    fired = {
        name: [x for x in r.detector.engine.tick(T0 + 60 * S) if x.rule == "deadletter_rate"]
        for name, r in (("a", a), ("b", b))
    }
    assert [x.state.value for x in fired["a"]] == ["firing"] and fired["b"] == []
    assert fired["a"][0].evidence["rate_per_s"] > 5


def test_one_partitions_dead_letters_alone_stay_below_the_rate() -> None:
    a = Replica("a")
    a.core.own([(TOPICS.accounting, 0)])
    a.core.route_group(deadletters(0, 240, 0), T0)
    a.publish(T0 + 60 * S)
    assert [x for x in a.detector.engine.tick(T0 + 60 * S) if x.rule == "deadletter_rate"] == []
