"""Compaction on real files with real DuckDB: merged output, unchanged high-water, and no row
read twice or missed — before, during, and after compaction, including kill -9 at random
points (a subprocess killed by SIGKILL at random times and at every crash seam)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from lab.lake import synth
from services.lake import sqlload
from services.lake.compact import Compactor
from services.lake.layout import hour_of
from services.lake.writer import LakeWriter

REPO = Path(__file__).resolve().parents[2]
T0 = 1_704_067_200_000_000_000 + 3 * 60 * 10**9  # 2024-01-01T00:03Z
CHECK = "SELECT count(*), sum(hash(node, device, metric, ts, raw_offset)::HUGEINT) FROM samples"


def _fingerprint(con: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    sqlload.refresh(con)
    row = con.execute(CHECK).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[int, int]]:
    root = tmp_path_factory.mktemp("pristine")
    w = LakeWriter(root)
    w.ensure_seeds()
    t = synth.refined_samples(nodes=1, seconds=7200, interval_s=15.0, start_ns=T0)
    synth.land_lake(w, t, chunk_rows=600, partitions=3)
    con = sqlload.connect(root)
    fp = _fingerprint(con)
    assert fp[0] == t.num_rows
    return root, fp


def test_compaction_merges_and_keeps_rows_and_high_water(
    pristine: tuple[Path, tuple[int, int]], tmp_path: Path
) -> None:
    root = tmp_path / "lake"
    shutil.copytree(pristine[0], root)
    w = LakeWriter(root)
    hw = w.landed_high_water("samples")
    before = len(w.live_paths("samples"))
    report = Compactor(root, grace_s=0).compact_closed(["samples"], close_after_s=0)
    after = w.live_paths("samples")
    assert 0 < report.merged <= before and len(after) < before
    assert len(after) <= 3 * 4  # one file per partition and hour touched
    assert w.landed_high_water("samples") == hw
    assert _fingerprint(sqlload.connect(root)) == pristine[1]
    # nothing left to do, and a second pass changes nothing
    assert Compactor(root, grace_s=0).compact_closed(["samples"], close_after_s=0).merged == 0


def test_covered_inputs_kept_during_grace_are_not_read_twice(
    pristine: tuple[Path, tuple[int, int]], tmp_path: Path
) -> None:
    root = tmp_path / "lake"
    shutil.copytree(pristine[0], root)
    n_files = len(list(root.glob("samples/*/*/p*.parquet")))
    date, hour = hour_of(T0)
    report = Compactor(root, grace_s=3600).compact_hour("samples", date, hour)
    assert report.removed == 0 and report.written
    assert len(list(root.glob("samples/*/*/p*.parquet"))) == n_files + len(report.written)
    assert _fingerprint(sqlload.connect(root)) == pristine[1]  # plain-DuckDB views exclude them
    late = synth.refined_samples(nodes=1, seconds=5, start_ns=T0 + 10**9, seed=9)
    w = LakeWriter(root)
    w.land("samples", late, partition=0, first=10**6, last=10**6)  # late data after compaction
    con = sqlload.connect(root)
    assert _fingerprint(con)[0] == pristine[1][0] + late.num_rows
    Compactor(root, grace_s=0).compact_hour("samples", date, hour)
    assert _fingerprint(con)[0] == pristine[1][0] + late.num_rows
    assert w.landed_high_water("samples")[0] == 10**6


_CHILD = """
import sys
from services.lake.compact import Compactor
c = Compactor(sys.argv[1], grace_s=0, crash_at=sys.argv[2] or None, row_group_rows=2000)
print("ready", flush=True)
c.recover("samples")
c.compact_closed(["samples"], close_after_s=0, wait=True)
"""


def _reader(
    root: Path, expect: tuple[int, int], stop: threading.Event, out: dict[str, int]
) -> None:
    con = sqlload.connect(root)
    while not stop.is_set():
        try:
            fp = _fingerprint(con)
        except duckdb.IOException:
            out["io_errors"] += 1  # a covered input deleted between listing and reading
            continue
        out["reads"] += 1
        if fp != expect:
            out["wrong"] += 1


@pytest.mark.slow
def test_kill_9_at_random_points_never_loses_or_duplicates(
    pristine: tuple[Path, tuple[int, int]], tmp_path: Path
) -> None:
    rng = random.Random(1234)
    seams = ["compact_before_rename", "compact_after_rename", "compact_mid_delete"]
    plans = [(s, f"{s}@{k}") for s in seams for k in (1, 3)] + [("sigkill", "")] * 10
    killed, reads = 0, 0
    for i, (kind, crash_at) in enumerate(plans):
        root = tmp_path / f"lake{i}"
        shutil.copytree(pristine[0], root)
        stop, stats = threading.Event(), {"reads": 0, "wrong": 0, "io_errors": 0}
        reader = threading.Thread(target=_reader, args=(root, pristine[1], stop, stats))
        reader.start()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root), crash_at],
            cwd=REPO,
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        if kind == "sigkill":
            time.sleep(rng.uniform(0.0, 0.6))
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        code = child.wait(60)
        killed += code in (137, -signal.SIGKILL)
        time.sleep(0.05)
        stop.set()
        reader.join()
        assert stats["wrong"] == 0, (kind, crash_at, stats)
        reads += stats["reads"]
        # after the crash, as is
        assert _fingerprint(sqlload.connect(root)) == pristine[1], (kind, crash_at)
        hw = LakeWriter(root).landed_high_water("samples")
        # recovery and a full run converge to the same rows
        c = Compactor(root, grace_s=0)
        c.recover("samples")
        c.compact_closed(["samples"], close_after_s=0)
        assert _fingerprint(sqlload.connect(root)) == pristine[1], (kind, crash_at)
        assert LakeWriter(root).landed_high_water("samples") == hw
        assert list(root.rglob("*.partial")) == []
        shutil.rmtree(root)
    assert killed >= 10
    assert reads >= len(plans)  # readers really ran while compaction did
