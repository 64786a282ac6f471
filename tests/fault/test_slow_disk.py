"""A slow disk under the lander: the lake root is a FUSE passthrough (``tests/fault/slowfs.py``)
that delays every write, fsync, fsyncdir and rename. Landing must get slower and nothing else:
against the simulator's truth, the lake loses, duplicates and invents no sample; a DuckDB
reader polling the lake throughout never sees a temporary or unreadable file; the lander
never exits. A second lander (own group) writes the same topic to a plain directory at the
same time, so the ``FAULT`` line gives landing latency on both disks and their ratio.

Needs ``/dev/fuse``, libfuse 3 (Debian ``fuse3``), the ``mfusepy`` binding and the right to
mount (root); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from services.lake import sqlload
from services.lake.writer import LakeWriter
from tests.fault.harness import (
    REPO,
    Reconciled,
    RefinedPositions,
    Supervised,
    acked_batches,
    acked_raw,
    cli,
    report,
    simulate,
    wait_drained,
    worker_story,
)
from tests.integration.worker_helpers import fresh_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
DELAY_MS = "50:300"  # fsync, fsyncdir, rename: uniform per call
WRITE_DELAY_MS = "5:30"  # each write(2) the kernel passes on (up to 128 KiB)
FILE = re.compile(r"^p(\d+)-(\d+)-(\d+)\.parquet$")
TAG = ("node", "exporter", "instance", "boot_id", "seq")


class SlowDisk:
    """``slowfs.py BACKING MOUNT`` as a subprocess; :meth:`unmount` ends it and returns its
    summary (calls and seconds slept per operation)."""

    def __init__(self, tmp: Path) -> None:
        self.backing, self.mount = tmp / "slow-backing", tmp / "slow-lake"
        self.backing.mkdir()
        self.mount.mkdir()
        self.log = tmp / "slowfs.log"
        args = [self.backing, self.mount, "--delay-ms", DELAY_MS]
        args += ["--write-delay-ms", WRITE_DELAY_MS]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests/fault/slowfs.py"), *map(str, args)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_mounted(self, timeout: float = 15.0) -> str | None:
        """None once mounted, else why not (one line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.ismount(self.mount):
                return None
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.unmount()
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        said = [ln for ln in lines if re.match(r"(fuse|fusermount\d?|slowfs):", ln)]
        return (said or lines or ["slowfs did not mount in time"])[0]

    def unmount(self) -> dict[str, object]:
        if os.path.ismount(self.mount):
            r = subprocess.run(["umount", str(self.mount)], capture_output=True)
            if r.returncode != 0:  # busy: detach now, the kernel finishes when it can
                subprocess.run(["umount", "-l", str(self.mount)], check=False)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith('{"slowfs"'):
                summary: dict[str, object] = json.loads(line)["slowfs"]
                return summary
        return {}


@pytest.fixture
def slow_disk(tmp_path: Path) -> Iterator[SlowDisk]:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse here: slow-disk test not run")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the binding found no libfuse
        pytest.skip(f"FUSE binding unusable ({str(e).splitlines()[0]}): slow-disk test not run")
    disk = SlowDisk(tmp_path)
    why = disk.wait_mounted()
    if why is not None:
        pytest.skip(f"cannot mount FUSE here ({why}): slow-disk test not run")
    try:
        yield disk
    finally:
        disk.unmount()


class LakeWatcher(threading.Thread):
    """A DuckDB reader on the lake's ``samples`` view, refreshed every ``period`` s: records
    when each data file was first visible and every problem a reader would hit (a query error,
    a listed file that is not a landed data file)."""

    def __init__(self, lake: Path, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.lake, self.period = lake, period
        self.first_seen: dict[str, float] = {}
        self.problems: list[str] = []
        self.polls = 0
        self.stop = threading.Event()

    def run(self) -> None:
        con = sqlload.connect(self.lake)
        while not self.stop.is_set():
            try:
                sqlload.refresh(con)
                now = time.time()
                listed = con.execute("SELECT getvariable('lake_files_samples')").fetchone()
                for path in listed[0] if listed and listed[0] else []:
                    name = os.path.basename(path)
                    if not (FILE.match(name) or name == "seed.parquet"):
                        self.problems.append(f"reader listed {name}")
                    self.first_seen.setdefault(name, now)
                con.execute("SELECT count(*), sum(value) FROM samples").fetchone()
            except Exception as e:  # a partial or vanished file would land here
                self.problems.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
            self.polls += 1
            self.stop.wait(self.period)
        con.close()


def lander(
    bootstrap: str, topic: str, lake: Path, group: str, log: Path
) -> subprocess.Popen[bytes]:
    args = ["land", "--topics", f"{topic}=samples", "--group", group, "--no-compact"]
    args += ["--max-age", "1"]
    return cli(args, log, {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_LAKE": str(lake)})


def broker_times(bootstrap: str, topic: str) -> dict[tuple[int, int], float]:
    """``{(partition, offset): broker timestamp in s}`` for every record of ``topic``."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        high = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: dict[tuple[int, int], float] = {}
        deadline = time.monotonic() + 60
        while len(out) < sum(high.values()) and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=1.0):
                if m.error() is None:
                    out[(m.partition(), m.offset())] = m.timestamp()[1] / 1000
        return out
    finally:
        c.close()


def committed(bootstrap: str, topic: str, group: str, parts: list[int]) -> dict[int, int]:
    """The offsets ``group`` committed on ``topic`` (the lander commits after landing)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        c.close()


def wait_landed(
    bootstrap: str, topic: str, groups: list[str], high: dict[int, int], timeout: float
) -> bool:
    """True once every group has committed up to ``high`` on every partition."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [committed(bootstrap, topic, g, list(high)) for g in groups]
        if all(c.get(p, -1) >= h for c in done for p, h in high.items()):
            return True
        time.sleep(0.5)
    return False


def reconcile_lake(lake: Path, truth_path: Path) -> Reconciled:
    """The lake's samples against the truth's acknowledged raw batches, per batch tag: lost
    (no row), short (fewer rows than good samples), duplicated (landed from more than one raw
    position, or more rows than samples), unexpected (a tag the truth never acknowledged)."""
    acked = acked_batches(truth_path)
    con = sqlload.connect(lake)
    rows = con.execute(
        f"SELECT {', '.join(TAG)}, raw_partition, raw_offset, count(*) FROM samples GROUP BY ALL"
    ).fetchall()
    con.close()
    seen: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)
    for row in rows:
        tag = "|".join(str(v) for v in row[:5])
        seen[tag][(row[5], row[6])] = row[7]
    lost = sum(1 for t, n in acked.items() if n > 0 and t not in seen)
    short = sum(max(0, n - sum(seen[t].values())) for t, n in acked.items() if t in seen)
    extra = sum(max(0, sum(seen[t].values()) - n) for t, n in acked.items() if t in seen)
    return Reconciled(
        acked=len(acked),
        refined_records=sum(r[7] for r in rows),
        lost=lost,
        duplicated=sum(len(p) - 1 for p in seen.values()) + (extra > 0),
        unexpected=sum(1 for t in seen if t not in acked),
        samples_short=short,
    )


def latencies(watcher: LakeWatcher, stamps: dict[tuple[int, int], float]) -> dict[str, float | int]:
    """Per refined record: first seen by the reader minus its broker timestamp (s)."""
    lat = []
    for name, seen_at in watcher.first_seen.items():
        m = FILE.match(name)
        if m:
            part, first, last = int(m[1]), int(m[2]), int(m[3])
            lat += [
                seen_at - stamps[(part, o)] for o in range(first, last + 1) if (part, o) in stamps
            ]
    if not lat:
        return {"records": 0}
    q = statistics.quantiles(lat, n=20) if len(lat) > 1 else [lat[0]] * 19
    return {
        "records": len(lat),
        "p50_s": round(statistics.median(lat), 2),
        "p95_s": round(q[18], 2),
        "max_s": round(max(lat), 2),
    }


def test_slow_disk_costs_nothing(kafka_bootstrap: str, slow_disk: SlowDisk, tmp_path: Path) -> None:
    prefix = fresh_topics(kafka_bootstrap)
    topic = prefix + "telemetry.refined"
    truth = tmp_path / "truth.parquet"
    plain = tmp_path / "plain-lake"
    lakes = [slow_disk.mount, plain]
    for lk in lakes:  # every view binds before the first landing (readers start at once)
        LakeWriter(lk).ensure_seeds()
    watchers = [LakeWatcher(lk) for lk in lakes]
    groups = [f"land-{uuid.uuid4().hex[:8]}" for _ in lakes]
    landers = [
        lander(kafka_bootstrap, topic, lk, g, tmp_path / f"land-{i}.log")
        for i, (lk, g) in enumerate(zip(lakes, groups, strict=True))
    ]
    w = Supervised(kafka_bootstrap, prefix, tmp_path)
    t0 = time.monotonic()
    try:
        for wt in watchers:
            wt.start()
        sim = simulate(kafka_bootstrap, prefix, tmp_path, seconds=25)
        assert sim.wait(150) == 0
        expect = acked_raw(truth)
        waited = wait_drained(kafka_bootstrap, prefix, expect, 150, w)
        positions = RefinedPositions(kafka_bootstrap, topic)
        refined_n = positions.count()
        positions.close()
        # the worker's side, not the disk's: without it the lakes cannot match the truth
        assert refined_n >= expect, (
            f"worker refined {refined_n} of {expect} batches in {waited:.0f} s; "
            + worker_story(tmp_path, w)
        )
        stamps = broker_times(kafka_bootstrap, topic)
        high: dict[int, int] = defaultdict(int)
        for part, off in stamps:
            high[part] = max(high[part], off + 1)
        assert wait_landed(kafka_bootstrap, topic, groups, high, 60), (
            "a lander did not catch up within 60 s"
        )
        time.sleep(1.0)  # one more reader poll sees the last files
        exits = [p.poll() for p in landers]
    finally:
        for wt in watchers:
            wt.stop.set()
        for wt in watchers:
            if wt.is_alive():
                wt.join(10)
        for p in landers:
            if p.poll() is None:
                p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
        w.stop()
    elapsed = time.monotonic() - t0
    slow_r, plain_r = reconcile_lake(slow_disk.mount, truth), reconcile_lake(plain, truth)
    fs = slow_disk.unmount()
    slow_lat, plain_lat = latencies(watchers[0], stamps), latencies(watchers[1], stamps)
    ratio = (
        round(slow_lat["p50_s"] / plain_lat["p50_s"], 2)
        if slow_lat.get("p50_s") and plain_lat.get("p50_s")
        else None
    )
    report(
        "lake-slow-disk",
        slow_r,
        elapsed,
        delay_ms=DELAY_MS,
        write_delay_ms=WRITE_DELAY_MS,
        slowfs=fs,
        landing_latency_slow=slow_lat,
        landing_latency_plain=plain_lat,
        p50_ratio_slow_to_plain=ratio,
        files_slow=sum(1 for n in watchers[0].first_seen if FILE.match(n)),
        files_plain=sum(1 for n in watchers[1].first_seen if FILE.match(n)),
        reader_polls=watchers[0].polls,
        reader_problems=len(watchers[0].problems),
        plain_lake=[plain_r.lost, plain_r.duplicated, plain_r.unexpected, plain_r.samples_short],
        worker_restarts=w.restarts,
    )
    assert exits == [None, None], f"a lander exited under the slow disk: {exits}"
    assert not watchers[0].problems, watchers[0].problems[:5]
    assert not watchers[1].problems, watchers[1].problems[:5]
    # the slow disk's own claim first: it lands exactly what a fast disk lands
    assert slow_r == plain_r, f"slow lake {slow_r} != plain lake {plain_r}"
    # then both against the truth; a loss here is shared with the plain lake, so it is not
    # the disk's doing (seen once: refined records resent after NotLeaderForPartition arrived
    # after later ones and the lander's lineage replay filter dropped them)
    assert plain_r.ok(), f"both lakes differ from the truth (not the slow disk): {plain_r}"
    assert slow_r.ok(), slow_r
    calls = fs.get("calls", {})
    assert isinstance(calls, dict) and calls.get("fsync", 0) > 0, f"slowfs saw no fsync: {fs}"
