"""Simulator with every fault → real broker → refining worker(s) → topics, compared with the
simulator's truth: every acknowledged distinct sample refined exactly once, every injected
duplicate counted, every malformed record dead-lettered with its reason, aligned timestamps
within their stated bounds, every GPU/NIC sample enriched — also under kill -9 of the worker
(ten times in one run) and with two workers of one group, one stopped mid-run."""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.pipeline_harness import (
    WORKER_CLOCK_ARGS,
    Run,
    collect,
    compare,
    drain,
    simulate,
)
from tests.integration.worker_helpers import fresh_topics, start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def members(bootstrap: str, group: str) -> int:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        g = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    except Exception:
        return 0
    return len(g.members) if str(g.state).endswith("STABLE") else 0


def check(result: dict[str, object], run: Run) -> None:
    print(f"\n{run.prefix}: {result} {run.notes}")
    assert result["truth_good"] and result["refined_rows"] == result["truth_good"]
    assert result["lost"] == 0
    assert result["duplicated"] == 0
    assert result["unexpected"] == 0
    assert result["dup_accounted"] == result["dup_sends"]
    assert result["malformed_mismatch"] == 0
    assert result["bad_rows_mismatch"] == 0
    assert result["fabric_rows_unexplained"] == 0
    assert float(result["within_bound"]) >= 0.99  # type: ignore[arg-type]


def test_all_faults_refined_exactly_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    w = start_worker(kafka_bootstrap, run.prefix, tmp_path, extra=WORKER_CLOCK_ARGS)
    try:
        time.sleep(6)
        simulate(kafka_bootstrap, run, nodes=4, seconds=40, faults="all", seed=11)
        drain(kafka_bootstrap, run, run.prefix + "worker")
    finally:
        assert w.stop() == 0, w.tail()
    check(compare(collect(kafka_bootstrap, run)), run)


def test_kill_9_worker_ten_times(kafka_bootstrap: str, tmp_path: Path) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    rng = random.Random(5)
    group = run.prefix + "worker"
    box = {
        "w": start_worker(
            kafka_bootstrap, run.prefix, tmp_path, app_id=group, extra=WORKER_CLOCK_ARGS
        )
    }
    kills: list[float] = []

    def killer(done: threading.Event) -> None:
        while len(kills) < 10:
            time.sleep(rng.uniform(2.0, 6.0))
            box["w"].stop(signal.SIGKILL)
            kills.append(time.monotonic())
            box["w"] = start_worker(
                kafka_bootstrap,
                run.prefix,
                tmp_path,
                app_id=group,
                name=f"w{len(kills)}",
                extra=WORKER_CLOCK_ARGS,
            )

    try:
        time.sleep(6)
        simulate(kafka_bootstrap, run, nodes=3, seconds=45, faults="all", seed=12, during=killer)
        # the last worker first waits out the killed member's session (15 s), and partitions
        # have been seen to drain slowly after that rebalance (about one record a second)
        drain(kafka_bootstrap, run, group, timeout=360)
    finally:
        box["w"].stop()
    run.notes["kills"] = len(kills)
    assert len(kills) == 10
    check(compare(collect(kafka_bootstrap, run)), run)


def test_two_workers_one_stopped_mid_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    group = f"{run.prefix}worker-{uuid.uuid4().hex[:4]}"
    a = start_worker(
        kafka_bootstrap, run.prefix, tmp_path, app_id=group, name="a", extra=WORKER_CLOCK_ARGS
    )
    b = start_worker(
        kafka_bootstrap, run.prefix, tmp_path, app_id=group, name="b", extra=WORKER_CLOCK_ARGS
    )

    def stop_b(done: threading.Event) -> None:
        # once both share the partitions (not in the middle of the join), stop b
        deadline = time.monotonic() + 60
        while members(kafka_bootstrap, group) != 2 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(8)
        run.notes["b_exit"] = b.stop()  # SIGTERM: its partitions move to a

    box = {"a": a}
    restarts: list[int] = []

    def supervise() -> None:
        # what a deployment's supervisor does: a worker that ended non-zero is started again.
        # Seen in CI runs of the whole suite, never when these tests ran alone: Faust's
        # recovery of the changelogs b left (which a read as standby until then) never
        # received an event, nothing was committed, and a's own watchdog ended it after 60 s
        # (as it should: see run_worker); a fresh start recovers them. Never more than twice.
        code = box["a"].proc.poll()
        if code is not None and len(restarts) < 2:
            assert code != 0, box["a"].tail()
            restarts.append(code)
            box["a"] = start_worker(
                kafka_bootstrap, run.prefix, tmp_path, app_id=group, name=f"a{len(restarts)}",
                extra=WORKER_CLOCK_ARGS,
            )  # fmt: skip

    try:
        time.sleep(8)
        simulate(kafka_bootstrap, run, nodes=4, seconds=35, faults="all", seed=13, during=stop_b)
        deadline = time.monotonic() + 300
        while True:
            try:
                drain(kafka_bootstrap, run, group, timeout=15)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                supervise()
    finally:
        box["a"].stop()
        b.stop()
    run.notes["a_restarts"] = restarts
    # 0: a clean stop; 3: the worker's own watchdog ended a stop that hung on a rebalance
    # (documented in run_worker). Either way its partitions moved to a and nothing is lost:
    assert run.notes["b_exit"] in (0, 3)
    check(compare(collect(kafka_bootstrap, run)), run)
