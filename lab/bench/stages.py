"""Each stage alone, as deployed: samples per CPU-second, peak RSS and its growth per node,
and what a second replica costs — the figures the capacity plan (:mod:`lab.bench.sizing`) is
computed from.

Per node count a simulated cluster (spread exporters, the demo's faults) is published as a
backlog onto fresh topics. Then, one after the other, the worker refines it, detect reads
what the worker wrote, and the lander lands it: each stage a process (or two, one consumer
group) with the broker on the same cores. A stage starts on fresh, empty topics; once every
process has joined, its input records are copied in at the pace they were made (the
simulated seconds over as many wall seconds: the cluster's live load, so groups and memory
are those of a live stage, not of a backlog), and it is measured from the copy's start
until its group has committed everything (``CPU-s``: user + system of its processes, so
start-up and rebalances are left out; ``peak RSS``: the largest ``VmHWM`` of its processes).

The second replica runs at the largest node count on the same input. On this machine's two
cores it cannot run faster, so its figure is CPU-seconds per million samples against one
replica's (the goal: within 10 %); the wall-clock speed-up is reported too, and so is what
two processes at once cost this machine on memory-bound work (:mod:`lab.bench.pair_cost`).
Each run also reports the group assignments its processes logged while measured and the
records detect's warm-up re-read (a rebalance mid-run). The sizes of the raw, refined and
accounting records, as zstd stores them, give the broker's bytes per sample.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lab.bench.figures import BenchResult, GoalOp
from lab.bench.harness import BenchKafka, S, end_count, process_cpu_s, records, sim_topics
from lab.bench.pair_cost import pair_cpu_ratio
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
    # what the processes logged while measured: group assignments (a rebalance mid-run) and
    # records re-read by detect's warm-up (state rebuilt for partitions that moved)
    assignments: int = 0
    warmup_records: int = 0

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
    src: str,
    replicas: int,
    nodes: int,
    samples: int,
    over_s: float = 0.0,
    watch: Callable[[list[Child]], Callable[[], None]] | None = None,
) -> tuple[StageRun, str]:
    """``replicas`` processes of ``stage`` under one group on fresh topics: started and
    joined on empty inputs (topology and jobs copied from ``src`` first), then ``src``'s
    input records copied in; measured from the copy's start until the group has committed
    all of them; ``over_s``: the input copied at the pace it was made (see
    :func:`copy_topics`); ``watch``: called with the processes as the copy starts (a
    profiler attached), what it returns when they have drained. Returns the run and the
    fresh prefix (what the stage wrote)."""
    dst = k.fresh_topics()
    copy_topics(k, src, dst, ("topology", "topology.nodes", "jobs"))
    group = f"{dst}{stage}"
    inputs = {"worker": RAW, "detect": DERIVED,
              "land": tuple(t for t, _ in LANDED)}[stage]  # fmt: skip
    lake = k.workdir / f"{group}-lake" if stage == "land" else None
    kids = [k.start(f"{group}-{i}", _args(stage, dst, group, i, k.workdir), lake=lake)
            for i in range(replicas)]  # fmt: skip
    try:
        k.wait(f"{stage} joins", lambda: _members(k, group) == replicas, 180, kids)
        time.sleep(3.0)  # the last joiner's assignment handled
        stop = watch(kids) if watch is not None else None
        t0, cpu0, marks = time.monotonic(), _cpu(kids), [_log_size(c) for c in kids]
        copy_topics(k, src, dst, inputs, over_s)
        k.wait(f"{stage} drains", lambda: k.lag(group, [dst + t for t in inputs]) == 0, 900,
               kids)  # fmt: skip
        wall, cpu = time.monotonic() - t0, _cpu(kids) - cpu0
        if stop is not None:
            stop()
        rss = max(peak_rss_mib(c.proc.pid) for c in kids)
        logged = [_logged_since(c, m) for c, m in zip(kids, marks, strict=True)]
    finally:
        for c in kids:
            c.stop(60)
    assigned, warmed = (sum(x) for x in zip(*logged, strict=True))
    return StageRun(stage, nodes, replicas, samples, cpu, wall, rss, assigned, warmed), dst


_ASSIGNED = re.compile(r"group \S+ assigned ")
_WARMED = re.compile(r"warm-up of \d+ partitions: (\d+) records")


def _log_size(c: Child) -> int:
    try:
        return c.log.stat().st_size
    except OSError:
        return 0


def _logged_since(c: Child, mark: int) -> tuple[int, int]:
    """(assignments, records re-read by warm-ups) that ``c`` logged past byte ``mark``."""
    try:
        with open(c.log, "rb") as f:
            f.seek(mark)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return 0, 0
    warmed = sum(int(m.group(1)) for m in _WARMED.finditer(text))
    return len(_ASSIGNED.findall(text)), warmed


def _reached(total: int) -> Callable[[int], bool]:
    return lambda count: count >= total


def _members(k: BenchKafka, group: str) -> int:
    """Members of ``group`` once it is stable (0 before)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**k.conf, "log_level": 3})
    try:
        res = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    except Exception:  # not there yet, or the coordinator is loading
        return 0
    return len(res.members) if str(res.state).endswith("STABLE") else 0


def copy_topics(
    k: BenchKafka, src: str, dst: str, topics: tuple[str, ...], over_s: float = 0.0
) -> int:
    """Copy every record of ``src + t`` to the same partition of ``dst + t``, for each of
    ``topics`` (key, value, headers); with ``over_s``, each topic's records evenly over that
    many seconds, the topics side by side (as live producers send them). Returns the
    records copied."""
    from confluent_kafka import Producer

    prod = Producer({**k.conf, "linger.ms": 20, "compression.type": "zstd",
                     "enable.idempotence": True, "message.max.bytes": 64 << 20})  # fmt: skip
    totals = {t: end_count(k.conf, src + t) for t in topics}
    feeds = {t: records(k.conf, src + t, _reached(n), 600) for t, n in totals.items() if n}
    sent = dict.fromkeys(feeds, 0)
    t0 = time.monotonic()
    while feeds:
        share = min(1.0, (time.monotonic() - t0) / over_s) if over_s > 0 else 1.0
        for t, feed in list(feeds.items()):
            while sent[t] < totals[t] * share:
                m = next(feed, None)
                if m is None:
                    sent[t] = totals[t]
                    break
                prod.produce(dst + t, m.value(), m.key(), partition=m.partition(),
                             headers=m.headers())  # fmt: skip
                prod.poll(0)
                sent[t] += 1
            if sent[t] >= totals[t]:
                del feeds[t]
        if feeds:
            time.sleep(0.05)
    if prod.flush(120):
        raise RuntimeError(f"copying {topics} into {dst}: records not acknowledged")
    return sum(sent.values())


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


def topic_bytes(k: BenchKafka, topic: str) -> tuple[int, int]:
    """Key and value bytes of every record of ``topic``, as read and as zstd compresses them
    in 1 MiB runs (the producers' batch compression: what the broker stores and sends)."""
    import pyarrow as pa

    from lab.demo.procs import end_offsets

    total = sum(end_offsets(k.conf, [topic]).values())
    codec, plain, packed, run = pa.Codec("zstd"), 0, 0, bytearray()
    for m in records(k.conf, topic, lambda n: n >= total, 120):
        run += (m.key() or b"") + (m.value() or b"")
        if len(run) >= 1 << 20:
            plain, packed = plain + len(run), packed + len(codec.compress(bytes(run)))
            run.clear()
    if run:
        plain, packed = plain + len(run), packed + len(codec.compress(bytes(run)))
    return plain, packed


def measure_stages(
    k: BenchKafka, node_counts: tuple[int, ...] = (16, 64), seconds: int = 20, seed: int = 41
) -> dict[str, Any]:
    """Every stage at each node count with one replica, then two at the largest; with the
    broker's bytes per sample. The figures as a JSON-able dict (``runs`` holds each run)."""
    runs: list[StageRun] = []
    wire: dict[str, float] = {}
    for n in node_counts:
        prefix, samples = publish_backlog(k, n, seconds, seed)
        k.say(f"  stages: {n} nodes, {samples:,} samples published")
        refined = ""
        for stage in ("worker", "detect", "land"):
            for replicas in (1, 2) if n == node_counts[-1] else (1,):
                src = refined or prefix
                run, out = run_stage(k, stage, src, replicas, n, samples, seconds)
                runs.append(run)
                k.say(f"  stages: {run}")
                if stage == "worker" and replicas == 1:
                    refined = out  # what detect and the lander read
        if n == node_counts[-1]:
            for t in ("telemetry.raw", "telemetry.refined", "telemetry.accounting"):
                plain, packed = topic_bytes(k, (prefix if t == "telemetry.raw" else refined) + t)
                wire[t], wire[t + " (uncompressed)"] = packed / samples, plain / samples
    per_node_s = samples / (node_counts[-1] * seconds)
    return {"runs": [asdict(r) for r in runs], "bytes_per_sample": wire, "seconds": seconds,
            "samples_per_node_s": per_node_s, "pair_cost": pair_cpu_ratio()}  # fmt: skip


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
    drain = f"one process at the live load of {node_counts[-1]} nodes (input copied in, drained)"
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
    if "pair_cost" in m:
        pc = m["pair_cost"]
        r.add("machine_pair_cpu_ratio", pc["ratio"], "x",
              note=f"the same memory-bound work in two processes at once / alone "
              f"({pc['paired_cpu_s']:.2f} / {pc['alone_cpu_s']:.2f} CPU-s): what contention "
              "costs this machine; context for the two-replica ratios")  # fmt: skip
    for t, b in m["bytes_per_sample"].items():
        name = t.split(" ")[0].split(".")[-1] + ("_uncompressed" if " " in t else "")
        r.add(f"wire_bytes_per_sample_{name}", b, "B/sample", note=t + ", key and value")
    r.details["stages"] = m
    return r
