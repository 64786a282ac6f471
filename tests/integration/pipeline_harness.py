"""Run the simulator into a real broker with worker processes, then compare what came out
with the simulator's truth (DuckDB over Parquet files of the topics' contents)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from lab.demo.procs import group_lag
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import PublishReport, Topics, publish
from services.settings import KafkaSettings
from tests.integration.worker_helpers import read_all

# The simulator paces sends from Python on a 2-core box shared with the broker and the
# worker: its minimum producer→broker delay is a few ms, not a datacenter's ~1 ms. The
# worker is told so, which is what makes its stated clock error bounds honest here.
WORKER_CLOCK_ARGS = ["--clock-min-delay-ms", "6", "--clock-delay-uncertainty-ms", "6"]


@dataclass
class Run:
    prefix: str
    tmp: Path
    report: PublishReport | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def truth(self) -> Path:
        return self.tmp / "truth.parquet"


def simulate(
    bootstrap: str,
    run: Run,
    nodes: int,
    seconds: int,
    faults: str,
    seed: int,
    during: Callable[[threading.Event], None] | None = None,
) -> None:
    """Publish the simulation at real-time speed; ``during`` runs in this thread meanwhile
    (it gets an Event set when publishing ended)."""
    sim = Simulation(
        Cluster.build(nodes, gpus=8, nics=8, seed=seed, cpus=16),
        faults,
        seed=seed,
        duration_ns=seconds * 1_000_000_000,
    )
    topics = Topics(
        *(
            run.prefix + t
            for t in (
                "telemetry.raw",
                "telemetry.events",
                "telemetry.collectives",
                "topology",
                "jobs",
            )
        )
    )
    done = threading.Event()
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["rep"] = publish(
                sim,
                KafkaSettings(bootstrap_servers=bootstrap),
                topics,
                run.truth,
                speed=1.0,
                progress_cb=None,
            )
        except BaseException as e:  # surfaced below
            box["err"] = e
        finally:
            done.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    if during is not None:
        during(done)
    t.join()
    if "err" in box:
        raise box["err"]
    run.report = box["rep"]
    assert run.report is not None and run.report.unacked == 0


def drain(
    bootstrap: str,
    run: Run,
    group: str,
    timeout: float = 240,
    tail: Callable[[], str] | None = None,
) -> None:
    """Wait until ``group`` has no lag on the inputs; on timeout the assertion carries
    ``tail()`` (the worker's log) so that a slow start can be told from a stall."""
    inputs = [
        run.prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")
    ]
    deadline = time.monotonic() + timeout
    while group_lag({"bootstrap.servers": bootstrap}, group, inputs):
        if time.monotonic() >= deadline:
            raise AssertionError("the worker did not catch up\n" + (tail() if tail else ""))
        time.sleep(1)


def collect(bootstrap: str, run: Run) -> duckdb.DuckDBPyConnection:
    """Dump the output topics to Parquet/JSON and open DuckDB with views over them and the
    truth: truth, sends, refined (every copy), refined_once (one copy per lineage), acc, dl."""
    tables = [
        pa.ipc.open_stream(v).read_all()
        for _, v, _ in read_all(bootstrap, run.prefix + "telemetry.refined", idle=4)
    ]
    pq.write_table(pa.concat_tables(tables), run.tmp / "refined.parquet")
    for topic, name in (("telemetry.accounting", "acc"), ("telemetry.deadletter", "dl")):
        docs = [json.loads(v) for _, v, _ in read_all(bootstrap, run.prefix + topic, idle=4)]
        (run.tmp / f"{name}.json").write_text(json.dumps(docs))
    con = duckdb.connect()
    d = run.tmp
    con.execute(f"CREATE VIEW truth AS SELECT * FROM read_parquet('{d}/truth.parquet')")
    con.execute(
        f"CREATE VIEW sends AS SELECT * FROM read_parquet('{d}/truth.parquet.sends.parquet')"
    )
    con.execute(f"CREATE VIEW refined AS SELECT * FROM read_parquet('{d}/refined.parquet')")
    # a worker killed after publishing but before checkpointing recomputes the same batch:
    # consumers keep one copy per raw position (lineage), as the lake does
    con.execute("""CREATE VIEW refined_once AS SELECT * FROM refined
                   QUALIFY row_number() OVER (PARTITION BY raw_partition, raw_offset, metric,
                                              device, ts_source) = 1""")
    con.execute(f"CREATE VIEW acc AS SELECT * FROM read_json_auto('{d}/acc.json')")
    con.execute(f"CREATE VIEW dl AS SELECT * FROM read_json_auto('{d}/dl.json')")
    return con


def compare(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Lost, duplicated and unexpected samples against the truth, plus timing and joins."""
    key = (
        "r.node = t.node AND r.exporter = t.exporter AND r.instance = t.instance "
        "AND r.boot_id = t.boot_id AND r.seq = t.seq AND r.metric = t.metric "
        "AND r.device = t.device AND r.ts_source = t.ts_source_ns"
    )

    def one(sql: str) -> Any:
        row = con.execute(sql).fetchone()
        assert row is not None
        return row[0]

    out: dict[str, Any] = {}
    out["truth_good"] = one("SELECT count(*) FROM truth WHERE expected_reason IS NULL")
    out["refined_rows"] = one("SELECT count(*) FROM refined_once")
    out["lost"] = one(f"""SELECT count(*) FROM truth t WHERE expected_reason IS NULL
        AND NOT EXISTS (SELECT 1 FROM refined_once r WHERE {key})""")
    out["duplicated"] = one("""SELECT coalesce(sum(n - 1), 0) FROM (
        SELECT count(*) n FROM refined_once GROUP BY node, exporter, instance, boot_id, seq,
               metric, device, ts_source HAVING count(*) > 1)""")
    out["unexpected"] = one(f"""SELECT count(*) FROM refined_once r WHERE NOT EXISTS (
        SELECT 1 FROM truth t WHERE {key} AND t.expected_reason IS NULL)""")
    timing = con.execute(f"""SELECT quantile_cont(abs(r.ts - t.ts_true_ns), [0.5, 0.99]),
            avg((abs(r.ts - t.ts_true_ns) <= r.clock_error_ns)::INT)
        FROM refined_once r JOIN truth t ON {key}""").fetchone()
    assert timing is not None
    out["abs_err_ns_p50_p99"] = timing[0]
    out["within_bound"] = timing[1]
    out["clock_basis"] = dict(
        con.execute("SELECT clock_basis, count(*) FROM refined_once GROUP BY 1").fetchall()
    )
    out["fabric_rows_unexplained"] = one(
        """SELECT count(*) FROM refined_once WHERE (device LIKE 'gpu%' OR device LIKE 'mlx5%')
           AND leaf IS NULL AND nic IS NULL AND enrich_reason IS NULL"""
    )
    out["dup_sends"] = one("SELECT count(*) FROM sends WHERE kind = 'duplicate'")
    out["dup_accounted"] = one("""SELECT count(DISTINCT (raw_partition, raw_offset))
        FROM acc WHERE outcome = 'duplicate'""")
    out["malformed_mismatch"] = one("""SELECT count(*) FROM sends s
        WHERE s.kind = 'malformed'
        AND NOT EXISTS (SELECT 1 FROM dl WHERE dl.partition = s.partition
                        AND dl.offset = s.offset AND dl.reason = s.expected_reason)""")
    out["bad_rows_mismatch"] = one("""SELECT count(*) FROM truth t
        WHERE expected_reason IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM dl WHERE dl.reason = t.expected_reason AND dl.scope = 'samples')
        """)
    return out
