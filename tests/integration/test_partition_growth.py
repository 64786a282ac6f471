"""Growing telemetry.raw mid-run, 8 → 16 → 64 partitions, by the documented procedure
(docs/operations.md, "Scaling": stop the workers, ``refinery worker grow``, start them with
the same --app-id), against the simulator's truth: nothing lost, nothing duplicated (by
lineage), every injected duplicate counted — and a copy of a record refined before the
change, sent to its node's new partition after it, counted as a duplicate too — no counter
state lost (one first sample per series, no spurious reset, every delta the difference of
its series' readings), no record out of order, no alert.

With 64 raw partitions (and the ingest topics refined with them: ~450 partitions on this
2-core host) the restarted worker meets several partitions whose records never reached its
stream; it reads each of them again (services/worker/health.py), not only the worst."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import Topics, publish
from services.settings import KafkaSettings
from services.worker.growth_plan import partition_of
from tests.integration.pipeline_harness import WORKER_CLOCK_ARGS, Run, collect, compare, drain
from tests.integration.worker_helpers import WorkerProc, fresh_topics, read_all, start_worker

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SERIES = "node, exporter, instance, boot_id, metric, device"


def _publish(bootstrap: str, run: Run, seconds: int, during: Any) -> None:
    """The simulation at real time, its producers refreshing metadata every 2 s (an
    exporter's librdkafka does every 300 s; the procedure waits for it either way)."""
    sim = Simulation(Cluster.build(6, gpus=8, nics=8, seed=21, cpus=16),
                     "dup,reset,wrap,late,malformed", seed=21,
                     duration_ns=seconds * 1_000_000_000)  # fmt: skip
    names = ("telemetry.raw", "telemetry.events", "telemetry.collectives", "topology", "jobs")
    topics = Topics(*(run.prefix + t for t in names))
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            refresh = {"topic.metadata.refresh.interval.ms": 2000}
            box["rep"] = publish(sim, KafkaSettings(bootstrap_servers=bootstrap), topics,
                                 run.truth, speed=1.0, progress_cb=None,
                                 extra_conf=refresh)  # fmt: skip
        except BaseException as e:
            box["err"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    during()
    t.join()
    if "err" in box:
        raise box["err"]
    run.report = box["rep"]
    assert run.report is not None and run.report.unacked == 0


def _grow(bootstrap: str, run: Run, n: int) -> dict[str, Any]:
    env = {**os.environ, "REFINERY_BOOTSTRAP_SERVERS": bootstrap,
           "REFINERY_HOME": str(run.tmp / "home")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "grow", "--partitions", str(n),
         "--topic-prefix", run.prefix, "--app-id", run.prefix + "worker", "--settle-s", "30",
         "--quiet-s", "15", "--json", *WORKER_CLOCK_ARGS],
        env=env, capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rep: dict[str, Any] = json.loads(done.stdout)
    rep["log"] = done.stderr.strip().splitlines()
    return rep


def _copy_to_new_home(bootstrap: str, prefix: str, node: bytes, old: int, n: int) -> int:
    """Send a copy of the latest record of ``node`` on its old partition ``old`` that the
    worker refined (accounting outcome ``refined``: its seq is in its source's dedupe window)
    to its partition with ``n`` partitions, as a producer re-sending it after the change
    would; its offset there."""
    raw = prefix + "telemetry.raw"
    acc = [json.loads(v) for _, v, _ in read_all(bootstrap, prefix + "telemetry.accounting",
                                                 idle=2) if v is not None]  # fmt: skip
    refined = [a["raw_offset"] for a in acc if a["raw_topic"] == raw and a["outcome"] == "refined"
               and a["raw_partition"] == old and a["node"] == node.decode()]  # fmt: skip
    assert refined, f"no refined record of {node!r} on {raw}[{old}]"
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "copy", "enable.auto.commit": False})
    c.assign([TopicPartition(raw, old, max(refined))])
    found = None
    deadline = time.monotonic() + 30
    while found is None and time.monotonic() < deadline:
        found = next((m for m in c.consume(10, 0.5) if m.error() is None), None)
    c.close()
    assert found is not None and found.offset() == max(refined) and found.key() == node
    got: list[int] = []
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(raw, found.value(), node, partition_of(node, n), headers=found.headers(),
              on_delivery=lambda err, msg: got.append(msg.offset()))  # fmt: skip
    assert p.flush(30) == 0 and got
    return got[0]


def _wait_assigned(w: WorkerProc, timeout: float = 120.0) -> None:
    """Until the worker has joined its group and been given partitions (a worker stopped
    while it starts exits as killed, and would say nothing of the procedure)."""
    deadline = time.monotonic() + timeout
    while " assigned " not in w.log.read_text(errors="replace"):
        assert w.proc.poll() is None and time.monotonic() < deadline, w.tail()
        time.sleep(0.5)


def _one(con: Any, sql: str) -> Any:
    row = con.execute(sql).fetchone()
    assert row is not None
    return row[0]


def _counter_checks(con: Any) -> dict[str, Any]:
    """What a lost, stale or reordered counter state would leave in the refined rows."""
    out: dict[str, Any] = {}
    out["second_first_samples"] = _one(
        con,
        f"""SELECT count(*) FROM (SELECT {SERIES}
        FROM refined_once WHERE null_reason = 'first_sample' GROUP BY ALL HAVING count(*) > 1)""",
    )
    # a reset where the true reading did not go down
    out["spurious_resets"] = _one(
        con,
        f"""WITH t AS (SELECT *, lag(value) OVER w pv,
            lag(boot_id) OVER w pb FROM truth WHERE expected_reason IS NULL
            WINDOW w AS (PARTITION BY node, exporter, instance, metric, device
                         ORDER BY ts_true_ns))
        SELECT count(*) FROM refined_once r JOIN t USING ({SERIES}, seq)
        WHERE r.reset AND r.ts_source = t.ts_source_ns AND t.pv IS NOT NULL
          AND t.pb = t.boot_id AND t.value >= t.pv""",
    )
    out["resets"] = _one(con, "SELECT count(*) FROM refined_once WHERE reset")
    # late rows of records the simulator sent in order (not a late delivery or a duplicate)
    out["late_in_order"] = _one(
        con,
        """SELECT count(*) FROM refined_once r WHERE late
        AND NOT EXISTS (SELECT 1 FROM sends s WHERE s.kind <> 'batch' AND s.node = r.node
            AND s.exporter = r.exporter AND s.instance = r.instance
            AND s.boot_id = r.boot_id AND s.seq = r.seq)""",
    )
    # every delta is the difference of its series' readings, as refined (a stale or lost
    # state would give a delta over a longer span: a rate spike)
    out["deltas_off"] = _one(
        con,
        f"""SELECT count(*) FROM (SELECT delta, value,
            lag(value) OVER (PARTITION BY {SERIES} ORDER BY ts_source) pv
            FROM refined_once WHERE NOT late AND value IS NOT NULL
              AND (delta IS NOT NULL OR reset OR null_reason = 'first_sample'))
        WHERE delta IS NOT NULL AND pv IS NOT NULL AND value >= pv
          AND abs(delta - (value - pv)) > 1e-6 * greatest(abs(value), 1)""",
    )
    out["deltas"] = _one(con, "SELECT count(*) FROM refined_once WHERE delta IS NOT NULL")
    return out


def test_raw_partitions_grow_twice_mid_run_keeping_the_state(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    run = Run(fresh_topics(kafka_bootstrap), tmp_path)
    group = run.prefix + "worker"
    box = {"w": start_worker(kafka_bootstrap, run.prefix, tmp_path, app_id=group,
                             extra=WORKER_CLOCK_ARGS)}  # fmt: skip
    growths: list[dict[str, Any]] = []
    copies: list[tuple[int, int]] = []
    t0 = time.monotonic()

    def during() -> None:
        # each growth while the simulation publishes (one takes ~35 s on a loaded 2-core box),
        # the second once the worker restarted after the first has refined for a while
        for n, at in ((16, 14.0), (64, 40.0)):
            _wait_assigned(box["w"])
            time.sleep(max(5.0, at - (time.monotonic() - t0)))
            assert box["w"].stop() == 0, box["w"].tail()
            growths.append(_grow(kafka_bootstrap, run, n))
            box["w"] = start_worker(kafka_bootstrap, run.prefix, tmp_path, app_id=group,
                                    name=f"w{n}", extra=WORKER_CLOCK_ARGS)  # fmt: skip
            if n == 16:  # node0003: partition 1 of 8, 9 of 16
                # (not node0002, which reboots at the first growth: the state a worker
                # checkpoints holds its source's current boot's window only, so a copy of a
                # record of the boot before, replayed after a restart, is refined anew)
                node = b"node0003"
                copies.append((9, _copy_to_new_home(kafka_bootstrap, run.prefix, node, 1, 16)))

    try:
        time.sleep(6)
        _publish(kafka_bootstrap, run, 85, during)
        drain(kafka_bootstrap, run, group, timeout=240, tail=box["w"].tail)
    finally:
        assert box["w"].stop() == 0, box["w"].tail()
    con = collect(kafka_bootstrap, run)
    result = compare(con)
    counters = _counter_checks(con)
    alerts = read_all(kafka_bootstrap, run.prefix + "telemetry.alerts", idle=2)
    print(f"\n{run.prefix}: {result}\ncounters {counters}\nalerts {len(alerts)}")
    for g in growths:
        print({k: v for k, v in g.items() if k != "log"}, *g["log"], sep="\n  ")
    assert [g["to_partitions"] for g in growths] == [16, 64]
    assert all(g["moved"] > 0 and g["unplaced"] == 0 for g in growths)
    # the producers moved under traffic: every moving node was seen on its new partition
    assert all(g["unseen_nodes"] == 0 for g in growths)
    assert result["truth_good"] and result["refined_rows"] == result["truth_good"]
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["unexpected"] == 0
    assert result["malformed_mismatch"] == 0 and result["bad_rows_mismatch"] == 0
    # the copy sent to the new partition is a duplicate of the record refined on the old one
    part, off = copies[0]
    dups = con.execute("SELECT DISTINCT raw_partition, raw_offset FROM acc "
                       "WHERE outcome = 'duplicate'").fetchall()  # fmt: skip
    assert (part, off) in {(int(p), int(o)) for p, o in dups}
    assert result["dup_accounted"] == result["dup_sends"] + 1
    assert counters["deltas"] > 0
    assert counters["second_first_samples"] == 0
    assert counters["spurious_resets"] == 0
    assert counters["late_in_order"] == 0
    assert counters["deltas_off"] == 0
    assert alerts == []
    assert float(result["within_bound"]) >= 0.99
