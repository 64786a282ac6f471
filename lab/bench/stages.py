"""Each stage alone, as deployed: samples per CPU-second, peak RSS and its growth per node,
and what a second replica costs — the figures the capacity plan (:mod:`lab.bench.sizing`) is
computed from.

Per node count a simulated cluster (spread exporters, the demo's faults) is published as a
backlog onto fresh topics. Then, one after the other, the worker refines it, detect reads
what the worker wrote, and the lander lands it: each stage a process (or two, one consumer
group) with the broker on the same cores, measured from its start to the moment its group
has committed everything, less what one process of the stage spends starting up and joining
on empty topics (``CPU-s``: user + system of its processes; ``peak RSS``: the largest
``VmHWM`` of its processes). The second replica runs at the largest node
count under a new group on the same input: on this machine's two cores it cannot run faster,
so its figure is CPU-seconds per million samples against one replica's (the goal: within
10 %); wall-clock throughput is reported too. Sizes of the raw and refined records give
the broker's bytes per sample.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lab.bench.figures import BenchResult, GoalOp
from lab.bench.harness import BenchKafka, S, process_cpu_s, records, sim_topics
from lab.bench.pipeline_procs import LANDED
from lab.demo.procs import Child, worker_args
from lab.demo.run import FAULTS
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish

RAW = ("telemetry.raw", "telemetry.events", "telemetry.collectives")
DERIVED = ("telemetry.refined", "telemetry.events.aligned", "telemetry.collectives.aligned",
           "telemetry.accounting")  # fmt: skip


@dataclass(frozen=True)
class StageRun:
    stage: str
    nodes: int
    replicas: int
    samples: int
    cpu_s: float
    wall_s: float
    peak_rss_mib: float  # the largest of its processes

    @property
    def samples_per_cpu_s(self) -> float:
        return self.samples / self.cpu_s if self.cpu_s > 0 else float("nan")

    @property
    def cpu_s_per_million(self) -> float:
        return self.cpu_s / (self.samples / 1e6) if self.samples else float("nan")


def peak_rss_mib(pid: int) -> float:
    """``VmHWM`` of ``pid`` in MiB (NaN when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _args(stage: str, prefix: str, group: str, i: int, workdir: Path) -> list[str]:
    if stage == "worker":
        args = worker_args(prefix, workdir / f"{group}-{i}")
        args[args.index("--app-id") + 1] = group
        return args
    if stage == "detect":
        return ["detect", "--topic-prefix", prefix, "--group", group,
                "--data-dir", str(workdir / f"{group}-{i}")]  # fmt: skip
    topics = [f"{prefix}{t}={d}" for t, d in LANDED]
    return ["land", "--group", group, "--instance-id", f"{group}-{i}", "--max-age", "2",
            "--topics", *topics]  # fmt: skip


def run_stage(
    k: BenchKafka,
    stage: str,
    prefix: str,
    replicas: int,
    nodes: int,
    samples: int,
    idle: tuple[float, float] = (0.0, 0.0),
) -> StageRun:
    """Run ``replicas`` processes of ``stage`` under a fresh group over the backlog of
    ``prefix`` until the group has committed all of its input; from their start, less
    ``idle`` (CPU-s of each process, wall s: :func:`idle_start`), so that the figures are
    the work of draining, whenever it began."""
    group = f"{prefix}{stage}-x{replicas}-{time.monotonic_ns() % 10**6}"
    inputs = {"worker": RAW, "detect": DERIVED,
              "land": tuple(t for t, _ in LANDED)}[stage]  # fmt: skip
    topics = [prefix + t for t in inputs]
    lake = k.workdir / f"{group}-lake" if stage == "land" else None
    kids = [k.start(f"{group}-{i}", _args(stage, prefix, group, i, k.workdir), lake=lake)
            for i in range(replicas)]  # fmt: skip
    t0 = time.monotonic()
    try:
        k.wait(f"{stage} joins", lambda: k.joined(group), 120, kids)
        k.wait(f"{stage} drains", lambda: k.lag(group, topics) == 0, 900, kids)
        wall, cpu = time.monotonic() - t0, _cpu(kids)
        rss = max(peak_rss_mib(c.proc.pid) for c in kids)
    finally:
        for c in kids:
            c.stop(60)
    cpu, wall = max(cpu - replicas * idle[0], 1e-3), max(wall - idle[1], 1e-3)
    return StageRun(stage, nodes, replicas, samples, cpu, wall, rss)


def idle_start(k: BenchKafka, stage: str, prefix: str) -> tuple[float, float]:
    """CPU-s and wall s of one ``stage`` process from its start until its group is joined
    on topics without records, plus the 2 s a drained group is polled at most."""
    group = f"{prefix}{stage}-idle"
    kid = k.start(group, _args(stage, prefix, group, 0, k.workdir),
                  lake=k.workdir / f"{group}-lake" if stage == "land" else None)  # fmt: skip
    t0 = time.monotonic()
    try:
        k.wait(f"{stage} joins", lambda: k.joined(group), 120, [kid])
        time.sleep(2.0)
        return _cpu([kid]), time.monotonic() - t0
    finally:
        kid.stop(60)


def _cpu(kids: list[Child]) -> float:
    return sum(process_cpu_s(c.proc.pid) or 0.0 for c in kids)


def publish_backlog(k: BenchKafka, nodes: int, seconds: int, seed: int) -> tuple[str, int]:
    """A fresh prefix with ``nodes`` x ``seconds`` published as a backlog; (prefix, samples)."""
    prefix = k.fresh_topics()
    sim = Simulation(Cluster.build(nodes, seed=seed), FAULTS, seed=seed,
                     duration_ns=seconds * S, spread=True)  # fmt: skip
    rep = publish(sim, k.kafka, sim_topics(prefix), None, speed=0, progress_cb=None)
    if rep.unacked:
        raise RuntimeError(f"{rep.unacked} backlog messages not acknowledged")
    return prefix, rep.samples_acked


def topic_bytes(k: BenchKafka, topic: str) -> int:
    """Key and value bytes of every record of ``topic``."""
    from lab.demo.procs import end_offsets

    total = sum(end_offsets(k.conf, [topic]).values())
    return sum(len(m.value() or b"") + len(m.key() or b"")
               for m in records(k.conf, topic, lambda n: n >= total, 120))  # fmt: skip


def measure_stages(
    k: BenchKafka, node_counts: tuple[int, ...] = (16, 64), seconds: int = 20, seed: int = 41
) -> dict[str, Any]:
    """Every stage at each node count with one replica, then two at the largest; with the
    broker's bytes per sample. The figures as a JSON-able dict (``runs`` holds each run)."""
    runs: list[StageRun] = []
    wire: dict[str, float] = {}
    empty = k.fresh_topics()
    idle = {stage: idle_start(k, stage, empty) for stage in ("worker", "detect", "land")}
    k.say(f"  stages: start-up to joined, CPU-s and wall s: {idle}")
    for n in node_counts:
        prefix, samples = publish_backlog(k, n, seconds, seed)
        k.say(f"  stages: {n} nodes, {samples:,} samples published")
        # a second worker group writes the refined topics again: it runs last
        plan = [("worker", 1), ("detect", 1), ("land", 1)]
        if n == node_counts[-1]:
            plan = [("worker", 1), ("detect", 1), ("detect", 2), ("land", 1), ("land", 2),
                    ("worker", 2)]  # fmt: skip
        for stage, replicas in plan:
            runs.append(run_stage(k, stage, prefix, replicas, n, samples, idle[stage]))
            k.say(f"  stages: {runs[-1]}")
            if (stage, replicas) == ("land", 2):  # the refined topics as one worker wrote them
                for t in ("telemetry.raw", "telemetry.refined", "telemetry.accounting"):
                    wire[t] = topic_bytes(k, prefix + t) / samples
    per_node_s = samples / (node_counts[-1] * seconds)
    return {"runs": [asdict(r) for r in runs], "bytes_per_sample": wire, "seconds": seconds,
            "samples_per_node_s": per_node_s, "idle_start": idle}  # fmt: skip


def stage_figures(m: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per stage: samples per CPU-s (one replica, largest size), RSS at the smallest and
    largest size and its growth per node, a second replica's CPU-s per million against one's
    and its wall-clock speed-up."""
    runs = [StageRun(**r) for r in m["runs"]]
    out: dict[str, dict[str, float]] = {}
    for stage in ("worker", "detect", "land"):
        one = sorted((r for r in runs if r.stage == stage and r.replicas == 1),
                     key=lambda r: r.nodes)  # fmt: skip
        two = [r for r in runs if r.stage == stage and r.replicas == 2]
        lo, hi = one[0], one[-1]
        grow = (hi.peak_rss_mib - lo.peak_rss_mib) / (hi.nodes - lo.nodes) if hi is not lo else 0
        f = {"samples_per_cpu_s": hi.samples_per_cpu_s, "rss_mib_small": lo.peak_rss_mib,
             "rss_mib_large": hi.peak_rss_mib, "rss_mib_per_node": grow,
             "nodes_small": lo.nodes, "nodes_large": hi.nodes}  # fmt: skip
        if two:
            f["two_replicas_cpu_ratio"] = two[0].cpu_s_per_million / hi.cpu_s_per_million
            f["two_replicas_speedup"] = hi.wall_s / two[0].wall_s
        out[stage] = f
    return out


def bench_stages(
    k: BenchKafka, node_counts: tuple[int, ...] = (16, 64), seconds: int = 20
) -> BenchResult:
    """The ``stages`` benchmark: :func:`measure_stages` as figures, the runs in details
    (what ``lab.bench.sizing`` plans from)."""
    r = BenchResult("stages")
    m = measure_stages(k, node_counts, seconds)
    figs = stage_figures(m)
    drain = f"one process draining a {node_counts[-1]}-node backlog (group joined to drained)"
    for stage, f in figs.items():
        det = stage == "detect"
        rate_goal: tuple[GoalOp | None, float | None] = (">=", 1e6) if det else (None, None)
        rss_goal: tuple[GoalOp | None, float | None] = ("<=", 1.0) if det else (None, None)
        r.add(f"{stage}_samples_per_cpu_s", f["samples_per_cpu_s"], "samples/CPU-s",
              *rate_goal, note=drain)  # fmt: skip
        r.add(f"{stage}_rss_mib_per_node", f["rss_mib_per_node"], "MiB/node", *rss_goal,
              note=f"peak RSS {f['rss_mib_small']:.0f} MiB at {f['nodes_small']:.0f} nodes, "
              f"{f['rss_mib_large']:.0f} MiB at {f['nodes_large']:.0f}")  # fmt: skip
        if "two_replicas_cpu_ratio" in f:
            r.add(f"{stage}_two_replicas_cpu_ratio", f["two_replicas_cpu_ratio"], "x", "<=", 1.1,
                  note="CPU-s per million samples: two replicas in a group / one")  # fmt: skip
            r.add(f"{stage}_two_replicas_speedup", f["two_replicas_speedup"], "x",
                  note="wall time of one / of two, both on this machine's cores")  # fmt: skip
    for t, b in m["bytes_per_sample"].items():
        r.add(f"wire_bytes_per_sample_{t.split('.')[-1]}", b, "B/sample", note=t)
    r.details["stages"] = m
    return r
