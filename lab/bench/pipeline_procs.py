"""Worker, detect and ``refinery land`` as processes on one run's topics, as deployed."""

from __future__ import annotations

import time
from pathlib import Path

from lab.bench.harness import BenchKafka
from lab.demo.procs import Child, worker_args
from services.lake.datasets import TOPIC_DATASETS

# every dataset's topic, as the demo lands them
LANDED = tuple(TOPIC_DATASETS.items())


class Services:
    """Worker, detect and lander of one run; the worker restarts on the same state dir."""

    def __init__(self, k: BenchKafka, prefix: str, lake: Path) -> None:
        self.k, self.prefix, self.restarts = k, prefix, 0
        self.self_exits: list[str] = []  # the last log line of each exit on its own
        self.worker_args = worker_args(prefix, k.workdir / f"{prefix}worker")
        self.worker = k.start(f"{prefix}loaded-worker", self.worker_args)
        self.detect = k.start(
            f"{prefix}loaded-detect",
            ["detect", "--topic-prefix", prefix, "--group", prefix + "detect"],
        )
        topics = [f"{prefix}{t}={d}" for t, d in LANDED]
        self.land_topics = [prefix + t for t, _ in LANDED]
        self.land = k.start(
            f"{prefix}loaded-land",
            [
                "land",
                "--group",
                prefix + "land",
                "--instance-id",
                "bench",
                "--max-age",
                "2",
                "--topics",
                *topics,
            ],
            lake=lake,
        )

    def wait_joined(self) -> None:
        """Until worker, detect and lander have joined their groups (2 minutes at most)."""
        k, p = self.k, self.prefix
        k.wait(
            "worker, detect and land join",
            lambda: all(k.joined(p + g) for g in ("worker", "detect", "land")),
            120,
            self.kids,
        )

    @property
    def kids(self) -> list[Child]:
        return [self.worker, self.detect, self.land]

    def restart_worker(self) -> None:
        self.worker.proc.kill()
        self.worker.proc.wait()
        self._start_worker()

    def _start_worker(self) -> None:
        self.restarts += 1
        self.worker = self.k.start(f"{self.prefix}loaded-worker{self.restarts}", self.worker_args)

    def supervise(self) -> None:
        """A worker that exited on its own (its watchdog: no commit progress for a minute) is
        started again, as its supervisor (systemd, Kubernetes) would; each exit is counted."""
        if not self.worker.alive():
            why = next((ln for ln in reversed(self.worker.tail(40).splitlines()) if ln.strip()), "")
            self.self_exits.append(why[-300:])
            self.k.say(f"  the worker exited on its own, started again: {why[-200:]}")
            self._start_worker()

    def drain(self) -> None:
        k, p = self.k, self.prefix
        raw = [p + t for t in ("telemetry.raw", "telemetry.events", "telemetry.collectives")]

        def drained() -> bool:
            self.supervise()
            return k.lag(p + "worker", raw) == 0

        k.wait("the worker drains", drained, 600, [self.detect, self.land])
        derived = [
            p + t
            for t in (
                "telemetry.refined",
                "telemetry.events.aligned",
                "telemetry.collectives.aligned",
            )
        ]
        k.wait("detect drains", lambda: k.lag(p + "detect", derived) == 0, 300, self.kids)
        time.sleep(3)  # a few detect ticks on the final progress
        self.detect.stop(60)  # publishes what it still holds
        k.wait(
            "the lake lands everything",
            lambda: k.lag(p + "land", self.land_topics) == 0,
            300,
            [self.land],
        )
