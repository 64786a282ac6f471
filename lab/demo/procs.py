"""Child processes of the demo (worker, detect, land) and Kafka progress checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; SIGKILL after ``timeout``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def spawn(name: str, args: list[str], env: dict[str, str], logdir: Path) -> Child:
    """``refinery <args>`` as a child process logging to ``logdir/<name>.log``."""
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            cwd=REPO,
        )
    return Child(name, proc, log)


def end_offsets(conf: dict[str, Any], topics: list[str]) -> dict[tuple[str, int], int]:
    """High watermark of every partition of ``topics`` (a new topic's "not leader" retried)."""
    from services.topics import watermarks

    return {(t, p): hi for t in topics for p, (_lo, hi) in watermarks(conf, t).items()}


def group_lag(conf: dict[str, Any], group: str, topics: list[str]) -> int:
    """Records of ``topics`` not yet committed by consumer group ``group``."""
    return sum(lag_by_topic(conf, group, topics).values())


def lag_by_topic(conf: dict[str, Any], group: str, topics: list[str]) -> dict[str, int]:
    """Per topic, records not yet committed by consumer group ``group``."""
    from confluent_kafka import Consumer, TopicPartition

    ends = end_offsets(conf, topics)
    c = Consumer({**conf, "group.id": group, "enable.auto.commit": False})
    try:
        committed = c.committed([TopicPartition(t, p) for t, p in ends], timeout=10)
    finally:
        c.close()
    lag: dict[str, int] = {}
    for tp in committed:
        hi = ends[(tp.topic, tp.partition)]
        lag[tp.topic] = lag.get(tp.topic, 0) + hi - (tp.offset if tp.offset >= 0 else 0)
    return lag


def wait_until(
    what: str,
    done: Callable[[], bool],
    timeout: float,
    children: list[Child],
    say: Callable[[str], None],
    every: float = 1.0,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll ``done`` until true; raise if a child died or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    last_say = 0.0
    while not done():
        for c in children:
            if not c.alive():
                raise RuntimeError(
                    f"{c.name} exited ({c.proc.returncode}) while {what}:\n{c.tail()}"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s while {what}")
        if time.monotonic() - last_say > 5:
            say(f"  … {what}" + (f" ({detail()})" if detail else ""))
            last_say = time.monotonic()
        time.sleep(every)


def worker_args(prefix: str, data_dir: Path | str) -> list[str]:
    """``refinery worker``'s arguments for a run under topic ``prefix``: its own app id, no web
    port, state in ``data_dir``."""
    return [
        "worker",
        "--topic-prefix",
        prefix,
        "--app-id",
        prefix + "worker",
        "--web-port",
        "0",
        "--data-dir",
        str(data_dir),
    ]
