"""Chaos: the simulator with every fault while the refining worker is killed -9 every 20-30 s
(restarted by its supervisor), and the lander and detect killed -9 once each (restarted at
once). The lake must hold exactly the simulator's truth in every dataset: samples, events and
collectives against what the simulator's acknowledged sends carried, dead letters against
the records it malformed (lost 0, duplicated 0 each), every alert and episode once per state,
every rollup window once, and ``lake_accounting`` ok on every raw partition.

Prints one ``FAULT`` line with the counts per dataset (collected by the report).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest

from lab.demo.procs import group_lag
from services.lake import sqlload
from services.lake.datasets import DATASETS
from services.lake.writer import LakeWriter
from tests.fault.harness import Supervised, cli, simulate, worker_story
from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# simulated (and wall) time the simulator publishes, and its nodes; larger runs through the
# environment (the defaults keep the test near two minutes on two cores)
SECONDS = int(os.environ.get("REFINERY_CHAOS_SECONDS", "70"))
NODES = int(os.environ.get("REFINERY_CHAOS_NODES", "4"))
DERIVED = ("telemetry.refined", "telemetry.events.aligned", "telemetry.collectives.aligned",
           "telemetry.accounting")  # fmt: skip
LAKE_SETS = ("samples", "events", "collectives", "deadletter", "accounting", "alerts",
             "episodes", "rollups")  # fmt: skip


class Restartable:
    """A long-running ``refinery`` subprocess that can be killed -9 and started again."""

    def __init__(self, name: str, args: list[str], tmp: Path, env: dict[str, str]) -> None:
        self.name, self.args, self.tmp, self.env = name, args, tmp, env
        self.kills = 0
        self.proc = cli(args, tmp / f"{name}.log", env)

    def kill9_and_restart(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.kills += 1
        self.proc = cli(self.args, self.tmp / f"{self.name}.log", self.env)

    def check(self) -> None:
        """Started again if it exited (as its supervisor would)."""
        if self.proc.poll() is not None:
            self.proc = cli(self.args, self.tmp / f"{self.name}.log", self.env)

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _wait(what: str, done: Callable[[], bool], timeout: float, tick: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} did not catch up in {timeout:.0f} s"
        tick()
        time.sleep(1.0)


def _one(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchone()
    assert row is not None
    return int(row[0] or 0)


def _multiset(con: duckdb.DuckDBPyConnection, truth: str, lake: str, key: str) -> dict[str, int]:
    """Lost and duplicated rows of ``lake`` against ``truth`` (both SQL relations), counting
    each ``key`` value as many times as the truth holds it."""
    sql = f"""
        WITH t AS (SELECT {key}, count(*) AS n FROM ({truth}) GROUP BY ALL),
             l AS (SELECT {key}, count(*) AS n FROM ({lake}) GROUP BY ALL)
        SELECT coalesce(sum(greatest(coalesce(t.n, 0) - coalesce(l.n, 0), 0)), 0),
               coalesce(sum(greatest(coalesce(l.n, 0) - coalesce(t.n, 0), 0)), 0),
               coalesce(sum(t.n), 0), coalesce(sum(l.n), 0)
        FROM t FULL OUTER JOIN l USING ({key})
    """
    row = con.execute(sql).fetchone()
    assert row is not None
    lost, extra, truth_n, lake_n = (int(x) for x in row)
    return {"truth": truth_n, "landed": lake_n, "lost": lost, "duplicated": extra}


def _duplicates(con: duckdb.DuckDBPyConnection, rel: str, key: str) -> int:
    return _one(con, f"SELECT sum(n - 1) FROM (SELECT count(*) n FROM {rel} GROUP BY {key})")


def compare(lake: Path, truth: Path) -> dict[str, Any]:
    """Per dataset, what the lake lost and duplicated against the truth."""
    con = duckdb.connect()
    for ds in LAKE_SETS:
        files = [str(p) for p in LakeWriter(lake).live_paths(ds)]
        con.execute(
            f"CREATE VIEW {ds} AS SELECT * FROM read_parquet({files!r}, union_by_name = true)"
        )
    con.execute(f"CREATE VIEW truth AS SELECT * FROM read_parquet('{truth}')")
    for name in ("sends", "events", "collectives"):
        path = f"{truth}.{name}.parquet"
        con.execute(f"CREATE VIEW truth_{name} AS SELECT * FROM read_parquet('{path}')")
    s_key = "node, exporter, instance, boot_id, seq, metric, device, ts"
    s_cols = "node, exporter, instance, boot_id, seq, metric, device"
    out: dict[str, Any] = {
        "samples": _multiset(
            con,
            f"SELECT {s_cols}, ts_source_ns AS ts FROM truth WHERE expected_reason IS NULL",
            f"SELECT {s_cols}, ts_source AS ts FROM samples",
            s_key,
        ),
        "events": _multiset(
            con,
            "SELECT node, boot_id, seq, event, device, ts_source_ns AS ts FROM truth_events",
            "SELECT node, boot_id, seq, event, device, ts_source AS ts FROM events",
            "node, boot_id, seq, event, device, ts",
        ),
        "collectives": _multiset(
            con,
            "SELECT job, op_seq, rank, device, ts_source_ns AS ts FROM truth_collectives",
            "SELECT job, op_seq, rank, device, ts_source AS ts FROM collectives",
            "job, op_seq, rank, device, ts",
        ),
    }
    malformed = "FROM truth_sends WHERE kind = 'malformed'"
    out["deadletter"] = {
        "malformed": _one(con, f"SELECT count(*) {malformed}"),
        "lost": _one(
            con,
            f"""SELECT count(*) {malformed} AND NOT EXISTS (SELECT 1 FROM deadletter d
                WHERE d.topic = truth_sends.topic AND d.partition = truth_sends.partition
                AND d.offset = truth_sends.offset)""",
        ),
        "duplicated": _duplicates(con, "deadletter", 'topic, partition, "offset", scope, reason'),
        "quarantined_samples": _one(
            con, "SELECT sum(samples) FROM deadletter WHERE scope = 'samples'"
        ),
        "truth_bad_samples": _one(
            con, "SELECT count(*) FROM truth WHERE expected_reason IS NOT NULL"
        ),
    }
    out["accounting"] = {
        "rows": _one(con, "SELECT count(*) FROM accounting"),
        "duplicated": _duplicates(con, "accounting", "raw_topic, raw_partition, raw_offset"),
    }
    # the same alert or episode under two ids would be a copy too: their own keys
    for ds, key, same in (
        ("alerts", "id, state", "rule, entity, starts_ns, state"),
        ("episodes", "id, state", "kind, entity, start_ns, state"),
        ("rollups", "node, window_s, window_start, device, metric", None),
    ):
        out[ds] = {"rows": _one(con, f"SELECT count(*) FROM {ds}"),
                   "duplicated": _duplicates(con, ds, key)}  # fmt: skip
        if same is not None:
            out[ds]["same_under_another_id"] = _duplicates(con, ds, same)
    LakeWriter(lake).ensure_seeds()  # topology and jobs are not landed here: views still bind
    acc = sqlload.connect(lake)
    bad = acc.execute("SELECT * FROM lake_accounting WHERE NOT ok").fetchall()
    out["lake_accounting"] = {
        "partitions": _one(acc, "SELECT count(*) FROM lake_accounting"),
        "not_ok": len(bad),
        "first_not_ok": [str(x) for x in bad[:2]],
    }
    return out


def test_chaos_every_dataset_exactly_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    bootstrap = kafka_bootstrap
    prefix = fresh_topics(bootstrap)
    lake = tmp_path / "lake"
    env = {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp_path / "home"),
           "REFINERY_LAKE": str(lake)}  # fmt: skip
    topics = {prefix + DATASETS[ds].topic: ds for ds in LAKE_SETS}
    land_group, detect_group = f"{prefix}land", f"{prefix}detect"
    land_args = ["land", "--group", land_group, "--instance-id", "lander-0", "--max-age", "1",
                 "--no-compact", "--topics", *(f"{t}={d}" for t, d in topics.items())]  # fmt: skip
    detect_args = ["detect", "--topic-prefix", prefix, "--group", detect_group, "--loglevel",
                   "info"]  # fmt: skip
    w = Supervised(bootstrap, prefix, tmp_path)
    lander = Restartable("land", land_args, tmp_path, env)
    detect = Restartable("detect", detect_args, tmp_path, env)
    rng = random.Random(32)
    worker_kills = 0

    def tick() -> None:
        w.check()
        lander.check()
        detect.check()

    try:
        sim = simulate(bootstrap, prefix, tmp_path, SECONDS, nodes=NODES, faults="all")
        t0 = time.monotonic()
        next_kill = t0 + rng.uniform(20, 30)
        once = {"land": t0 + 25, "detect": t0 + 40}
        while sim.poll() is None:
            now = time.monotonic()
            assert now - t0 < SECONDS + 120, "the simulator did not finish"
            if now >= next_kill:
                w.proc.kill()
                worker_kills += 1
                next_kill = now + rng.uniform(20, 30)
            for name, proc in (("land", lander), ("detect", detect)):
                if once.get(name, float("inf")) <= now:
                    proc.kill9_and_restart()
                    del once[name]
            tick()
            time.sleep(0.5)
        assert sim.returncode == 0, (tmp_path / "simulate.log").read_text()[-2000:]
        assert not once, f"the run ended before the kills of {sorted(once)}"
        conf = {"bootstrap.servers": bootstrap}
        inputs = [
            prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")
        ]
        _wait("the worker", lambda: group_lag(conf, f"{prefix}worker", inputs) == 0, 180, tick)
        derived = [prefix + t for t in DERIVED]
        _wait("detect", lambda: group_lag(conf, detect_group, derived) == 0, 120, tick)
        detect.stop()  # publishes what it still holds (open rollup windows)
        _wait("the lander", lambda: group_lag(conf, land_group, list(topics)) == 0, 120, tick)
    finally:
        w.stop()
        detect.stop()
        lander.stop()
    got = compare(lake, tmp_path / "truth.parquet")
    got["kills"] = {"worker": worker_kills, "worker_restarts": w.restarts,
                    "land": lander.kills, "detect": detect.kills}  # fmt: skip
    print("FAULT " + json.dumps({"fault": "chaos", **got}), flush=True)
    story = worker_story(tmp_path, w)
    for ds in ("samples", "events", "collectives", "deadletter"):
        assert got[ds]["lost"] == 0 and got[ds]["duplicated"] == 0, (ds, got[ds], story)
    for ds in ("accounting", "alerts", "episodes", "rollups"):
        assert got[ds]["duplicated"] == got[ds].get("same_under_another_id", 0) == 0, (ds, got)
    dl = got["deadletter"]
    assert dl["quarantined_samples"] == dl["truth_bad_samples"], dl
    assert got["samples"]["truth"] > 0 and got["events"]["truth"] > 0
    assert got["collectives"]["truth"] > 0 and got["deadletter"]["malformed"] > 0
    assert got["alerts"]["rows"] > 0 and got["rollups"]["rows"] > 0
    assert got["lake_accounting"]["not_ok"] == 0, got["lake_accounting"]
    assert worker_kills >= 2 and lander.kills == 1 and detect.kills == 1
