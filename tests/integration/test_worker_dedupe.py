"""Dedupe by identity, end to end: a first delivery that comes far more batches late than the
worker's position window (512) is refined, and a re-send of it is still a duplicate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from schemas.codec import ARROW, encode
from tests.integration.test_worker import batch
from tests.integration.worker_helpers import accounting, fresh_topics, running_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_a_first_delivery_late_by_thousands_of_batches_is_refined(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    raw = prefix + "telemetry.raw"
    now = time.time_ns()
    bodies = {}
    for seq in range(1500):
        env, t = batch("n1", seq, now - 3_600_000_000_000 + seq * 1_000_000_000, n=2)
        bodies[seq] = encode(env, t, ARROW)
    late = 7
    order = [s for s in bodies if s != late] + [late, late]  # the late one, then its re-send
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for seq in order:
        ct, body = bodies[seq]
        p.produce(raw, body, key=b"n1", partition=0, headers=[("content-type", ct)])
    assert p.flush(30) == 0
    with running_worker(kafka_bootstrap, prefix, tmp_path) as w:
        acc = accounting(kafka_bootstrap, prefix, expect=len(order), timeout=180)
        assert len(acc) == len(order), w.tail()
        by = {int(str(a["raw_offset"])): a["outcome"] for a in acc}
        n = len(order)
        assert by[n - 2] == "refined", "the late first delivery was dropped as a duplicate"
        assert by[n - 1] == "duplicate"
        assert sum(1 for o in by.values() if o == "refined") == len(bodies)
        assert w.stop() == 0, w.tail()
