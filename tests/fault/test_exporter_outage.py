"""An outage: the broker stopped for longer than the exporter's ``message.timeout.ms`` while the
exporter keeps sampling, then started again on its storage.

An exporter's :class:`BatchProducer` with small buffer bounds (librdkafka's queue and the spool,
10 batches each) samples a batch every 0.2 s, 10 known samples a batch, throughout. Timed-out
batches go back into the spool behind newer ones; what the bounds cannot hold is dropped,
oldest first, and counted. After the restart the worker and the lander run, and the lake must
hold every batch the exporter kept exactly once (lost 0, duplicated 0), none of the dropped
ones, and the dropped ones must be exactly the counted ones, each a visible gap in the source's
``seq`` numbers.

Prints one ``FAULT`` line with the figures (collected by the report).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from lab.broker import LocalKafka
from lab.demo.procs import group_lag
from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from services.kafka.producer import BatchProducer, initial_seq
from services.lake.writer import LakeWriter
from services.settings import KafkaSettings
from tests.fault.harness import Supervised, cli, worker_story
from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CADENCE_S = 0.2
SAMPLES = 10  # per batch
TIMEOUT_MS = 5_000  # the exporter's message.timeout.ms
OUTAGE_S = 15.0  # the broker is down three times as long
BOUND = 10  # batches librdkafka's queue holds, and again the spool
SOURCE = SourceId(node="outage-n1", exporter="node", instance="0", boot_id="b-outage")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalKafka]:
    k = LocalKafka(tmp_path / "kafka", heap="512m")
    k.start(nodes=1, base_port=0)
    try:
        yield k
    finally:
        k.stop()


def _batch(seq: int) -> tuple[Envelope, pa.Table]:
    now = time.time_ns()
    env = Envelope(source=SOURCE, seq=seq, sent_ns=now, interval_ns=int(CADENCE_S * 1e9))
    t = pa.table(
        {
            "ts_ns": [now] * SAMPLES,
            "metric": ["cpu.user_seconds"] * SAMPLES,
            "device": [f"cpu{i}" for i in range(SAMPLES)],
            "value": [float(seq % 1000 + i) for i in range(SAMPLES)],
            "raw": pa.array([seq % 1000 + i for i in range(SAMPLES)], pa.uint64()),
            "text": pa.nulls(SAMPLES, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return env, t


class Exporter:
    """A sampling loop on a BatchProducer that remembers what it sampled, what the broker
    acknowledged and what the producer's bounds dropped."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.sampled: list[int] = []
        self.acked: dict[int, int] = {}  # seq → acknowledgements
        self.dropped: list[int] = []
        self.timeouts = 0
        self._seq = initial_seq()
        self.producer = BatchProducer(
            KafkaSettings(bootstrap_servers=bootstrap),
            topic=topic,
            spool_max_batches=BOUND,
            on_delivery=self._delivered,
            on_drop=lambda tag, n: self.dropped.append(int(tag.rsplit("|", 1)[1])),
            extra_conf={"message.timeout.ms": TIMEOUT_MS, "queue.buffering.max.messages": BOUND},
        )

    def _delivered(self, tag: str, err: object, partition: int, offset: int) -> None:
        seq = int(tag.rsplit("|", 1)[1])
        if err is None:
            self.acked[seq] = self.acked.get(seq, 0) + 1
        else:
            self.timeouts += 1

    def sample_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            env, table = _batch(self._seq)
            self.producer.send(env, table)
            self.sampled.append(self._seq)
            self._seq += 1
            self.producer.poll(CADENCE_S)


def _landed(lake: Path) -> dict[int, int]:
    """seq → sample rows the lake holds of the source."""
    files = [str(p) for p in LakeWriter(lake).live_paths("samples")]
    if not files:
        return {}
    rows = (
        duckdb.connect()
        .execute(
            f"SELECT seq, count(*) FROM read_parquet({files!r}, union_by_name = true) "
            f"WHERE node = '{SOURCE.node}' GROUP BY seq"
        )
        .fetchall()
    )
    return {int(s): int(n) for s, n in rows}


def test_outage_longer_than_message_timeout(
    broker: LocalKafka, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="services.kafka.producer")
    state = broker.state()
    assert state is not None
    bootstrap = state.bootstrap
    prefix = fresh_topics(bootstrap)
    ex = Exporter(bootstrap, prefix + "telemetry.raw")
    ex.sample_for(4.0)
    broker.kill_node(1)
    ex.sample_for(OUTAGE_S)
    broker.restart_node(1, timeout=120)
    lake = tmp_path / "lake"
    env = {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp_path / "home"),
           "REFINERY_LAKE": str(lake)}  # fmt: skip
    w = Supervised(bootstrap, prefix, tmp_path)
    land_group = f"{prefix}land"
    land_args = ["land", "--group", land_group, "--instance-id", "lander-0", "--max-age", "1",
                 "--no-compact", "--topics", f"{prefix}telemetry.refined=samples"]  # fmt: skip
    lander = cli(land_args, tmp_path / "land.log", env)
    try:
        ex.sample_for(4.0)
        left = ex.producer.close(60)
        assert left == 0, f"{left} batches still unsent after the restart"
        conf = {"bootstrap.servers": bootstrap}
        deadline = time.monotonic() + 120
        while group_lag(conf, f"{prefix}worker", [prefix + "telemetry.raw"]) > 0:
            assert time.monotonic() < deadline, worker_story(tmp_path, w)
            w.check()
            time.sleep(1.0)
        while group_lag(conf, land_group, [prefix + "telemetry.refined"]) > 0:
            assert time.monotonic() < deadline, (tmp_path / "land.log").read_text()[-2000:]
            assert lander.poll() is None, (tmp_path / "land.log").read_text()[-2000:]
            time.sleep(1.0)
    finally:
        w.stop()
        lander.terminate()
        lander.wait(60)
    landed = _landed(lake)
    kept = [s for s in ex.sampled if s not in set(ex.dropped)]
    lost = [s for s in kept if landed.get(s, 0) < SAMPLES]
    duplicated = sum(max(0, landed.get(s, 0) - SAMPLES) for s in kept)
    stats = ex.producer.stats
    seq_gaps = (max(landed) - min(landed) + 1 - len(landed)) if landed else -1
    figures = {
        "fault": "exporter-outage",
        "batches_sampled": len(ex.sampled),
        "batches_kept": len(kept),
        "dropped_by_bound": stats.dropped_overflow,
        "dropped_samples": stats.dropped_samples,
        "timed_out_deliveries": ex.timeouts,
        "landed_batches": len(landed),
        "landed_samples": sum(landed.values()),
        "lost": len(lost),
        "duplicated_samples": duplicated,
        "seq_gaps_in_lake": seq_gaps,
        "worker_restarts": w.restarts,
    }
    print("FAULT " + json.dumps(figures), flush=True)
    # the outage outlasted message.timeout.ms and the bounds: both paths were taken
    assert ex.timeouts > 0 and stats.dropped_overflow > 0, figures
    # what was dropped is exactly what was counted, and never landed
    assert len(ex.dropped) == len(set(ex.dropped)) == stats.dropped_overflow, figures
    assert stats.dropped_samples == SAMPLES * stats.dropped_overflow, figures
    assert not set(ex.dropped) & set(landed), figures
    # every kept batch was acknowledged and landed exactly once, nothing else landed
    assert set(ex.acked) == set(kept), figures
    assert lost == [] and duplicated == 0, figures
    assert set(landed) == set(kept), figures
    # each dropped batch is a gap in the source's seq numbers, visible in the lake
    inside = [s for s in ex.dropped if min(landed) < s < max(landed)]
    assert seq_gaps == len(inside), figures
    # and the exporter said so: a warning with the running totals
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert said, "no warning about the dropped batches"
    total = f"{stats.dropped_overflow} batches ({stats.dropped_samples} samples) in all"
    assert total in said[-1], said
