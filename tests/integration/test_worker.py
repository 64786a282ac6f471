"""The real worker as a subprocess against a real broker: refine, dead-letter, account,
create its changelog topics, stop cleanly on SIGTERM, crash loudly on corrupt state."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from lab.demo.procs import group_lag
from schemas.codec import ARROW, JSON, encode
from schemas.records import refined_lineage
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from tests.integration.worker_helpers import (
    WorkerProc,
    accounting,
    committed,
    fresh_topics,
    read_all,
    running_worker,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def batch(
    node: str, seq: int, t0: int, n: int = 50, bad: int = 0, sent_ns: int | None = None
) -> tuple[Envelope, pa.Table]:
    """Samples read at ``t0`` and handed to Kafka at ``sent_ns`` (default: now)."""
    env = Envelope(
        source=SourceId(node=node, exporter="node", instance="0", boot_id="b1"),
        seq=seq,
        sent_ns=sent_ns if sent_ns is not None else time.time_ns(),
    )
    metric = ["cpu.user_seconds"] * n
    for i in range(bad):
        metric[i] = "no.such_metric"
    t = pa.table(
        {
            "ts_ns": [t0] * n,
            "metric": metric,
            "device": [f"cpu{i}" for i in range(n)],
            "value": [float(seq * 100 + i) for i in range(n)],
            "raw": pa.array([seq * 100 + i for i in range(n)], pa.uint64()),
            "text": pa.nulls(n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return env, t


def produce(bootstrap: str, topic: str, items: list[tuple[bytes, bytes, str | None]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for key, value, ct in items:
        p.produce(topic, value, key=key, headers=[("content-type", ct.encode())] if ct else [])
    assert p.flush(30) == 0


def test_worker_refines_dead_letters_accounts_and_stops_cleanly(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    now = time.time_ns()
    items: list[tuple[bytes, bytes, str | None]] = []
    for seq in range(6):
        env, t = batch("n1", seq, now - (6 - seq) * 1_000_000_000, bad=2 if seq == 3 else 0)
        ct, body = encode(env, t, JSON if seq % 2 else ARROW)
        items.append((b"n1", body, ct))
    items.append((b"n1", items[1][1], JSON))  # the same batch published twice
    items.append((b"n1", b"\x00garbage", ARROW))  # poison record
    items.append((b"n1", b"{}", "text/csv"))  # unsupported content type
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        produce(kafka_bootstrap, raw, items)
        acc = accounting(kafka_bootstrap, prefix, expect=len(items))
        assert len(acc) == len(items), w.tail()
        by_outcome: dict[str, int] = {}
        for a in acc:
            by_outcome[str(a["outcome"])] = by_outcome.get(str(a["outcome"]), 0) + 1
            assert a["input_samples"] == (
                int(a["refined_samples"])
                + int(a["duplicate_samples"])  # type: ignore[call-overload]
                + int(a["quarantined_samples"])  # type: ignore[call-overload]
            )
        assert by_outcome == {"refined": 6, "duplicate": 1, "deadletter": 2}
        refined = read_all(kafka_bootstrap, prefix + "telemetry.refined", until=6)
        tables = [pa.ipc.open_stream(v).read_all() for _, v, _ in refined]
        assert sum(t.num_rows for t in tables) == 6 * 50 - 2
        # deltas flow across batches: raw increases by 100 ticks (0.01 s each) per batch
        allrows = pa.concat_tables(tables).to_pydict()
        deltas = [d for d in allrows["delta"] if d is not None]
        # cpu0 and cpu1 were rejected in batch 3, so their next delta spans two intervals
        assert len(deltas) == 5 * 50 - 2
        assert sorted(round(d, 9) for d in deltas) == [1.0] * (5 * 50 - 4) + [2.0, 2.0]
        dls = [
            json.loads(v)
            for _, v, _ in read_all(kafka_bootstrap, prefix + "telemetry.deadletter", until=3)
        ]
        reasons = sorted(d["reason"] for d in dls)
        assert reasons == ["undecodable", "unknown_metric", "unsupported_content_type"]
        assert next(d for d in dls if d["reason"] == "unknown_metric")["samples"] == 2
        # the changelog topics of its tables exist on the broker
        topics = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).topics
        assert f"{prefix}worker-refine-streams-changelog" in topics
        assert f"{prefix}worker-refine-nodes-changelog" in topics
        # and it commits what it processed (the group's lag drains to zero)
        deadline = time.monotonic() + 30
        while group_lag({"bootstrap.servers": kafka_bootstrap}, f"{prefix}worker", [raw]):
            assert time.monotonic() < deadline, "the worker never committed its offsets"
            time.sleep(0.5)
        assert w.stop(signal.SIGTERM) == 0, w.tail()


def test_corrupt_state_crashes_the_worker_nonzero(
    kafka_bootstrap: str, tmp_path: Path, unique_topic: Callable[..., str]
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    app_id = prefix + "worker"
    # a corrupt state blob in the changelog for stream n9|node|0 — as a broken disk or a bad
    # deploy would leave it
    changelog = f"{app_id}-refine-streams-changelog"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    admin.create_topics(
        [
            NewTopic(
                changelog,
                num_partitions=8,
                replication_factor=1,
                config={"cleanup.policy": "compact"},
            )
        ]
    )[changelog].result(30)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    from confluent_kafka.admin import AdminClient as _A  # noqa: F401

    # the raw topic's partitioner decides the partition of key n9; use the same for the state
    env, t = batch("n9", 0, time.time_ns())
    ct, body = encode(env, t, ARROW)
    p.produce(
        prefix + "telemetry.raw",
        body,
        key=b"n9",
        headers=[("content-type", ct.encode())],
        on_delivery=lambda err, m: p.produce(
            changelog, b"not a state blob", key=b"n9|node|0", partition=m.partition()
        ),
    )
    p.flush(10)
    p.poll(1)
    p.flush(10)
    for _ in range(2):
        with running_worker(kafka_bootstrap, prefix, tmp_path, app_id=app_id) as w:
            rc = w.proc.wait(120)
            assert rc != 0, w.tail()
            log = w.log.read_text(errors="replace")
        if "no commit progress" not in log:
            break
        # the consumer stalled before the record reached the agent (a Faust fetch stall, which
        # the commit watch turns into an exit): as its supervisor would, start it again
    assert "not a refinery state blob" in log


def _refined_positions(bootstrap: str, prefix: str) -> set[tuple[int, int]]:
    """Raw (partition, offset) of every refined message (its lineage header)."""
    out = set()
    for _, _, headers in read_all(bootstrap, prefix + "telemetry.refined", idle=3.0):
        for lin in refined_lineage(headers):
            out.add((int(lin["raw_partition"]), int(lin["raw_offset"])))
    return out


def test_a_group_whose_outputs_fail_is_never_committed(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The refined topic refuses every message (max.message.bytes 512): the worker's first
    group cannot publish, the worker exits non-zero, and no raw offset is committed past a
    record whose refined output the broker never acknowledged. With the limit lifted, a
    restarted worker refines every record: nothing was lost to the failure."""
    prefix = fresh_topics(kafka_bootstrap)
    raw, refined = prefix + "telemetry.raw", prefix + "telemetry.refined"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def refined_limit(value: str | None) -> None:
        op = AlterConfigOpType.SET if value is not None else AlterConfigOpType.DELETE
        entry = ConfigEntry("max.message.bytes", value or "", incremental_operation=op)
        res = ConfigResource(ResourceType.TOPIC, refined, incremental_configs=[entry])
        for f in admin.incremental_alter_configs([res]).values():
            f.result(30)

    refined_limit("512")
    now = time.time_ns()
    items: list[tuple[bytes, bytes, str | None]] = []
    for node in range(8):
        for seq in range(2):
            env, t = batch(f"n{node}", seq, now - (2 - seq) * 1_000_000_000)
            ct, body = encode(env, t, ARROW)
            items.append((f"n{node}".encode(), body, ct))
    produce(kafka_bootstrap, raw, items)
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        rc = w.proc.wait(150)
        log = w.log.read_text(errors="replace")
    assert rc != 0, log[-3000:]
    assert "MSG_SIZE_TOO_LARGE" in log, log[-3000:]
    done = _refined_positions(kafka_bootstrap, prefix)
    for part, offset in committed(kafka_bootstrap, raw, prefix + "worker").items():
        unrefined = [o for o in range(offset) if (part, o) not in done]
        assert not unrefined, f"partition {part} committed to {offset} past unrefined {unrefined}"

    refined_limit(None)
    with running_worker(kafka_bootstrap, prefix, tmp_path, name="w2") as w2:
        # the failed group's accounting records may already be there (that topic took them):
        # what must come is the refined output of every record
        deadline = time.monotonic() + 120
        while len(done := _refined_positions(kafka_bootstrap, prefix)) < len(items):
            assert time.monotonic() < deadline, (len(done), w2.tail())
            assert w2.proc.poll() is None, w2.tail()
        acc = accounting(kafka_bootstrap, prefix, expect=len(items), timeout=60)
        positions = {(int(a["raw_partition"]), int(a["raw_offset"])) for a in acc}  # type: ignore[call-overload]
        assert len(positions) == len(items), w2.tail()
        assert w2.stop(signal.SIGTERM) == 0, w2.tail()


def test_a_job_published_mid_run_joins_the_samples_after_its_start(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # the worker rebuilds its join index when the jobs topic changes; the nodes the job does
    # not run on keep their joins, the node it runs on sees it from its start on
    from confluent_kafka import Consumer, TopicPartition

    from schemas.records import EntityKind, JobPlacement, TopologyEntity

    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for node, rack in (("n1", "r1"), ("n2", "r2")):
        e = TopologyEntity(id=f"node:{node}", kind=EntityKind.NODE, node=node, rack=rack)
        p.produce(prefix + "topology", e.model_dump_json().encode(), key=e.id.encode())
    assert p.flush(30) == 0
    S = 1_000_000_000
    now = time.time_ns()
    start = now - 10 * S
    seqs = {"n1": 0, "n2": 0}

    def publish(t0: int) -> None:
        items: list[tuple[bytes, bytes, str | None]] = []
        for node in ("n1", "n2"):
            ct, body = encode(*batch(node, seqs[node], t0, n=4), ARROW)
            seqs[node] += 1
            items.append((node.encode(), body, ct))
        produce(kafka_bootstrap, raw, items)

    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{prefix}read",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})  # fmt: skip
    md = c.list_topics(prefix + "telemetry.refined", timeout=10)
    parts = md.topics[prefix + "telemetry.refined"].partitions
    c.assign([TopicPartition(prefix + "telemetry.refined", q, 0) for q in parts])
    rows: list[dict[str, object]] = []

    def read(want: int, why: str, w: WorkerProc) -> None:
        """Read refined rows until there are ``want``."""
        deadline = time.monotonic() + 60
        while len(rows) < want:
            assert time.monotonic() < deadline, f"{why}: {w.tail()}"
            for m in c.consume(100, 0.5):
                if m.error() is None and m.value():
                    rows.extend(pa.ipc.open_stream(m.value()).read_all().to_pylist())

    try:
        with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
            publish(now - 20 * S)  # before the job
            read(8, "the first batches refined", w)
            job = JobPlacement(job="j1", start_ns=start, nodes=["n1"])
            p.produce(prefix + "jobs", job.model_dump_json().encode(), key=b"j1")
            assert p.flush(30) == 0
            # samples after its start, until the worker has read the job (its feed polls)
            k = 0
            while not any(r["job"] == "j1" for r in rows):
                publish(now - 5 * S + k)
                k += 1
                read(len(rows) + 8, "batches after the job's start", w)
            assert w.stop(signal.SIGTERM) == 0, w.tail()
    finally:
        c.close()
    before = [r for r in rows if int(r["ts"]) < start]  # type: ignore[call-overload]
    assert {(r["node"], r["rack"], r["job"]) for r in before} == {("n1", "r1", None),
                                                                  ("n2", "r2", None)}  # fmt: skip
    after = [r for r in rows if int(r["ts"]) >= start]  # type: ignore[call-overload]
    last = after[-8:]  # the last round: the worker had the job
    assert {(r["node"], r["rack"], r["job"]) for r in last} == {("n1", "r1", "j1"),
                                                                ("n2", "r2", None)}  # fmt: skip
