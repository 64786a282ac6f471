"""Derived streams end to end against simulator truth: a clean run yields no alerts and no
episodes; with faults, each incident's alert or episode fires once and is resolved, and a
second detect process replaying the same input emits the same alert ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.pipeline_harness import WORKER_CLOCK_ARGS, Run, drain, simulate
from tests.integration.worker_helpers import fresh_topics, read_all, start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def detect(
    bootstrap: str, prefix: str, group: str, tmp: Path, *extra: str, idle: float = 8
) -> subprocess.CompletedProcess[str]:
    """Run `refinery detect` (default engine; ``extra``: more options) until its input has
    been idle for ``idle`` seconds."""
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "detect",
            "--topic-prefix",
            prefix,
            "--group",
            group,
            "--idle-exit",
            str(idle),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )


def alerts(bootstrap: str, prefix: str) -> list[dict[str, object]]:
    return [json.loads(v) for _, v, _ in read_all(bootstrap, prefix + "telemetry.alerts", idle=3)]


def test_clean_run_has_no_alerts(kafka_bootstrap: str, tmp_path: Path) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    w = start_worker(kafka_bootstrap, run.prefix, tmp_path, extra=WORKER_CLOCK_ARGS)
    try:
        time.sleep(6)
        simulate(kafka_bootstrap, run, nodes=3, seconds=25, faults="none", seed=21)
        drain(kafka_bootstrap, run, run.prefix + "worker")
    finally:
        w.stop()
    p = detect(kafka_bootstrap, run.prefix, run.prefix + "detect", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    got = alerts(kafka_bootstrap, run.prefix)
    # the simulation's end silences every exporter at once; that is not an incident
    assert [a for a in got if a["rule"] != "exporter_silent"] == []
    episodes = read_all(kafka_bootstrap, run.prefix + "telemetry.episodes", idle=3)
    assert episodes == []


def test_incidents_fire_once_resolve_and_replay_to_the_same_ids(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    w = start_worker(kafka_bootstrap, run.prefix, tmp_path, extra=WORKER_CLOCK_ARGS)
    try:
        time.sleep(6)
        simulate(
            kafka_bootstrap,
            run,
            nodes=4,
            seconds=40,
            seed=22,
            faults="throttle:count=1,xid:count=1,link_flap:count=1",
        )
        drain(kafka_bootstrap, run, run.prefix + "worker")
    finally:
        w.stop()
    p = detect(kafka_bootstrap, run.prefix, run.prefix + "detect", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = [a for a in alerts(kafka_bootstrap, run.prefix) if a["rule"] != "exporter_silent"]

    import pyarrow.parquet as pq

    incidents = pq.read_table(str(run.truth) + ".incidents.parquet").to_pylist()
    by_kind = {i["kind"]: i for i in incidents}
    assert {"throttle", "xid", "link_flap"} <= set(by_kind)

    def fired(rule_suffix: str) -> list[dict[str, object]]:
        return [a for a in first if str(a["rule"]).endswith(rule_suffix) and a["state"] == "firing"]

    thr, xid, flap = by_kind["throttle"], by_kind["xid"], by_kind["link_flap"]
    assert [a["entity"] for a in fired("_throttle")] == [f"{thr['node']}/{thr['device']}"]
    assert [a["entity"] for a in fired("gpu_xid")] == [f"{xid['node']}/{xid['device']}"]
    assert [a["entity"] for a in fired("link_down")] == [f"{flap['node']}/{flap['device']}"]
    # throttling and the link flap end within the run: each firing has its resolved record
    for a in fired("_throttle") + fired("link_down"):
        assert any(b["id"] == a["id"] and b["state"] == "resolved" for b in first), a

    # a second detect replaying everything (another group) emits the same ids
    p = detect(kafka_bootstrap, run.prefix, run.prefix + "detect-replay", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    both = [a for a in alerts(kafka_bootstrap, run.prefix) if a["rule"] != "exporter_silent"]
    ids_first = sorted((str(a["id"]), str(a["state"])) for a in first)
    ids_all = sorted({(str(a["id"]), str(a["state"])) for a in both})
    assert ids_all == sorted(set(ids_first))
