"""kill -9 of the (single) broker in the middle of a run, restarted a few seconds later: the
simulator's BatchProducer keeps and re-sends, the worker reconnects (or crashes and is
restarted, as a supervisor would), and nothing acknowledged is lost or refined twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.broker import LocalKafka
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


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalKafka]:
    k = LocalKafka(tmp_path / "kafka", heap="512m")
    k.start(nodes=1, base_port=0)
    try:
        yield k
    finally:
        k.stop()


def test_broker_kill_9_and_restart_loses_nothing(broker: LocalKafka, tmp_path: Path) -> None:
    state = broker.state()
    assert state is not None
    bootstrap = state.bootstrap
    prefix = fresh_topics(bootstrap)
    refined = prefix + "telemetry.refined"
    w = Supervised(bootstrap, prefix, tmp_path)
    try:
        sim = simulate(bootstrap, prefix, tmp_path, seconds=25)
        time.sleep(12)
        before = refined_count(bootstrap, refined)
        broker.kill_node(1)
        time.sleep(4)
        broker.restart_node(1, timeout=120)
        t_restart = time.monotonic()
        recover_s = -1.0
        while time.monotonic() - t_restart < 150:
            w.check()
            if refined_count(bootstrap, refined) > before:
                recover_s = time.monotonic() - t_restart
                break
            time.sleep(0.5)
        assert recover_s >= 0, "refined output never resumed after the restart"
        assert sim.wait(180) == 0, (tmp_path / "simulate.log").read_text()[-2000:]
        wait_drained(bootstrap, prefix, acked_raw(tmp_path / "truth.parquet"), 150, w)
        r = reconcile(bootstrap, prefix, tmp_path / "truth.parquet")
        report("broker-kill-9", r, recover_s, worker_restarts=w.restarts, before_kill=before)
        assert r.ok(), f"{r}; {worker_story(tmp_path, w)}"
    finally:
        w.stop()
