"""The worker frozen with SIGSTOP past its consumer session timeout, then SIGCONT'd: the group
expels it, it rejoins and replays from its last commit; nothing acknowledged is lost and,
after lineage dedupe, nothing is refined twice."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.fault.harness import (
    Supervised,
    acked_raw,
    reconcile,
    refined_count,
    report,
    simulate,
    wait_drained,
    worker_story,
)
from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# the shortest session the broker accepts, so that the test outlives it quickly
SESSION = {"REFINERY_SESSION_TIMEOUT_S": "6"}


def test_sigstop_past_session_timeout_then_sigcont(kafka_bootstrap: str, tmp_path: Path) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    refined = prefix + "telemetry.refined"
    w = Supervised(kafka_bootstrap, prefix, tmp_path, SESSION)
    try:
        sim = simulate(kafka_bootstrap, prefix, tmp_path, seconds=20)
        deadline = time.monotonic() + 60
        while refined_count(kafka_bootstrap, refined) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(w.proc.pid, signal.SIGSTOP)
        time.sleep(10)  # > the 6 s session timeout: the coordinator expels the member
        frozen = refined_count(kafka_bootstrap, refined)
        os.kill(w.proc.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        recover_s = -1.0
        while time.monotonic() - t_cont < 120:
            w.check()
            if refined_count(kafka_bootstrap, refined) > frozen:
                recover_s = time.monotonic() - t_cont
                break
            time.sleep(0.25)
        assert recover_s >= 0, "the worker never produced again after SIGCONT"
        assert sim.wait(120) == 0
        wait_drained(kafka_bootstrap, prefix, acked_raw(tmp_path / "truth.parquet"), 120, w)
        r = reconcile(kafka_bootstrap, prefix, tmp_path / "truth.parquet")
        report("worker-sigstop", r, recover_s, restarts=w.restarts, stalled=w.unhealthy_kills)
        assert r.ok(), f"{r}; {worker_story(tmp_path, w)}"
    finally:
        w.stop()
