"""The Faust detect engine against the lab's reference loop (lab.detect_reference), on one
pipeline run with a thermal throttle on node0001/gpu2 (2-10 s) and a link flap on
node0000/mlx5_3/1 (3-8 s):

- a whole run commits every input offset by its idle exit;
- warm-up: a group whose offsets stand at 6 s of the input (mid-incident) replays the span
  before them without publishing, so both incidents' resolutions carry the ids of their
  firings and no firing is published again; the reference loop publishes the same records;
- commit after acknowledgement: while the alerts topic refuses every record, the agent
  crashes (exit non-zero) without committing the input whose alerts were lost; the next
  process publishes them, with their ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)

from lab.demo.procs import end_offsets, group_lag
from tests.integration.pipeline_harness import WORKER_CLOCK_ARGS, Run, drain, simulate
from tests.integration.test_detect_e2e import REPO, detect
from tests.integration.worker_helpers import fresh_topics, start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
FAULTS = (
    "throttle:node=node0001,gpu=2,cause=thermal,start=2,dur=8,"
    "link_flap:node=node0000,nic=3,start=3,dur=5"
)
INCIDENTS = {("gpu_thermal_throttle", "node0001/gpu2"), ("nic_link_down", "node0000/mlx5_3/1")}
INPUTS = ("telemetry.refined", "telemetry.events.aligned", "telemetry.collectives.aligned",
          "telemetry.accounting")  # fmt: skip


def alerts_since(bootstrap: str, topic: str, since: dict[tuple[str, int], int]) -> list[Any]:
    """The alerts appended to ``topic`` after the end offsets ``since``."""
    conf = {"bootstrap.servers": bootstrap}
    ends = end_offsets(conf, [topic])
    c = Consumer({**conf, "group.id": "detect-faust-test", "enable.auto.commit": False})
    c.assign([TopicPartition(t, p, since.get((t, p), 0)) for t, p in ends])
    left = {tp: hi for tp, hi in ends.items() if hi > since.get(tp, 0)}
    out = []
    deadline = time.monotonic() + 30
    try:
        while left and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                tp = (str(m.topic()), int(m.partition() or 0))
                if m.error() is None and tp in left:
                    out.append(json.loads(m.value() or b"{}"))
                    if int(m.offset() or 0) >= left[tp] - 1:
                        del left[tp]
    finally:
        c.close()
    assert not left, f"alerts not read back: {left}"
    return out


def incident_alerts(records: list[Any]) -> set[tuple[str, str, str, str]]:
    return {
        (a["rule"], a["entity"], a["id"], a["state"])
        for a in records
        if (a["rule"], a["entity"]) in INCIDENTS
    }


def commit_at(bootstrap: str, group: str, topics: list[str], at_ms: int) -> None:
    """Set ``group``'s committed offsets of ``topics`` to the first record at ``at_ms``."""
    conf = {"bootstrap.servers": bootstrap}
    c = Consumer({**conf, "group.id": group, "enable.auto.commit": False})
    try:
        ends = end_offsets(conf, topics)
        found = c.offsets_for_times([TopicPartition(t, p, at_ms) for t, p in ends], timeout=10)
        offsets = [
            TopicPartition(tp.topic, tp.partition, ends[(tp.topic, tp.partition)])
            if tp.offset < 0
            else tp
            for tp in found
        ]
        c.commit(offsets=offsets, asynchronous=False)
    finally:
        c.close()


def set_max_message_bytes(bootstrap: str, topic: str, value: str | None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    op = AlterConfigOpType.SET if value is not None else AlterConfigOpType.DELETE
    entry = ConfigEntry("max.message.bytes", value or "", incremental_operation=op)
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for f in admin.incremental_alter_configs([res]).values():
        f.result(timeout=30)


def detect_reference(
    bootstrap: str, prefix: str, group: str, tmp: Path
) -> subprocess.CompletedProcess[str]:
    """The lab's reference loop (lab.detect_reference) over the same topics, until idle."""
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp)}
    args = ["--topic-prefix", prefix, "--group", group, "--idle-exit", "8", "--loglevel", "info"]
    return subprocess.run(
        [sys.executable, "-m", "lab.detect_reference", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )


def test_faust_engine_warm_up_and_commit_after_ack(kafka_bootstrap: str, tmp_path: Path) -> None:
    bs = kafka_bootstrap
    run = Run(fresh_topics(bs), tmp_path)
    pre = run.prefix
    inputs = [pre + t for t in INPUTS]
    alerts_topic = pre + "telemetry.alerts"
    w = start_worker(bs, pre, tmp_path, extra=WORKER_CLOCK_ARGS)
    try:
        time.sleep(6)
        simulate(bs, run, nodes=3, seconds=20, faults=FAULTS, seed=24)
        drain(bs, run, pre + "worker")
    finally:
        w.stop()
    assert run.report is not None
    # the simulation's true start (the broker's clock at speed 1): the exporters' greetings
    # and the topology go before it
    t0_ms = run.report.start_ns // 1_000_000
    conf = {"bootstrap.servers": bs}

    # a whole run: every input offset committed by the idle exit
    before = end_offsets(conf, [alerts_topic])
    p = detect(bs, pre, pre + "whole", tmp_path, "--loglevel", "info")
    assert p.returncode == 0, p.stderr[-3000:]
    assert group_lag(conf, pre + "whole", inputs) == 0
    whole = incident_alerts(alerts_since(bs, alerts_topic, before))
    assert {(r, e) for r, e, _, s in whole if s == "firing"} == INCIDENTS, whole
    assert {(r, e) for r, e, _, s in whole if s == "resolved"} == INCIDENTS, whole
    assert len({i for _, _, i, _ in whole}) == 2, whole

    # warm-up: offsets at 6 s of the input, mid-incident, for the Faust agent and the lab's
    # reference loop
    got = {}
    for engine in ("faust", "plain"):
        group = f"{pre}mid-{engine}"
        commit_at(bs, group, inputs, t0_ms + 6_000)
        before = end_offsets(conf, [alerts_topic])
        if engine == "faust":
            p = detect(bs, pre, group, tmp_path, "--loglevel", "info")
        else:
            p = detect_reference(bs, pre, group, tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        got[engine] = incident_alerts(alerts_since(bs, alerts_topic, before))
    resolved = {a for a in whole if a[3] == "resolved"}
    assert got["faust"] == resolved, (got["faust"], whole)
    assert got["plain"] == got["faust"]

    # commit after acknowledgement: a refused alert crashes the agent, input not committed
    set_max_message_bytes(bs, alerts_topic, "64")
    try:
        p = detect(bs, pre, pre + "refused", tmp_path)
    finally:
        set_max_message_bytes(bs, alerts_topic, None)
    assert p.returncode != 0, p.stderr[-3000:]
    assert group_lag(conf, pre + "refused", inputs) > 0
    before = end_offsets(conf, [alerts_topic])
    p = detect(bs, pre, pre + "refused", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    again = incident_alerts(alerts_since(bs, alerts_topic, before))
    assert again == whole, (again, whole)
