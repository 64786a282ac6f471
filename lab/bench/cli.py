"""``refinery bench [--quick|--smoke] [--json FILE] [--only NAME,...]``: the benchmark suite.

Every figure the project's goals name, measured side by side in one run on this machine, with
its goal and the ratio it exists to measure, plus library versions and machine facts. Results
(a markdown table) on stdout, progress on stderr, JSON to ``--json FILE`` for comparison across
commits. Starts a local broker on free ports unless ``REFINERY_BOOTSTRAP_SERVERS`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.bench import lake_s3
from lab.bench.figures import GoalOp
from services.settings import KafkaSettings, RefinerySettings

BENCHMARKS = (
    "worker_throughput",
    "refine_memory",
    "clock",
    "freshness",
    "lake",
    "lake_s3",
    "exporter",
    "alert_latency",
    "alert_accuracy",
    "alert_accuracy_loaded",
    "sasl",
    "ingest",
    "ingest_worker",
    "detect_stage",
    "stages",
)
NEEDS_KAFKA = {
    "stages",
    "worker_throughput",
    "freshness",
    "alert_latency",
    "alert_accuracy",
    "alert_accuracy_loaded",
    "ingest_worker",
}
# benchmarks measured by one shared run
SHARED_RUN = {n: ("freshness", "alert_latency") for n in ("freshness", "alert_latency")}
# alerting at half load (the freshness run): Minder (NSDI '25) reacts in 3.6 s on average
HALF_LOAD_ALERT_GOALS: dict[str, tuple[GoalOp, float]] = {
    "alert_p99_s": ("<=", 2.0),
    "straggler_with_cause_p99_s": ("<=", 3.0),
}


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark runs."""

    samples: int  # worker_throughput preload
    memory_sources: int  # x 1000 series
    clock_sources: int
    pipeline_s: int  # freshness + alert_latency run
    incidents_per_kind: int
    lake_rows: int
    scrapes: int
    worker_timeout_s: float
    accuracy_s: int  # alert_accuracy run, simulated = wall seconds
    pipeline_rate_cap: float | None = None  # bound on the worker rate the freshness run halves
    # the worker-alone freshness run at 0.5 s spread (its maximum rate measured first): two
    # minutes more, left out of the smoke run
    all_intervals: bool = True
    # the lake's small-file penalty: nodes, seconds landed in 2 s flushes, timed repeats
    lake_penalty: tuple[int, int, int] = (128, 900, 2)
    # ingest adapters: CPU seconds of each decode rate, messages of each in-process refine
    # rate and of each worker backlog (one-line formats: ten times as many; 0: not run)
    ingest: tuple[float, int, int] = (2.0, 400, 600)
    # detect_stage: node counts replayed in-process, seconds simulated each
    detect: tuple[tuple[int, ...], int] = ((24, 96, 384), 30)
    # stages: node counts each stage drains as a process, seconds simulated each
    stages: tuple[tuple[int, ...], int] = ((32, 128), 30)
    # the backlog (nodes, seconds) the pipeline drains for the freshness run's load
    pipeline_capacity: tuple[int, int] = (32, 30)

    @classmethod
    def of(cls, mode: str) -> Sizes:
        if mode == "smoke":  # every figure once, at sizes too small to mean much (CI)
            return cls(
                150_000, 20, 10, 15, 1, 20_000, 5, 60.0, 25, 60_000.0, False, (8, 60, 1),
                (0.2, 40, 0), ((8, 16, 32), 8), ((4, 8), 5), (8, 8),
            )  # fmt: skip
        if mode == "quick":
            return cls(
                900_000, 250, 40, 30, 1, 100_000, 20, 60.0, 60, lake_penalty=(16, 300, 3),
                ingest=(1.0, 200, 300), detect=((24, 96, 192), 20), stages=((16, 64), 20),
            )  # fmt: skip
        return cls(8_000_000, 1000, 300, 60, 2, 2_000_000, 200, 300.0, 360)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark suite: every goal's figure and ratio, side by side, with versions",
        description=(__doc__ or "").split("\n\n", 1)[1].strip(),
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (about 6 minutes)")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: checks that every benchmark runs and reports its figures (the "
        "figures themselves mean little at this size)",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument(
        "--render",
        metavar="FILE",
        nargs="+",
        help="run nothing: print the docs/performance.md page for the JSON of an earlier run "
        "(several: one page, a later run's benchmarks replacing an earlier one's)",
    )
    p.add_argument(
        "--sizing",
        metavar="FILE",
        help="run nothing: write the capacity plan computed from the JSON of an earlier run "
        "(its stages and lake figures) into docs/operations.md",
    )
    p.add_argument(
        "--only", metavar="NAME,...", help=f"run only these benchmarks ({', '.join(BENCHMARKS)})"
    )
    p.add_argument(
        "--keep-topics",
        action="store_true",
        help="with REFINERY_BOOTSTRAP_SERVERS: keep the run's topics and consumer groups "
        "(deleted at the end by default; the local broker is always removed whole)",
    )
    p.set_defaults(handler=run)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_sizing(path: Path, doc_path: Path = Path("docs/operations.md")) -> int:
    from lab.bench.doc import BenchDocError, load
    from lab.bench.sizing import sizing_block, write_block

    try:
        block = sizing_block(load(path))
    except BenchDocError as e:
        _say(f"refinery bench: {e}")
        return 2
    if block is None:
        _say(f"refinery bench: {path} has no stages figures (run with --only stages,lake)")
        return 2
    try:
        write_block(doc_path, block)
    except (OSError, ValueError) as e:
        _say(f"refinery bench: {e}")
        return 2
    _say(f"refinery bench: capacity plan written into {doc_path}")
    return 0


def _selected(only: str | None) -> list[str]:
    if not only:
        return list(BENCHMARKS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"--only: unknown benchmark(s) {', '.join(unknown)}")
    return [n for n in BENCHMARKS if n in names]


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from lab.bench.figures import BenchResult, markdown_table
    from lab.bench.harness import BenchKafka
    from lab.bench.machine import run_facts

    if args.render:
        from lab.bench.doc import BenchDocError, load, merge, render

        try:
            print(render(merge([load(Path(f)) for f in args.render])), end="")
        except BenchDocError as e:
            _say(f"refinery bench: {e}")
            return 2
        return 0
    if args.sizing:
        return _write_sizing(Path(args.sizing))
    names = _selected(args.only)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = Sizes.of(mode)
    results: dict[str, BenchResult] = {}
    broker: Any = None
    with tempfile.TemporaryDirectory(prefix="refinery-bench-") as tmp:
        work = Path(tmp)
        kafka: KafkaSettings | None = None
        k: BenchKafka | None = None
        broker_version = "not used"
        try:
            if NEEDS_KAFKA & set(names):
                if os.environ.get("REFINERY_BOOTSTRAP_SERVERS"):
                    kafka = settings.kafka()
                    broker_version = f"external cluster (local default {settings.kafka_version})"
                    _say(f"bench: using Kafka at {kafka.bootstrap_servers}")
                else:
                    from lab.broker import LocalKafka

                    _say("bench: starting a local Kafka broker on free ports…")
                    broker = LocalKafka(work / "broker", version=settings.kafka_version)
                    state = broker.start(nodes=1, base_port=0)
                    kafka = KafkaSettings(bootstrap_servers=state.bootstrap)
                    broker_version = settings.kafka_version
            facts = run_facts(broker_version, kafka.bootstrap_servers if kafka else "", mode)
            k = BenchKafka(kafka, work, _say) if kafka is not None else None
            for name, fn in _plan(names, sizes, k, results):
                if name in results:  # produced by an earlier step (the shared pipeline run)
                    _say(f"bench: {name}: measured in the same run as {SHARED_RUN[name][0]}")
                    continue
                _say(f"bench: {name} …")
                t0 = time.monotonic()
                try:
                    for r in fn():
                        r.seconds = time.monotonic() - t0
                        results[r.name] = r
                except Exception as e:  # one failing benchmark must not hide the others
                    for n in SHARED_RUN.get(name, (name,)):
                        if n in names:
                            first = (str(e).splitlines() or [""])[0][:200]
                            results[n] = BenchResult(n, error=f"{type(e).__name__}: {first}")
                            results[n].details["error_full"] = str(e)
                    traceback.print_exc(file=sys.stderr)
                finally:
                    if k is not None:
                        k.stop_all()
                _say(f"bench: {name} done in {time.monotonic() - t0:.0f}s")
        finally:
            if broker is not None:
                broker.stop()
            elif k is not None and not args.keep_topics:
                try:
                    topics, groups = k.delete_created()
                    _say(f"bench: deleted this run's {topics} topics and {groups} groups")
                except Exception as e:  # the figures stand; say what is left behind
                    _say(f"bench: could not delete this run's topics ({e}); their prefixes: "
                         f"{', '.join(k.prefixes)}")  # fmt: skip
    ordered = [results[n] for n in names if n in results]
    doc = {**facts, "benchmarks": {r.name: r.as_dict() for r in ordered}}
    print(_header(facts))
    print(markdown_table(ordered))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        _say(f"bench: JSON written to {args.json}")
    return 1 if any(r.error for r in ordered) else 0


Step = Callable[[], list[Any]]


def _plan(
    names: list[str], sizes: Sizes, k: Any, results: dict[str, Any]
) -> list[tuple[str, Step]]:
    """(name, thunk) in order; a thunk returns one or more BenchResults."""
    from lab.bench import local

    def worker_rate() -> float | None:
        """The worker's measured maximum: its steady-state rate if measured, else its rate
        over the whole run."""
        r = results.get("worker_throughput")
        got = {f.name: float(f.value) for f in (r.figures if r is not None else [])}
        return got.get("worker_steady_samples_per_s", got.get("worker_samples_per_s"))

    def cadence_rate(interval_ns: int, substeps: int) -> float | None:
        """The worker's maximum (steady) rate on a backlog whose exporters publish every
        ``interval_ns``: smaller records cost more per sample, so each cadence's half load
        is half its own maximum, not half the 1 s one."""
        from lab.bench.throughput import bench_worker_throughput

        r = bench_worker_throughput(
            k,
            sizes.samples // 2,
            timeout=sizes.worker_timeout_s,
            interval_ns=interval_ns,
            substeps=substeps,
            compare=False,
        )
        got = {f.name: float(f.value) for f in r.figures}
        got_rate = got.get("worker_steady_samples_per_s", got.get("worker_samples_per_s"))
        if got_rate is not None and sizes.pipeline_rate_cap is not None:
            got_rate = min(got_rate, sizes.pipeline_rate_cap)
        return got_rate

    def pipeline() -> list[Any]:
        """Freshness at half load: half the lower of the worker's measured maximum and the
        whole pipeline's (worker, detect and lander draining a backlog together, sharing
        this machine's cores with the broker, as the run does); above the pipeline's
        maximum the run measures a growing backlog, not the path. Alert latency also in a
        run of its own at the floor load (8 nodes). The floor run's freshness is reported
        next to the other, and the half-load run's alert latency next to the floor run's."""
        from lab.bench.harness import S
        from lab.bench.latency import bench_pipeline, bench_worker_freshness

        out = []
        rate = worker_rate()
        if rate is not None and sizes.pipeline_rate_cap is not None:
            rate = min(rate, sizes.pipeline_rate_cap)
        half_alert = None
        if "freshness" in names:
            from lab.bench.capacity import pipeline_max_rate

            whole = pipeline_max_rate(k, *sizes.pipeline_capacity).samples_per_s
            load_of = whole if rate is None else min(rate, whole)
            fresh, half_alert = bench_pipeline(
                k, load_of, sizes.pipeline_s, sizes.incidents_per_kind
            )
            what = ("worker, detect and lander draining a published backlog together; half "
                    "of it, or of the worker's own maximum if lower, is the load")  # fmt: skip
            fresh.add("pipeline_max_samples_per_s", whole, "samples/s", note=what)
            out.append(fresh)
            # the worker alone: (publish interval, GPU/NIC samples each, label, phases
            # spread); all nodes at once every 1 s and every 0.2 s, then each node at a phase
            # of its own every 1 s and every 0.5 s (GPU/NIC at 10 Hz), and every 1 s with one
            # reading per series (each exporter sends what it just read, as `refinery export
            # node` does). Each cadence runs at half the worker's maximum measured at it.
            runs = [
                (S, 10, "worker_alone", False, True),
                (S // 5, 2, "worker_alone_200ms", False, True),
                (S, 10, "worker_alone_spread", True, True),
                (S // 2, 5, "worker_alone_spread_500ms", True, sizes.all_intervals),
                (S, 1, "worker_alone_scrape_1s", True, sizes.all_intervals),
            ]
            own_max: dict[tuple[int, int], float | None] = {(S, 10): rate}
            for interval, substeps, label, spread, wanted in runs:
                if not wanted:
                    continue
                if (interval, substeps) not in own_max:  # measured first; none: the floor load
                    own_max[interval, substeps] = (
                        cadence_rate(interval, substeps) if rate is not None else None
                    )
                cadence = own_max[interval, substeps]
                if (interval, substeps) != (S, 10) and cadence is not None:
                    fresh.add(f"{label}_max_samples_per_s", cadence, "samples/s",
                              note=f"the worker's steady rate on a backlog published every "
                              f"{interval / S:g}s, {substeps} GPU/NIC readings a series each: "
                              "half of it is this run's load")  # fmt: skip
                bench_worker_freshness(
                    k, cadence, sizes.pipeline_s, fresh, interval, substeps, label, spread
                )
            if "alert_latency" in names and rate is None:
                return [fresh, half_alert]
        if "alert_latency" in names:
            floor_fresh, alert = bench_pipeline(k, None, sizes.pipeline_s, sizes.incidents_per_kind)
            out.append(alert)
            for f in half_alert.figures if half_alert is not None else []:
                if f.name in (
                    "alert_p99_s",
                    "straggler_with_cause_p99_s",
                    "incidents_without_alert",
                ):
                    op, goal = HALF_LOAD_ALERT_GOALS.get(f.name, (None, None))
                    alert.add(f"half_load_{f.name}", f.value, f.unit, op, goal,
                              note=f"freshness run: {f.note or ''}".strip())  # fmt: skip
            if out[0] is not alert:
                for f in floor_fresh.figures:
                    if f.name in ("refined_p99_s", "duckdb_p99_s", "publish_samples_per_s"):
                        out[0].add(f"floor_load_{f.name}", f.value, f.unit, f.op, f.goal,
                                   note=f"alert_latency run: {f.note or ''}".strip())  # fmt: skip
        return out

    def throughput() -> list[Any]:
        from lab.bench.throughput import bench_worker_throughput

        return [bench_worker_throughput(k, sizes.samples, timeout=sizes.worker_timeout_s)]

    def accuracy() -> list[Any]:
        from lab.bench.accuracy import bench_alert_accuracy

        return [bench_alert_accuracy(k, sizes.accuracy_s)]

    def accuracy_loaded() -> list[Any]:
        from lab.bench.accuracy_loaded import bench_accuracy_loaded

        capacity = (16, 10) if sizes.samples < 500_000 else (32, 30)  # smoke: small
        seconds = min(sizes.accuracy_s, 180)
        return [bench_accuracy_loaded(k, worker_rate(), seconds, capacity=capacity)]

    def ingest() -> list[Any]:
        from lab.bench.ingest import bench_ingest

        return [bench_ingest(sizes.ingest[0], sizes.ingest[1])]

    def ingest_worker() -> list[Any]:
        from lab.bench.ingest_worker import bench_ingest_worker

        return [bench_ingest_worker(k, sizes.ingest[2])]

    def detect_stage() -> list[Any]:
        from lab.bench.detect_stage import bench_detect_stage

        with tempfile.TemporaryDirectory(prefix="refinery-detect-stage-") as tmp:
            return [bench_detect_stage(Path(tmp), *sizes.detect)]

    def stages() -> list[Any]:
        from lab.bench.stages import bench_stages

        return [bench_stages(k, *sizes.stages)]

    steps: dict[str, Step] = {
        "worker_throughput": throughput,
        "refine_memory": lambda: [local.bench_refine_memory(sizes.memory_sources)],
        "clock": lambda: [local.bench_clock(sizes.clock_sources)],
        "freshness": pipeline,
        "lake": lambda: [local.bench_lake(sizes.lake_rows, penalty=sizes.lake_penalty)],
        "lake_s3": lambda: [lake_s3.bench_sized(sizes.lake_rows)],  # ~3 min quick
        "exporter": lambda: [local.bench_exporter(sizes.scrapes)],
        "alert_latency": pipeline,
        "alert_accuracy": accuracy,
        "alert_accuracy_loaded": accuracy_loaded,
        "sasl": lambda: [local.bench_sasl(quick=sizes.samples < 1_000_000)],
        "ingest": ingest,
        "ingest_worker": ingest_worker,
        "detect_stage": detect_stage,
        "stages": stages,
    }
    return [(n, steps[n]) for n in names]


def _header(facts: dict[str, Any]) -> str:
    m, v = facts["machine"], facts["versions"]
    return (
        f"refinery bench ({facts['mode']}) {facts['date']} commit {facts['commit']}\n"
        f"machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), "
        f"{m['ram_gib']} GiB RAM, load {m['loadavg_at_start']}\n"
        f"versions: {', '.join(f'{k} {val}' for k, val in v.items())}\n"
    )
