"""``refinery demo``: the whole mission on one machine, end to end.

Starts a local broker (unless ``REFINERY_BOOTSTRAP_SERVERS`` is set), applies the topics
under a fresh prefix, starts the refining worker, the detect service and the lake lander,
publishes a simulated cluster with a PFC storm, a throttling GPU, an XID, clock skew,
duplicates and malformed records (topology and job placement first), waits until every stage
has caught up, stops everything it started (also on Ctrl-C) and prints what the lake says:
the accounting, the alerts with their causes and the top findings of the named queries; last,
the lake compared with the simulator's truth (:mod:`lab.verify`), whose goals decide the
exit status.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lab.demo.procs import (
    Child,
    end_offsets,
    group_lag,
    lag_by_topic,
    spawn,
    wait_until,
    worker_args,
)
from services.cli_parts import print_json
from services.lake.datasets import TOPIC_DATASETS
from services.settings import KafkaSettings, RefinerySettings

FAULTS = "pfc_storm:count=1,throttle:count=1,xid:count=1,clock,dup,malformed"


@dataclass(frozen=True)
class DemoOptions:
    nodes: int = 32
    gpus: int = 8
    nics: int = 8
    cpus: int = 32
    duration_s: int = 60
    seed: int = 7
    faults: str = FAULTS
    lake: Path = Path("lake")
    report: Path | None = None
    workers: int = 1
    detects: int = 1
    landers: int = 1
    kill: bool = False  # kill -9 one process of each stage mid-run, then start it again
    s3: bool = False  # the lake on a local S3-compatible server (s3proxy) instead of a directory


def run_demo(
    opts: DemoOptions, settings: RefinerySettings, say: Callable[[str], None]
) -> dict[str, Any]:
    """Run the demo; returns the summary (also what ``--json`` prints). Raises on failure
    after stopping everything it started."""
    from lab.broker import LocalKafka

    started_broker: LocalKafka | None = None
    started_s3: Any = None
    children: list[Child] = []
    fleet: Fleet | None = None
    t0 = time.monotonic()
    try:
        if os.environ.get("REFINERY_BOOTSTRAP_SERVERS"):
            kafka = settings.kafka()
            say(f"using Kafka at {kafka.bootstrap_servers}")
        else:
            started_broker = LocalKafka(
                settings.home / "demo-broker", version=settings.kafka_version
            )
            say("starting a local Apache Kafka broker (KRaft, 127.0.0.1)…")
            state = started_broker.start(nodes=1, base_port=0, progress=True)
            kafka = KafkaSettings(bootstrap_servers=state.bootstrap)
            say(f"broker ready at {state.bootstrap} ({time.monotonic() - t0:.1f}s)")
        conf = kafka.librdkafka()
        prefix = f"demo{uuid.uuid4().hex[:6]}."
        from services.topics import apply_topics, load_topic_specs

        changes = apply_topics(conf, load_topic_specs(prefix=prefix))
        say(f"topics: {len(changes)} created under prefix {prefix!r}")

        env = {
            "REFINERY_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "REFINERY_LAKE": str(opts.lake.resolve()),
            "REFINERY_HOME": str(settings.home),
        }
        if opts.s3:
            started_s3, lake_env = _start_s3(settings.home, prefix, say)
            env |= lake_env
            os.environ.update(lake_env)  # this process reads the lake too (summary, verify)
            opts = replace(opts, lake=Path(lake_env["REFINERY_LAKE"]))
        logdir = settings.home / "demo-logs"
        land_topics = [f"{prefix}{t}={d}" for t, d in TOPIC_DATASETS.items()]
        fleet = Fleet(env, logdir, _stage_args(prefix, settings.home, land_topics))
        fleet.start("worker", opts.workers)
        fleet.start("detect", opts.detects)
        fleet.start("land", opts.landers)
        children = fleet.children
        say(f"{opts.workers} worker(s), {opts.detects} detect replica(s) and {opts.landers} "
            f"lander(s) started (logs in {logdir})")  # fmt: skip
        wait_until(
            "the worker joins its group",
            lambda: _joined(conf, prefix + "worker"),
            90,
            children,
            say,
        )

        from lab.simulate.cluster import Cluster
        from lab.simulate.engine import Simulation
        from lab.simulate.publish import Topics, publish

        truth = settings.home / "demo-truth" / "truth.parquet"
        truth.parent.mkdir(parents=True, exist_ok=True)
        sim = Simulation(
            Cluster.build(
                opts.nodes, gpus=opts.gpus, nics=opts.nics, seed=opts.seed, cpus=opts.cpus
            ),
            opts.faults,
            seed=opts.seed,
            duration_ns=opts.duration_s * 1_000_000_000,
        )
        say(
            f"simulating {opts.nodes} nodes x {opts.gpus} GPUs x {opts.nics} NICs for "
            f"{opts.duration_s}s with faults: {opts.faults}"
        )
        topics = Topics(
            *(
                prefix + t
                for t in (
                    "telemetry.raw",
                    "telemetry.events",
                    "telemetry.collectives",
                    "topology",
                    "jobs",
                )
            )
        )
        chaos = _Chaos(fleet, say, opts.kill)
        rep = publish(
            sim,
            kafka,
            topics,
            truth,
            speed=1.0,
            progress_cb=chaos.report,
            progress_every_s=5.0 if opts.kill else 10.0,
        )
        if rep.unacked:
            raise RuntimeError(f"{rep.unacked} messages were not acknowledged by Kafka")
        say(f"published {rep.messages_acked} messages / {rep.samples_acked} samples")

        inputs = [
            prefix + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")
        ]
        wait_until(
            "the worker refines the backlog",
            lambda: group_lag(conf, prefix + "worker", inputs) == 0,
            180,
            fleet.children,
            say,
            detail=lambda: _lag_text(conf, prefix + "worker", inputs, prefix),
        )
        derived_in = [
            prefix + t
            for t in (
                "telemetry.refined",
                "telemetry.events.aligned",
                "telemetry.collectives.aligned",
            )
        ]
        wait_until(
            "detect catches up",
            lambda: group_lag(conf, prefix + "detect", derived_in) == 0,
            120,
            fleet.children,
            say,
        )
        time.sleep(2)
        for c in fleet.of("detect"):
            c.stop()  # flushes held collectives and open rollup windows
        land_in = [t.split("=")[0] for t in land_topics]
        wait_until(
            "the lake lands everything",
            lambda: group_lag(conf, prefix + "land", land_in) == 0,
            120,
            fleet.of("land") + fleet.of("worker"),
            say,
        )
        for c in fleet.of("land") + fleet.of("worker"):
            c.stop()
        summary_kills = fleet.kills
        say(f"pipeline drained in {time.monotonic() - t0:.0f}s; reading the lake…")
        summary = summarize(opts.lake, rep.as_dict(), _incidents(truth))
        summary["lake"] = env["REFINERY_LAKE"]  # a directory, or s3://bucket/prefix
        summary["prefix"] = prefix
        summary["seconds"] = round(time.monotonic() - t0, 1)
        summary["raw_end_offsets"] = sum(end_offsets(conf, inputs).values())
        summary["processes"] = {"worker": opts.workers, "detect": opts.detects,
                                "land": opts.landers, "killed": summary_kills}  # fmt: skip
        from lab.verify.verdict import render as render_verdict
        from lab.verify.verdict import verify

        verdict = verify(opts.lake, truth)
        summary["verify"] = verdict.as_dict()
        summary["verify_text"] = render_verdict(verdict)
        return summary
    finally:
        for c in fleet.children if fleet is not None else children:
            if c.alive():
                c.stop(30)
        if started_broker is not None:
            started_broker.stop()
        if started_s3 is not None:
            started_s3.stop()


def _start_s3(home: Path, prefix: str, say: Callable[[str], None]) -> tuple[Any, dict[str, str]]:
    """A local s3proxy (``refinery s3``'s) and the environment of a lake under ``prefix`` on
    it."""
    from lab.s3 import LocalS3

    s3 = LocalS3(home / "demo-s3")
    say("starting a local S3-compatible server (s3proxy, 127.0.0.1)…")
    st = s3.start(progress=True)
    lake_env = st.env(prefix=prefix.rstrip("."))
    say(f"lake on {lake_env['REFINERY_LAKE']} at {st.endpoint}")
    return s3, lake_env


def _stage_args(prefix: str, home: Path, land_topics: list[str]) -> dict[str, Any]:
    """Per stage, the arguments of its ``i``-th process."""
    return {
        "worker": lambda i: worker_args(prefix, home / f"demo-worker-{i}"),
        "detect": lambda i: ["detect", "--topic-prefix", prefix, "--group", prefix + "detect",
                             "--data-dir", str(home / f"demo-detect-{i}")],
        "land": lambda i: ["land", "--group", prefix + "land", "--instance-id", f"demo-{i}",
                           "--max-age", "2", "--topics", *land_topics],
    }  # fmt: skip


class Fleet:
    """The demo's processes by stage; one of a stage can be killed -9 and started again."""

    def __init__(self, env: dict[str, str], logdir: Path, args: dict[str, Any]) -> None:
        self.env, self.logdir, self.args = env, logdir, args
        self.stages: dict[str, list[Child]] = {}
        self.kills: dict[str, int] = {}

    @property
    def children(self) -> list[Child]:
        return [c for cs in self.stages.values() for c in cs]

    def of(self, stage: str) -> list[Child]:
        return list(self.stages.get(stage, []))

    def start(self, stage: str, n: int) -> None:
        self.stages[stage] = [self._spawn(stage, i) for i in range(n)]

    def _spawn(self, stage: str, i: int) -> Child:
        name = stage if i == 0 else f"{stage}-{i}"
        k = self.kills.get(stage, 0)
        return spawn(name + (f".{k}" if k else ""), self.args[stage](i), self.env, self.logdir)

    def kill9(self, stage: str, i: int = 0) -> None:
        """SIGKILL the ``i``-th process of ``stage`` and start a new one in its place."""
        c = self.stages[stage][i]
        c.proc.kill()
        c.proc.wait(10)
        self.kills[stage] = self.kills.get(stage, 0) + 1
        self.stages[stage][i] = self._spawn(stage, i)


class _Chaos:
    """With ``on``: at the publisher's 3rd, 4th and 5th progress report (every 5 s), kill -9
    the last detect replica, the last lander and the last worker, one per report."""

    def __init__(self, fleet: Fleet, say: Callable[[str], None], on: bool) -> None:
        self.fleet, self.say, self.on, self.reports = fleet, say, on, 0

    def report(self, p: Any) -> None:
        """The publisher's progress report ``p``: say it, then the step's kill if any."""
        self.say("  " + p.line())
        self.reports += 1
        order = {3: "detect", 4: "land", 5: "worker"}
        stage = order.get(self.reports)
        if not self.on or stage is None:
            return
        i = len(self.fleet.stages[stage]) - 1
        self.say(f"  kill -9 {stage} #{i}, started again")
        self.fleet.kill9(stage, i)


def _lag_text(conf: dict[str, Any], group: str, topics: list[str], prefix: str) -> str:
    lag = lag_by_topic(conf, group, topics)
    return ", ".join(f"{t.removeprefix(prefix)} {n:,} behind" for t, n in lag.items())


def _joined(conf: dict[str, Any], group: str) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**conf, "log_level": 3})
    try:
        res = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    except Exception:
        return False
    return str(res.state).endswith("STABLE") and bool(res.members)


def _incidents(truth: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    path = truth.with_name(truth.name + ".incidents.parquet")
    return pq.read_table(path).to_pylist() if path.exists() else []


def summarize(
    lake: Path, published: dict[str, Any], incidents: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the lake says, as plain data."""
    from services.lake.backend import connect_views
    from services.lake.iceberg import IcebergSettings
    from services.lake.sqlload import run_query

    con = connect_views(str(lake), iceberg=IcebergSettings())

    def rows(sql: str) -> list[dict[str, Any]]:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    acc = rows("""SELECT sum(raw_records) AS messages,
                         sum(input_samples) AS input, sum(refined_samples) AS refined,
                         sum(duplicate_samples) AS deduplicated,
                         sum(quarantined_samples) AS quarantined,
                         sum(landed_samples) AS landed, sum(deadletter_samples) AS dead_samples,
                         sum(duplicate_records) AS duplicate_messages,
                         sum(deadletter_records) AS deadletter_messages,
                         bool_and(ok) AS ok
                  FROM lake_accounting""")[0]
    landed = rows("SELECT count(*) AS n FROM samples")[0]["n"]
    out: dict[str, Any] = {
        "published": published,
        "incidents": [
            {
                k: v
                for k, v in i.items()
                if k in ("id", "kind", "node", "device", "switch", "port", "job")
            }
            for i in incidents
        ],
        "accounting": {
            **acc,
            "landed_samples": landed,
            "balanced": bool(acc["ok"])
            and acc["input"] == acc["refined"] + acc["deduplicated"] + acc["quarantined"]
            and landed == acc["refined"],
        },
        "deadletters": rows(
            "SELECT reason, count(*) AS records, sum(samples) AS samples "
            "FROM deadletter GROUP BY ALL ORDER BY 1"
        ),
        "alerts": rows("""SELECT rule, severity, entity, job, summary, cause
                          FROM alerts WHERE state = 'firing'
                          QUALIFY row_number() OVER (PARTITION BY id) = 1
                          ORDER BY starts_ns"""),
        "episodes": rows("""SELECT kind, entity, list_distinct(flatten(list(jobs))) AS jobs,
                                   max_by(cause_hint, emitted_ns) AS cause_hint
                            FROM episodes GROUP BY id, kind, entity ORDER BY min(start_ns)"""),
    }
    for name, params in (
        ("top_congested_links", {"limit": "5"}),
        ("gpu_throttling_by_cause", {}),
        ("stragglers", {"limit": "8"}),
    ):
        rel = run_query(con, name, params)
        names = [d[0] for d in rel.description]
        out[name] = [dict(zip(names, r, strict=True)) for r in rel.fetchall()[:8]]
    return out


def render(summary: dict[str, Any]) -> str:
    """The human-readable summary."""
    a = summary["accounting"]
    lines = [
        "",
        "── accounting (from the lake) " + "─" * 40,
        f"  input {a['input']:,} samples = refined {a['refined']:,} + deduplicated "
        f"{a['deduplicated']:,} + quarantined {a['quarantined']:,}   "
        f"[{'balanced' if a['balanced'] else 'NOT BALANCED'}; landed {a['landed_samples']:,}]",
        f"  {a['messages']:,} raw messages: {a['duplicate_messages']} transport duplicates, "
        f"{a['deadletter_messages']} rejected whole",
    ]
    for d in summary["deadletters"]:
        lines.append(
            f"  dead letters: {d['reason']:<28} {d['records']} record(s), {d['samples']} sample(s)"
        )
    lines.append("── injected (simulator truth) " + "─" * 40)
    for i in summary["incidents"]:
        where = " ".join(str(i[k]) for k in ("node", "device", "switch", "port", "job") if i[k])
        lines.append(f"  {i['kind']:<10} {where}")
    lines.append("── alerts (telemetry.alerts) " + "─" * 41)
    for al in summary["alerts"]:
        cause = f"\n      cause: {al['cause']}" if al["cause"] else ""
        lines.append(
            f"  [{al['severity']}] {al['rule']:<22} {al['entity']:<28} "
            f"{al['job'] or '':<8} {al['summary'][:70]}{cause}"
        )
    lines.append("── episodes (telemetry.episodes) " + "─" * 37)
    for e in summary["episodes"]:
        lines.append(f"  {e['kind']:<11} {e['entity']:<26} jobs={e['jobs']}  {e['cause_hint']}")
    for name in ("top_congested_links", "gpu_throttling_by_cause", "stragglers"):
        lines.append(f"── refinery query {name} " + "─" * max(4, 52 - len(name)))
        rows = summary[name]
        if not rows:
            lines.append("  (no rows)")
        for r in rows[:5]:
            lines.append("  " + "  ".join(f"{k}={_short(v)}" for k, v in list(r.items())[:7]))
    lake = summary["lake"]
    lines += [
        "── explore " + "─" * 59,
        f"  lake: {lake}",
        f'  REFINERY_LAKE={lake} refinery sql -c "SELECT metric, count(*) FROM samples GROUP BY 1"',
        f"  REFINERY_LAKE={lake} refinery query --list",
        f"  duckdb -cmd \"SET VARIABLE lake = '{lake}'\" -init sql/init.sql",
        f"  finished in {summary['seconds']}s",
    ]
    if "verify_text" in summary:
        lines.append(summary["verify_text"])
    return "\n".join(lines)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "…"


def dump_json(summary: dict[str, Any]) -> None:
    print_json(summary)
