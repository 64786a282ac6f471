"""The lake's file system fails under the lander: full (a tmpfs with room for about half of
what the run lands) or read-only (the tmpfs remounted ``ro``). The lander exits non-zero, no
partial file is visible, no offset is committed past what landed; when the file system is back,
a restarted lander lands the rest exactly once. Needs ``mount`` (root, as in CI's container);
skipped otherwise."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas.records import refined_lineage
from tests.fault.harness import (
    Reconciled,
    Supervised,
    acked_raw,
    cli,
    report,
    simulate,
    wait_drained,
)
from tests.integration.worker_helpers import committed, fresh_topics, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
LAND_ARGS = ("--once-idle", "3", "--no-compact", "--max-rows", "2000")
FILE = re.compile(r"^p(\d+)-(\d+)-(\d+)\.parquet$")


def _mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


def _remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


@pytest.fixture
def lake(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "lake"
    if not _mount(path, "size=64m"):
        pytest.skip("cannot mount a tmpfs here (needs root): disk-full test not run")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def refined(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A finished small run: (refined topic, refined rows in it)."""
    tmp = tmp_path_factory.mktemp("lake-run")
    prefix = fresh_topics(kafka_bootstrap)
    w = Supervised(kafka_bootstrap, prefix, tmp)
    try:
        assert simulate(kafka_bootstrap, prefix, tmp, seconds=6, speed=0).wait(120) == 0
        wait_drained(kafka_bootstrap, prefix, acked_raw(tmp / "truth.parquet"), 120, w)
    finally:
        w.stop()
    topic = prefix + "telemetry.refined"
    by_lineage: dict[tuple[int, int], int] = {}  # replays after worker restarts count once
    for _, _, headers in read_all(kafka_bootstrap, topic, idle=3.0):
        for lin in refined_lineage(headers):
            by_lineage[(lin["raw_partition"], lin["raw_offset"])] = lin["refined_samples"]
    rows = sum(by_lineage.values())
    return topic, rows


def land(bootstrap: str, topic: str, lake: Path, group: str, log: Path) -> int:
    p = cli(
        ["land", "--topics", f"{topic}=samples", "--group", group, *LAND_ARGS],
        log,
        {"REFINERY_BOOTSTRAP_SERVERS": bootstrap, "REFINERY_LAKE": str(lake)},
    )
    return p.wait(120)


def landed(lake: Path) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """Kafka offset ranges per partition of every visible file (each must be readable) and
    the rows in them."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    rows = 0
    for f in lake.rglob("*.parquet"):
        meta = pq.read_metadata(f)  # a partial file would not parse
        if f.name == "seed.parquet":  # the writer's empty schema file for readers
            continue
        m = FILE.match(f.name)
        assert m, f"unexpected visible file {f}"
        rows += meta.num_rows
        ranges.setdefault(int(m[1]), []).append((int(m[2]), int(m[3])))
    return ranges, rows


def check_failed_state(bootstrap: str, topic: str, lake: Path, group: str) -> None:
    ranges, _ = landed(lake)
    for part, offset in committed(bootstrap, topic, group).items():
        top = max((last for _, last in ranges.get(part, [])), default=-1)
        assert offset <= top + 1, f"partition {part} committed {offset} past landed {top}"


def check_exactly_once(lake: Path, rows_expected: int) -> Reconciled:
    ranges, rows = landed(lake)
    overlaps = 0
    for spans in ranges.values():
        spans.sort()
        overlaps += sum(1 for a, b in itertools.pairwise(spans) if b[0] <= a[1])
    return Reconciled(
        acked=rows_expected,
        refined_records=rows,
        lost=max(0, rows_expected - rows),
        duplicated=overlaps + max(0, rows - rows_expected),
        unexpected=0,
        samples_short=0,
    )


PAGE = 4096


def _pages(root: Path) -> int:
    """Bytes the files under root take on a tmpfs (whole pages)."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in root.rglob("*") if f.is_file())


def fill_leaving(path: Path, room: int) -> Path:
    """Fill the file system at path with one file so that about ``room`` bytes stay free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    filler = path / "filler.bin"
    with open(filler, "wb") as f:
        chunk = b"\0" * (1 << 20)
        left = max(0, free - room)
        while left:
            left -= f.write(chunk[: min(left, len(chunk))])
    return filler


def test_disk_full(
    kafka_bootstrap: str, refined: tuple[str, int], lake: Path, tmp_path: Path
) -> None:
    topic, rows = refined
    # How much this run lands, measured by landing it once on an ordinary disk; the full disk
    # then has room for about half of it, so some files land before the write that fails.
    reference = tmp_path / "reference-lake"
    ref_group = f"land-ref-{uuid.uuid4().hex[:8]}"
    assert land(kafka_bootstrap, topic, reference, ref_group, tmp_path / "land0.log") == 0
    need = _pages(reference)
    filler = fill_leaving(lake, max(PAGE, need // 2))
    group = f"land-{uuid.uuid4().hex[:8]}"
    rc = land(kafka_bootstrap, topic, lake, group, tmp_path / "land1.log")
    assert rc != 0, f"the lander should fail on a full disk (run lands {need} bytes)"
    assert "cannot write the lake" in (tmp_path / "land1.log").read_text()
    check_failed_state(kafka_bootstrap, topic, lake, group)
    _, partial_rows = landed(lake)
    filler.unlink()
    t0 = time.monotonic()
    assert land(kafka_bootstrap, topic, lake, group, tmp_path / "land2.log") == 0
    r = check_exactly_once(lake, rows)
    report("lake-disk-full", r, time.monotonic() - t0, rows_before_space=partial_rows)
    assert r.ok(), r


def test_read_only_lake(
    kafka_bootstrap: str, refined: tuple[str, int], lake: Path, tmp_path: Path
) -> None:
    topic, rows = refined
    _remount(lake, "ro")
    group = f"land-{uuid.uuid4().hex[:8]}"
    rc = land(kafka_bootstrap, topic, lake, group, tmp_path / "land1.log")
    assert rc != 0, "the lander should fail on a read-only lake"
    assert "cannot write the lake" in (tmp_path / "land1.log").read_text()
    assert committed(kafka_bootstrap, topic, group) == {}
    _remount(lake, "rw")
    t0 = time.monotonic()
    assert land(kafka_bootstrap, topic, lake, group, tmp_path / "land2.log") == 0
    r = check_exactly_once(lake, rows)
    report("lake-read-only", r, time.monotonic() - t0)
    assert r.ok(), r
