"""Each raw topic has offsets of its own: through the real broker, worker and lander, an
ingest record at the same partition and offset as a telemetry.raw record lands beside it,
and an ingest stream far behind telemetry.raw's offsets in the same partition lands too
(the lander's identity index is per raw topic and partition)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from schemas.codec import ARROW, encode
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from services.lake import sqlload
from services.lake.lineage import IDENTITIES
from services.lake.writer import LakeWriter
from tests.integration.worker_helpers import accounting, fresh_topics, running_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
INFLUX = "telemetry.ingest.influx"


def _native(node: str, now: int, n: int = 4) -> bytes:
    env = Envelope(source=SourceId(node=node, exporter="node", instance="0", boot_id="b1"),
                   seq=1, sent_ns=now)  # fmt: skip
    t = pa.table(
        {
            "ts_ns": [now - 10**9] * n,
            "metric": ["cpu.user_seconds"] * n,
            "device": [f"cpu{i}" for i in range(n)],
            "value": [float(i) for i in range(n)],
            "raw": pa.array(list(range(n)), pa.uint64()),
            "text": pa.nulls(n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return encode(env, t, ARROW)[1]


def _influx(node: str, ts: int) -> bytes:
    # a device the native batches do not have: not an overlapping source of the node
    return f"cpu,cpu=cpu9,host={node} time_user=100.5 {ts}\n".encode()


def _produce(bootstrap: str, topic: str, items: list[tuple[int, bytes, bool]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for part, value, arrow in items:
        headers: list[tuple[str, str | bytes | None]] = [("content-type", ARROW)] if arrow else []
        p.produce(topic, value, partition=part, headers=headers)
    assert p.flush(30) == 0


def _skip_ahead(bootstrap: str, topic: str, partition: int, n: int) -> None:
    """Move ``partition``'s offsets ``n`` on without records to read: ``n`` records,
    deleted (the log start moves past them)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    for _ in range(n):
        p.produce(topic, b"", partition=partition)
        p.poll(0)
    assert p.flush(60) == 0
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_records([TopicPartition(topic, partition, n)]).values():
        f.result(30)


def _land(lake: Path, bootstrap: str, prefix: str) -> None:
    args = [sys.executable, "-m", "services.cli", "land", "--group", prefix + "land",
            "--once-idle", "3", "--max-age", "0.2", "--no-compact", "--topics",
            f"{prefix}telemetry.refined=samples", f"{prefix}telemetry.accounting=accounting",
            f"{prefix}telemetry.deadletter=deadletter"]  # fmt: skip
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_LAKE": str(lake)}
    r = subprocess.run(args, cwd=REPO, env=env, timeout=180, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]


def test_ingest_and_raw_records_at_the_same_positions_both_land(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    raw, ingest = prefix + "telemetry.raw", prefix + INFLUX
    ahead = IDENTITIES["samples"].window + 1  # telemetry.raw a whole window ahead on 0
    _skip_ahead(kafka_bootstrap, raw, 0, ahead)
    now = time.time_ns()
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        # raw first: n-far at (0, ahead), n-same at (1, 0)
        _produce(kafka_bootstrap, raw, [(0, _native("n-far", now), True),
                                        (1, _native("n-same", now), True)])  # fmt: skip
        assert len(accounting(kafka_bootstrap, prefix, expect=2)) == 2, w.tail()
        # then the ingest topic: n-far at (0, 0) and (0, 1), n-same at (1, 0)
        _produce(kafka_bootstrap, ingest, [(0, _influx("n-far", now - 2 * 10**9), False),
                                           (0, _influx("n-far", now - 10**9), False),
                                           (1, _influx("n-same", now - 10**9), False)])  # fmt: skip
        acc = accounting(kafka_bootstrap, prefix, expect=5)
        assert [a["refined_samples"] for a in acc if a["raw_topic"] == ingest] == [1] * 3, acc
    lake = tmp_path / "lake"
    _land(lake, kafka_bootstrap, prefix)
    LakeWriter(lake).ensure_seeds()  # the datasets this lander did not land: empty
    con = sqlload.connect(lake)
    landed = con.execute(
        """SELECT raw_topic, raw_partition, raw_offset, node, count(*) FROM samples
           GROUP BY ALL ORDER BY ALL"""
    ).fetchall()
    assert landed == [
        (ingest, 0, 0, "n-far", 1),
        (ingest, 0, 1, "n-far", 1),
        (ingest, 1, 0, "n-same", 1),
        (raw, 0, ahead, "n-far", 4),
        (raw, 1, 0, "n-same", 4),
    ]
    acc_rows = con.execute(
        "SELECT raw_topic, raw_partition, raw_records, landed_samples, ok FROM lake_accounting"
    ).fetchall()
    assert acc_rows == [
        (ingest, 0, 2, 2, True),
        (ingest, 1, 1, 1, True),
        (raw, 0, 1, 4, True),
        (raw, 1, 1, 4, True),
    ]
