"""Helpers for tests that run the real worker as a subprocess against the session broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from services.topics import apply_topics, load_topic_specs


def fresh_topics(bootstrap: str) -> str:
    """Apply the whole topic spec under a unique prefix; returns the prefix."""
    prefix = f"t{uuid.uuid4().hex[:8]}."
    specs = load_topic_specs(prefix=prefix)
    apply_topics({"bootstrap.servers": bootstrap}, specs)
    return prefix


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal and wait; a process still alive after ``timeout`` is killed (and the
        returned code is then -9) so no test leaves a worker behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_worker(
    bootstrap: str,
    prefix: str,
    tmp: Path,
    app_id: str | None = None,
    name: str = "w",
    extra: list[str] | None = None,
) -> WorkerProc:
    log = tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
    env = {
        **os.environ,
        "REFINERY_BOOTSTRAP_SERVERS": bootstrap,
        "REFINERY_HOME": str(tmp / "home"),
    }
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "worker",
        "--topic-prefix",
        prefix,
        "--app-id",
        app_id or f"{prefix}worker",
        "--web-port",
        "0",
        "--data-dir",
        str(tmp / f"{name}-data"),
        *(extra or []),
        "--loglevel",
        "info",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
    return WorkerProc(proc, log)


@contextmanager
def running_worker(bootstrap: str, prefix: str, tmp: Path, **kw: object) -> Iterator[WorkerProc]:
    w = start_worker(bootstrap, prefix, tmp, **kw)  # type: ignore[arg-type]
    try:
        yield w
    finally:
        if w.proc.poll() is None:
            w.stop(signal.SIGKILL)


def read_all(
    bootstrap: str, topic: str, until: int | None = None, timeout: float = 60, idle: float = 5.0
) -> list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    """Every record of ``topic`` from the beginning: stop once ``until`` records are read, or
    after ``idle`` seconds without new ones (or ``timeout`` overall)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": uuid.uuid4().hex,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    md = c.list_topics(topic, timeout=10)
    c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
    out: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    while time.monotonic() < deadline:
        if until is not None and len(out) >= until:
            break
        if until is None and time.monotonic() - last > idle:
            break
        for m in c.consume(1000, 0.5):
            if m.error() is None:
                out.append((m.key(), m.value(), list(m.headers() or [])))
                last = time.monotonic()
    c.close()
    return out


def accounting(
    bootstrap: str, prefix: str, expect: int, timeout: float = 90
) -> list[dict[str, object]]:
    rows = read_all(bootstrap, prefix + "telemetry.accounting", until=expect, timeout=timeout)
    return [json.loads(v) for _, v, _ in rows if v is not None]


def committed(bootstrap: str, topic: str, group: str) -> dict[int, int]:
    """The offsets ``group`` has committed on ``topic``, by partition (none: absent)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        md = c.list_topics(topic, timeout=10)
        tps = [TopicPartition(topic, p) for p in md.topics[topic].partitions]
        return {tp.partition: tp.offset for tp in c.committed(tps, timeout=10) if tp.offset >= 0}
    finally:
        c.close()
