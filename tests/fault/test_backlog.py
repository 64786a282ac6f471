"""A worker started on a backlog: the simulator publishes a whole run (every fault, exporters at
phases of their own) while no worker runs; detect and the lander wait. Then the worker starts and
catches up, refining one partition ahead of another. ``refinery verify`` must find the lake as
trustworthy as on a live run: nothing lost or duplicated, every sample within its stated clock
bound, no false alert (a source is not silent because the refiner was behind, a straggler is not
judged before the congestion on its path is refined) and every incident found.

Prints one ``FAULT`` line with the verdict's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.demo.procs import group_lag
from services.lake.datasets import DATASETS
from tests.fault.harness import LIGHT, Supervised, cli
from tests.fault.test_chaos import Restartable, _wait
from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SECONDS = int(os.environ.get("REFINERY_BACKLOG_SECONDS", "60"))
NODES = int(os.environ.get("REFINERY_BACKLOG_NODES", "4"))
SEED = int(os.environ.get("REFINERY_BACKLOG_SEED", "57"))
REPO = Path(__file__).resolve().parents[2]
VERIFY = [sys.executable, "-m", "services.cli", "verify"]


def test_a_worker_started_on_a_backlog_refines_it_as_a_live_one(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    bootstrap = kafka_bootstrap
    prefix = fresh_topics(bootstrap)
    lake, truth = tmp_path / "lake", tmp_path / "truth.parquet"
    env = {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp_path / "home"),
           "REFINERY_LAKE": str(lake)}  # fmt: skip
    topics = {prefix + d.topic: name for name, d in DATASETS.items()}  # verify reads them all
    land_group, detect_group = f"{prefix}land", f"{prefix}detect"
    land_args = ["land", "--group", land_group, "--instance-id", "lander-0", "--max-age", "1",
                 "--no-compact", "--topics", *(f"{t}={d}" for t, d in topics.items())]  # fmt: skip
    detect_args = ["detect", "--topic-prefix", prefix, "--group", detect_group]
    lander = Restartable("land", land_args, tmp_path, env)
    detect = Restartable("detect", detect_args, tmp_path, env)
    w: Supervised | None = None
    conf = {"bootstrap.servers": bootstrap}

    def tick() -> None:
        for p in (w, lander, detect):
            if p is not None:
                p.check()

    try:
        sim_args = ["simulate", "--nodes", str(NODES), "--duration", str(SECONDS), "--spread",
                    "--seed", str(SEED), "--faults", "all", "--truth", str(truth),
                    "--topic-prefix", prefix, "--bootstrap", bootstrap, *LIGHT]  # fmt: skip
        sim = cli(sim_args, tmp_path / "simulate.log")
        assert sim.wait(SECONDS + 120) == 0, (tmp_path / "simulate.log").read_text()[-2000:]
        t0 = time.monotonic()
        w = Supervised(bootstrap, prefix, tmp_path)  # the whole run is its backlog
        inputs = [
            prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")
        ]
        _wait("the worker", lambda: group_lag(conf, f"{prefix}worker", inputs) == 0, 300, tick)
        caught_up_s = time.monotonic() - t0
        derived = [
            prefix + t
            for t in ("telemetry.refined", "telemetry.events.aligned",
                      "telemetry.collectives.aligned", "telemetry.accounting")
        ]  # fmt: skip
        _wait("detect", lambda: group_lag(conf, detect_group, derived) == 0, 180, tick)
        time.sleep(3)  # the watermark's last tick
        detect.stop()
        _wait("the lander", lambda: group_lag(conf, land_group, list(topics)) == 0, 180, tick)
    finally:
        if w is not None:
            w.stop()
        detect.stop()
        lander.stop()
    got = subprocess.run(
        [*VERIFY, "--truth", str(truth), "--lake", str(lake), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert got.stdout.startswith("{"), got.stderr[-3000:]
    verdict = json.loads(got.stdout)
    print("FAULT " + json.dumps({"fault": "backlog", "seconds": SECONDS, "nodes": NODES,
                                 "seed": SEED, "caught_up_s": round(caught_up_s, 1),
                                 "misses": verdict["misses"], "clock": verdict["clock"]}),
          flush=True)  # fmt: skip
    assert got.returncode == 0 and verdict["ok"], verdict["misses"]
