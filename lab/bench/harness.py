"""What the Kafka benchmarks share: the broker, fresh topics, child processes, CPU sampling.

:class:`BenchKafka` is handed to every benchmark that needs Kafka; the CLI builds it (starting
a local broker unless ``REFINERY_BOOTSTRAP_SERVERS`` is set) and stops what it started.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.demo.procs import Child, group_lag, spawn, worker_args
from lab.simulate.publish import Topics
from services.settings import KafkaSettings

S = 1_000_000_000
# topics whose record timestamps the benchmarks read: the broker stamps them on append
APPEND_TIME_TOPICS = ("telemetry.refined", "telemetry.accounting", "telemetry.alerts")
INPUTS = ("telemetry.raw", "telemetry.events", "telemetry.collectives", "topology", "jobs")

Say = Callable[[str], None]


@dataclass
class BenchKafka:
    """A reachable cluster plus a scratch directory for logs, lakes and worker state."""

    kafka: KafkaSettings
    workdir: Path
    say: Say
    children: list[Child] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)  # of the topics this run created

    @property
    def conf(self) -> dict[str, Any]:
        return self.kafka.librdkafka()

    def fresh_topics(self, create_time: tuple[str, ...] = ()) -> str:
        """Apply the whole topic spec under a unique prefix; returns the prefix. The topics
        whose timestamps are read (refined, accounting, alerts) use LogAppendTime so a record's
        timestamp is when the broker appended it; those in ``create_time`` keep the
        producer's timestamp (a preloaded backlog stamped with its simulated arrival)."""
        from services.topics import apply_topics, load_topic_specs

        prefix = f"bench{uuid.uuid4().hex[:8]}."
        specs = []
        for s in load_topic_specs(prefix=prefix):
            if s.name.removeprefix(prefix) in APPEND_TIME_TOPICS:
                cfg = {**s.config, "message.timestamp.type": "LogAppendTime"}
                s = s.model_copy(update={"config": cfg})
            elif s.name.removeprefix(prefix) in create_time:
                cfg = {**s.config, "message.timestamp.type": "CreateTime"}
                s = s.model_copy(update={"config": cfg})
            specs.append(s)
        self.prefixes.append(prefix)
        apply_topics(self.conf, specs)
        return prefix

    def delete_created(self, timeout: float = 60.0) -> tuple[int, int]:
        """Delete every topic and consumer group named under a prefix of this run (the
        services' own, such as Faust's changelogs and groups, included); returns how many of
        each. For a cluster the run does not own: benchmark topics hold gigabytes."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        if not self.prefixes:
            return 0, 0
        admin = AdminClient({**self.conf, "log_level": 3})
        mine = tuple(self.prefixes)
        topics = [t for t in admin.list_topics(timeout=timeout).topics if t.startswith(mine)]
        if topics:
            for f in admin.delete_topics(topics, operation_timeout=timeout).values():
                f.result()
        listed = admin.list_consumer_groups(request_timeout=timeout).result()
        groups = [g.group_id for g in listed.valid if g.group_id.startswith(mine)]
        deleted = 0
        if groups:
            for f in admin.delete_consumer_groups(groups, request_timeout=timeout).values():
                try:
                    f.result()
                    deleted += 1
                except KafkaException:  # members not gone yet: it expires on its own
                    pass
        return len(topics), deleted

    def env(self, lake: Path | None = None) -> dict[str, str]:
        env = {
            "REFINERY_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
            "REFINERY_HOME": str(self.workdir / "home"),
        }
        if lake is not None:
            env["REFINERY_LAKE"] = str(lake)
        return env

    def start(self, name: str, args: list[str], lake: Path | None = None) -> Child:
        """``refinery <args>`` as a child logging under the work directory."""
        child = spawn(name, args, self.env(lake), self.workdir / "logs")
        self.children.append(child)
        return child

    def start_worker(self, prefix: str, name: str = "worker") -> Child:
        return self.start(
            name,
            worker_args(prefix, self.workdir / f"{name}-data"),
        )

    def stop_all(self) -> None:
        for c in self.children:
            if c.alive():
                c.stop(30)
        self.children.clear()

    def joined(self, group: str) -> bool:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({**self.conf, "log_level": 3})
        try:
            res = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
        except Exception:  # not there yet, or the coordinator is loading
            return False
        return str(res.state).endswith("STABLE") and bool(res.members)

    def lag(self, group: str, topics: list[str]) -> int:
        return group_lag(self.conf, group, topics)

    def wait(
        self, what: str, done: Callable[[], bool], timeout: float, children: list[Child]
    ) -> None:
        """Poll ``done`` each second; raise RuntimeError when a child died or on timeout."""
        deadline = time.monotonic() + timeout
        while not done():
            for c in children:
                if not c.alive():
                    raise RuntimeError(f"{c.name} exited while {what}:\n{c.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s while {what}")
            time.sleep(1.0)


def sim_topics(prefix: str) -> Topics:
    return Topics(*(prefix + t for t in INPUTS))


def records(
    conf: dict[str, Any], topic: str, stop: Callable[[int], bool], timeout: float
) -> Iterator[Any]:
    """Every record of ``topic`` from the beginning (errors skipped) until ``stop(count)`` or
    ``timeout`` seconds. Yields confluent-kafka ``Message`` objects."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            **conf,
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        md = c.list_topics(topic, timeout=10)
        parts = md.topics[topic].partitions
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        n = 0
        deadline = time.monotonic() + timeout
        while not stop(n) and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                if m.error() is None:
                    n += 1
                    yield m
    finally:
        c.close()


def end_count(conf: dict[str, Any], topic: str) -> int:
    """Records in ``topic`` (sum of high watermarks; topics here are never truncated)."""
    from lab.demo.procs import end_offsets

    return sum(end_offsets(conf, [topic]).values())


class CpuSampler:
    """Samples a process's CPU seconds (user + system) a few times a second in a thread, so
    the CPU spent between two wall-clock instants can be read off afterwards; beside it the
    CPU of the process's main thread (Faust's event loop, where the worker refines) and the
    machine's busy CPU seconds (all cores), NaN where /proc does not give them."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        # (time.time(), process CPU s, main thread CPU s, machine busy CPU s)
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        nan = float("nan")
        while not self._stop.is_set():
            cpu = process_cpu_s(self.pid)
            if cpu is None:
                return
            main = _stat_cpu_s(Path(f"/proc/{self.pid}/task/{self.pid}/stat"))
            box = machine_busy_s()
            self.samples.append(
                (time.time(), cpu, nan if main is None else main, nan if box is None else box)
            )
            self._stop.wait(self.every_s)

    def cpu_between(self, t0: float, t1: float) -> float:
        """CPU seconds used between wall instants ``t0`` and ``t1`` (linear interpolation)."""
        return self._at(t1, 1) - self._at(t0, 1)

    def main_thread_between(self, t0: float, t1: float) -> float:
        """CPU seconds of the process's main thread between ``t0`` and ``t1``."""
        return self._at(t1, 2) - self._at(t0, 2)

    def machine_busy_between(self, t0: float, t1: float) -> float:
        """CPU seconds the whole machine was busy between ``t0`` and ``t1``."""
        return self._at(t1, 3) - self._at(t0, 3)

    def _at(self, t: float, k: int) -> float:
        s = self.samples
        if not s:
            return float("nan")
        if t <= s[0][0]:
            return s[0][k]
        for a, b in itertools.pairwise(s):
            ta, tb = a[0], b[0]
            if ta <= t <= tb:
                return a[k] + (b[k] - a[k]) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
        return s[-1][k]


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (all CPUs, /proc/stat); None off Linux."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(x) for x in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(path: Path) -> float | None:
    """User + system CPU seconds from a /proc ``stat`` file (a process's or a thread's)."""
    try:
        stat = path.read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # fields after the command: state is [0], utime [11], stime [12] (proc(5) 14 and 15)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (psutil when installed, else /proc); None when
    the process is gone."""
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]

        try:
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return None
    except ImportError:
        pass
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
