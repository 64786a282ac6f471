"""Fault-test harness: a real broker of the test's own, the simulator (truth as oracle), the
worker and the lander as subprocesses, and :func:`reconcile`, which says what the refined
output lost, duplicated or made up relative to what the broker acknowledged.

Every fault test prints one ``FAULT`` line: lost / duplicated / unexpected counts and the time
to recover, collected by the report.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc

from lab.simulate.truth import load_truth
from schemas.records import refined_lineage
from tests.integration.worker_helpers import read_all

REPO = Path(__file__).resolve().parents[2]
LIGHT = ("--gpus-per-node", "4", "--nics-per-node", "4", "--cpus-per-node", "8")


def cli(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``refinery ARGS`` with output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )


# Two Faust defaults stall the worker under faults (found by these tests; deployed workers
# should set them, through the same environment variables or in build_app):
# - PRODUCER_REQUEST_TIMEOUT (default 20 minutes): a send a broker kill left unanswered
#   blocks the agent that long; with a bound it fails, the CrashingSupervisor exits the
#   process and its supervisor restarts it.
# - STREAM_WAIT_EMPTY (default true): on a rebalance after the session expired (SIGSTOP),
#   revocation waits for the agent's in-flight group to be acked while the agent waits on
#   the producer: a deadlock. Not waiting is safe here: unacked records are replayed and
#   every sink is idempotent by lineage.
WORKER_ENV = {"PRODUCER_REQUEST_TIMEOUT": "20", "STREAM_WAIT_EMPTY": "false"}


def worker(
    bootstrap: str,
    prefix: str,
    tmp: Path,
    env: dict[str, str] | None = None,
    web_port: int = 0,
    extra: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``refinery worker`` (group ``PREFIX``worker); ``extra``: more worker options."""
    args = ["worker", "--topic-prefix", prefix, "--app-id", f"{prefix}worker", "--web-port"]
    args += [str(web_port), "--data-dir", str(tmp / "worker-data"), "--loglevel", "info"]
    args += extra or []
    base = {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_HOME": str(tmp / "home")}
    return cli(args, tmp / "worker.log", {**base, **WORKER_ENV, **(env or {})})


def simulate(
    bootstrap: str,
    prefix: str,
    tmp: Path,
    seconds: int,
    speed: float = 1.0,
    nodes: int = 4,
    faults: str = "none",
) -> subprocess.Popen[bytes]:
    """Start ``refinery simulate`` writing its truth to ``TMP/truth.parquet``; ``faults`` as
    ``--faults`` takes it (``"all"``: duplicates, malformed, late, resets, skew...)."""
    args = ["simulate", "--nodes", str(nodes), "--duration", str(seconds), "--speed", str(speed)]
    args += ["--seed", "11", "--faults", faults, "--truth", str(tmp / "truth.parquet")]
    args += ["--topic-prefix", prefix, "--bootstrap", bootstrap, *LIGHT]
    return cli(args, tmp / "simulate.log")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Supervised:
    """A worker supervised as systemd or Kubernetes would: started again whenever it exits,
    and killed (then started again) when its ``/health`` answers 503, a stalled worker."""

    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        tmp: Path,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.args = (bootstrap, prefix, tmp, env)
        self.extra = extra
        self.restarts = 0
        self.unhealthy_kills = 0
        self.port = _free_port()
        self.proc = worker(*self.args, web_port=self.port, extra=extra)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                return True
        except urllib.error.HTTPError as e:
            return e.code != 503
        except OSError:
            return True  # not listening yet (starting) or frozen: not a verdict

    def check(self) -> None:
        if self.proc.poll() is None and not self.healthy():
            self.unhealthy_kills += 1
            self.proc.kill()
            self.proc.wait(30)
        if self.proc.poll() is not None:
            self.restarts += 1
            self.port = _free_port()
            self.proc = worker(*self.args, web_port=self.port, extra=self.extra)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def refined_count(bootstrap: str, topic: str) -> int:
    """Records in ``topic`` (sum of high watermarks; 0 when the broker does not answer)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "fault-probe", "log_level": 0})
    try:
        md = c.list_topics(topic, timeout=5)
        return sum(
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1]
            for p in md.topics[topic].partitions
        )
    except Exception:
        return 0
    finally:
        c.close()


@dataclass
class Reconciled:
    acked: int  # acknowledged raw batches (truth)
    refined_records: int  # refined records read (before lineage dedupe)
    lost: int  # acknowledged batches with no refined record
    duplicated: int  # batches refined at more than one raw position (after lineage dedupe)
    unexpected: int  # refined batches the truth never acknowledged
    samples_short: int  # acknowledged samples missing from the refined output

    def ok(self) -> bool:
        return self.lost == self.duplicated == self.unexpected == self.samples_short == 0


def acked_batches(truth_path: Path) -> dict[str, int]:
    """Tag → good samples of every raw batch the truth says was acknowledged (a malformed
    record is no batch; the copies of a duplicated batch share one tag)."""
    truth = load_truth(truth_path)
    sends = truth.sends.filter(pc.equal(truth.sends.column("stream"), "raw")).to_pylist()
    return {
        s["tag"]: s["samples"] - s["bad_samples"]
        for s in sends
        if s["kind"] != "malformed" and s["tag"]
    }


def reconcile(bootstrap: str, prefix: str, truth_path: Path) -> Reconciled:
    """Compare the refined topic with the simulator's truth of acknowledged raw batches.

    With faults on, a malformed record (dead-lettered whole) is no batch to refine, the copies
    of a duplicated batch share its tag and count once, and a batch whose every sample is bad
    has nothing to refine: such a batch is lost only if it had good samples."""
    acked = acked_batches(truth_path)
    seen: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)
    rows = read_all(bootstrap, prefix + "telemetry.refined", idle=6.0, timeout=120)
    for _, _, headers in rows:
        for lin in refined_lineage(headers):
            tag = "|".join(str(lin[k]) for k in ("node", "exporter", "instance", "boot_id", "seq"))
            seen[tag][(lin["raw_partition"], lin["raw_offset"])] = lin["refined_samples"]
    lost = [t for t, n in acked.items() if n > 0 and t not in seen]
    short = sum(max(0, n - max(seen[t].values(), default=0)) for t, n in acked.items() if t in seen)
    return Reconciled(
        acked=len(acked),
        refined_records=len(rows),
        lost=len(lost),
        duplicated=sum(len(p) - 1 for p in seen.values()),
        unexpected=sum(1 for t in seen if t not in acked),
        samples_short=short,
    )


class RefinedPositions:
    """The distinct raw positions ``(partition, offset)`` the refined topic holds rows of,
    from its messages' lineage headers, read on from where the last call stopped."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.seen: set[tuple[int, int]] = set()
        self._c = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": "fault-positions", "log_level": 0,
             "enable.auto.commit": False}
        )  # fmt: skip
        md = self._c.list_topics(topic, timeout=10)
        self._tps = [TopicPartition(topic, p, 0) for p in md.topics[topic].partitions]
        self._next = {tp.partition: 0 for tp in self._tps}
        self._c.assign(self._tps)

    def count(self, timeout: float = 60.0) -> int:
        """Read up to each partition's end as it is now (a fresh consumer's first fetch can
        take longer than one empty poll: stopping at that poll counted nothing)."""
        ends = {tp.partition: self._c.get_watermark_offsets(tp, timeout=10)[1] for tp in self._tps}
        deadline = time.monotonic() + timeout
        while any(self._next[p] < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                break
            for m in self._c.consume(1000, 0.5):
                if m.error() is None:
                    self._next[m.partition()] = m.offset() + 1
                    for lin in refined_lineage(m.headers()):
                        self.seen.add((int(lin["raw_partition"]), int(lin["raw_offset"])))
        return len(self.seen)

    def close(self) -> None:
        self._c.close()


def wait_drained(
    bootstrap: str, prefix: str, expect: int, timeout: float, w: Supervised | None = None
) -> float:
    """Wait until the refined topic holds rows of ``expect`` raw records (supervising ``w``);
    returns the seconds waited."""
    t0 = time.monotonic()
    positions = RefinedPositions(bootstrap, prefix + "telemetry.refined")
    try:
        while time.monotonic() - t0 < timeout:
            if w is not None:
                w.check()
            if positions.count() >= expect:
                break
            time.sleep(1.0)
    finally:
        positions.close()
    return time.monotonic() - t0


def worker_story(tmp: Path, w: Supervised | None = None, lines: int = 12) -> str:
    """What a failed drain needs to be understood: restarts, unhealthy kills and the worker
    log's last warnings and errors (stalls, skipped offsets, crashes)."""
    log = tmp / "worker.log"
    said = [
        ln[:300]
        for ln in (log.read_text(errors="replace").splitlines() if log.exists() else [])
        if re.search(r"\[(WARNING|ERROR|CRITICAL)\]|commit progress|never reached|Traceback", ln)
        and "Unable connect to node" not in ln
    ]
    head = f"restarts={w.restarts} unhealthy_kills={w.unhealthy_kills}; " if w else ""
    return head + "worker log:\n  " + "\n  ".join(said[-lines:] or ["(no warnings)"])


def acked_raw(truth_path: Path) -> int:
    """Acknowledged raw batches with rows in the truth (the refined records to wait for; an
    exporter's greeting, a batch without rows, gives none)."""
    sends = load_truth(truth_path).sends
    raw = pc.and_(pc.equal(sends.column("stream"), "raw"), pc.greater(sends.column("samples"), 0))
    return int(pc.sum(raw).as_py() or 0)


def report(name: str, r: Reconciled, recover_s: float, **extra: object) -> None:
    fields = {
        "fault": name,
        "lost": r.lost,
        "duplicated": r.duplicated,
        "unexpected": r.unexpected,
        "samples_short": r.samples_short,
        "acked_batches": r.acked,
        "refined_records": r.refined_records,
        "recover_s": round(recover_s, 1),
        **extra,
    }
    print("FAULT " + json.dumps(fields), flush=True)
