"""Raising the partitions of telemetry.raw under an existing worker state: the worker refuses
to start, in one line that says what to do (its changelog records would go to partitions its
state topics lack, and each stream's state to a partition its records no longer use)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka]


def test_the_worker_refuses_raw_partitions_its_state_does_not_have(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    app_id = prefix + "worker"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # the state topics of a worker that ran while telemetry.raw had its 8 partitions ...
    names = [f"{app_id}-refine-streams-changelog", f"{app_id}-refine-nodes-changelog"]
    for f in admin.create_topics([NewTopic(n, 8, 1) for n in names]).values():
        f.result(30)
    # ... and then telemetry.raw raised to 12
    raw = prefix + "telemetry.raw"
    for f in admin.create_partitions([NewPartitions(raw, 12)]).values():
        f.result(30)
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "REFINERY_HOME": str(tmp_path / "home")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "--topic-prefix", prefix,
         "--app-id", app_id, "--web-port", "0", "--data-dir", str(tmp_path / "data")],
        env=env, capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"{raw} has 12 partitions" in lines[0] and "has 8" in lines[0]
    assert "new --app-id" in lines[0]
