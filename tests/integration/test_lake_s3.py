"""The lake on a real S3-compatible store (s3proxy through ``lab.s3``, one per module):
landing gives the rows local landing gives, kills at every commit point and kill -9 at random
land each row once, conditional creates refuse a second writer, compaction takes a lease,
and bad credentials, a missing bucket or a dead endpoint are one line and a non-zero exit.

Skipped, saying why, where Java or the Maven download of s3proxy is not available."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lab.s3 import LocalS3, S3ProxyState
from schemas.errors import BrokerError
from services.lake import sqlload
from services.lake.backend import open_writer
from services.lake.layout import LakeError
from services.lake.location import parse_location
from services.lake.objcompact import Lease, ObjectCompactor
from services.lake.objwriter import ObjectLakeWriter
from services.lake.s3store import S3ObjectStore, S3Settings
from services.lake.store import ObjectExists
from tests.integration.test_lake_landing import RefinedStream
from tests.unit.test_lake_s3_store import _samples

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3ProxyState]:
    local = LocalS3(tmp_path_factory.mktemp("s3proxy"))
    try:
        state = local.start(port=0, bucket="lake")
    except BrokerError as e:
        pytest.skip(f"no s3proxy here: {e}")
    try:
        yield state
    finally:
        local.stop()


@pytest.fixture
def lake_url(s3proxy: S3ProxyState) -> str:
    return f"s3://{s3proxy.bucket}/t-{uuid.uuid4().hex[:10]}"


def _settings(st: S3ProxyState, secret: str | None = None) -> S3Settings:
    return S3Settings(
        endpoint=st.endpoint,
        region=st.region,
        access_key_id=st.access_key,
        secret_access_key=secret or st.secret_key,
        retries=1,
    )


def _store(st: S3ProxyState, url: str) -> S3ObjectStore:
    return S3ObjectStore(parse_location(url), _settings(st))


def _env(st: S3ProxyState, lake: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "REFINERY_S3"))}
    return {**env, **st.env(), "REFINERY_LAKE": lake, **extra}


def _land_args(topic: str, group: str, crash_at: str | None = None) -> list[str]:
    args = [sys.executable, "-m", "services.cli", "land", "--topics", f"{topic}=samples"]
    args += ["--group", group, "--instance-id", "lander-0", "--once-idle", "2"]
    args += ["--max-age", "0.2", "--max-rows", "300", "--no-compact"]
    return args + (["--crash-at", crash_at] if crash_at else [])


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, env=env, timeout=180, capture_output=True, text=True)


def _rows(con_lake: str | Path, st: S3ProxyState | None) -> tuple[int, int, int]:
    """rows, distinct rows, distinct lineage positions of samples through the sql/ views."""
    s3 = _settings(st) if st else None
    open_writer(con_lake, s3=s3).ensure_seeds()  # as `refinery sql` does
    con = sqlload.connect(con_lake, s3=s3)
    row = con.execute(
        "SELECT count(*), count(DISTINCT (raw_partition, raw_offset, node, device, metric, ts)),"
        " count(DISTINCT (raw_partition, raw_offset)) FROM samples"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@pytest.mark.kafka
def test_landing_on_s3_gives_the_rows_local_landing_gives(
    s3proxy: S3ProxyState,
    lake_url: str,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    stream.produce(12)
    stream.replay(3)  # a refiner replaying: same lineage at new offsets, skipped
    kafka = {"REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap}
    local = tmp_path / "lake"
    for lake in (str(local), lake_url):
        group = f"g-{uuid.uuid4().hex[:8]}"
        done = _run(_land_args(topic, group), _env(s3proxy, lake, **kafka))
        assert done.returncode == 0, done.stderr[-2000:]
    assert not (REPO / "s3:").exists() and not (tmp_path / "s3:").exists()
    want = (stream.rows, stream.rows, stream.records)
    assert _rows(local, None) == want
    assert _rows(lake_url, s3proxy) == want  # lost 0, duplicated 0
    env = _env(s3proxy, lake_url)
    out = _run([sys.executable, "-m", "services.cli", "sql", "--json", "-c",
                "SELECT count(*) AS n FROM samples"], env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"n": stream.rows}]


@pytest.mark.kafka
def test_kill_9_while_landing_on_s3_then_restart_lands_each_row_once(
    s3proxy: S3ProxyState,
    lake_url: str,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    unique_group: str,
) -> None:
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    env = _env(s3proxy, lake_url, REFINERY_BOOTSTRAP_SERVERS=kafka_bootstrap)
    points = ["before_rename", "after_rename", "after_commit", None]
    rng = random.Random(7)
    killed = 0
    for i in range(8):
        stream.produce(6)
        if i % 3 == 2:
            stream.replay(2)
        point = points[i % 4]
        if point is not None:
            code = _run(_land_args(topic, unique_group, f"{point}@{1 + i % 2}"), env).returncode
            assert code in (0, 137), code
            killed += code == 137
            continue
        proc = subprocess.Popen(_land_args(topic, unique_group), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(rng.uniform(2.5, 4.0))  # mid-flush: uploads every 0.2 s
        proc.send_signal(signal.SIGKILL)
        killed += proc.wait(30) == -signal.SIGKILL
    done = _run(_land_args(topic, unique_group), env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert killed >= 6
    assert _rows(lake_url, s3proxy) == (stream.rows, stream.rows, stream.records)


def _crash_landing(endpoint: str, key: str, secret: str, url: str, point: str) -> None:
    st = S3Settings(endpoint=endpoint, access_key_id=key, secret_access_key=secret)
    w = ObjectLakeWriter(S3ObjectStore(parse_location(url), st), crash_at=point)
    w.land("samples", _samples(0), partition=0, first=0, last=2)  # spans two hours


def test_a_flush_over_two_hours_killed_mid_commit_is_rolled_forward(
    s3proxy: S3ProxyState, lake_url: str
) -> None:
    st = s3proxy
    ctx = multiprocessing.get_context("spawn")
    args = (st.endpoint, st.access_key, st.secret_key, lake_url, "mid_rename")
    p = ctx.Process(target=_crash_landing, args=args)
    p.start()
    p.join(120)
    assert p.exitcode == 137
    store = _store(st, lake_url)
    assert len(store.list(".landing/samples")) == 3  # manifest and two staged hours
    w = ObjectLakeWriter(store)
    assert w.recover("samples", {0}) == 1  # the second hour's object copied from staging
    assert store.list(".landing") == []
    assert w.landed_high_water("samples") == {0: 2}
    w.ensure_seeds()
    assert _rows(lake_url, st)[0] == 300


def test_conditional_create_refuses_a_second_writer(s3proxy: S3ProxyState, lake_url: str) -> None:
    store = _store(s3proxy, lake_url)
    manifest = ".landing/samples/p0-0-9.json"
    store.put(manifest, b'[["a", "b"]]', create=True)
    with pytest.raises(ObjectExists):
        store.put(manifest, b'[["c", "d"]]', create=True)
    assert store.get(manifest) == b'[["a", "b"]]'
    one, other = _samples(0, seconds=30), _samples(7, seconds=30)
    ObjectLakeWriter(store).land("samples", one, partition=0, first=0, last=2)
    ObjectLakeWriter(store).land("samples", one, partition=0, first=0, last=2)  # same bytes
    with pytest.raises(LakeError, match="another writer"):
        ObjectLakeWriter(store).land("samples", other, partition=0, first=0, last=2)


def test_compaction_on_s3_takes_the_lease(s3proxy: S3ProxyState, lake_url: str) -> None:
    store = _store(s3proxy, lake_url)
    w = ObjectLakeWriter(store)
    w.ensure_seeds()
    for i in range(3):
        w.land("samples", _samples(i * 10, seconds=30), partition=0, first=i * 10, last=i * 10 + 2)
    other = Lease(store)
    assert other.acquire()  # a second compactor at work
    c = ObjectCompactor(store, grace_s=0.0)
    assert c.compact_closed(["samples"], close_after_s=0).merged == 0
    other.release()
    rep = c.compact_closed(["samples"], close_after_s=0)
    assert (rep.merged, rep.removed, len(rep.written)) == (3, 3, 1)
    assert _rows(lake_url, s3proxy) == (900, 900, 9)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("credentials", "access denied"),
        ("bucket", "does not exist"),
        ("endpoint", "cannot reach"),
        ("scheme", "unsupported scheme"),
    ],
)
def test_bad_settings_are_one_line_and_a_non_zero_exit(
    s3proxy: S3ProxyState, lake_url: str, case: str, needle: str
) -> None:
    extra = {"REFINERY_S3_RETRIES": "1", "REFINERY_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    lake = {"bucket": "s3://no-such-bucket/x", "scheme": "gs://b/x"}.get(case, lake_url)
    env = _env(s3proxy, lake, **extra)
    if case == "credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
    if case == "endpoint":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"
    done = _run([sys.executable, "-m", "services.cli", "land", "--once-idle", "1"], env)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert _store(s3proxy, lake_url).list("") == []  # nothing written, nothing committed


def test_queries_read_the_lakes_own_listing_and_see_each_committed_file_once(
    s3proxy: S3ProxyState, lake_url: str
) -> None:
    """The views over s3:// list each dataset once (no glob walk), open objects without a
    HEAD, leave out staged objects and compaction's covered inputs, and see later commits."""
    store = _store(s3proxy, lake_url)
    w = ObjectLakeWriter(store)
    w.ensure_seeds()
    w.land("samples", _samples(0, seconds=30), partition=0, first=0, last=2)
    w.land("samples", _samples(10, seconds=30), partition=1, first=10, last=12)
    store.put(".landing/samples/p0-3-5/0.parquet", store.get(
        next(o.key for o in store.list("samples") if o.key.endswith("p0-0-2.parquet"))
    ))  # staged, never committed: not read  # fmt: skip
    s3 = _settings(s3proxy)
    con = sqlload.connect(lake_url, s3=s3)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (600,)
    w.land("samples", _samples(20, seconds=30), partition=0, first=20, last=22)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (600,)  # not refreshed
    sqlload.refresh(con)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (900,)
    ObjectCompactor(store, grace_s=3600.0).compact_closed(["samples"], close_after_s=0)
    sqlload.refresh(con)  # inputs still there (grace), covered by the merged object
    assert con.execute(
        "SELECT count(*), count(DISTINCT (raw_partition, raw_offset)) FROM samples"
    ).fetchone() == (900, 9)


def test_the_read_file_system_sends_no_head_for_listed_objects(
    s3proxy: S3ProxyState, lake_url: str
) -> None:
    import duckdb

    from services.lake.s3read import lake_object_files

    store = _store(s3proxy, lake_url)
    ObjectLakeWriter(store).land("samples", _samples(0, seconds=30), partition=0, first=0, last=2)
    con = duckdb.connect()
    fs = _settings(s3proxy).register(con)
    loc = parse_location(lake_url)
    urls = [f"s3://{loc.bucket}/{o.key}" for o in
            lake_object_files(fs.list_objects(loc.bucket, loc.key("samples")))]  # fmt: skip
    assert len(urls) == 2  # the data object and the seed
    for _ in range(2):
        row = con.execute("SELECT count(*) FROM read_parquet($f)", {"f": urls}).fetchone()
        assert row == (300,)
    assert fs.requests["head"] == 0 and fs.requests["list"] == 1
    assert fs.requests["get"] == 2  # each object whole, once: the second query read the cache
    pattern = f"{lake_url}/samples/date=*/hour=*/*.parquet"
    globbed = con.execute("SELECT file FROM glob(?)", [pattern]).fetchall()
    assert sorted(r[0] for r in globbed) == sorted(urls)  # glob: one recursive listing


def test_an_iceberg_warehouse_on_s3_is_landed_and_read_through_the_views(
    s3proxy: S3ProxyState, lake_url: str, tmp_path: Path
) -> None:
    import numpy as np
    from pydantic import SecretStr

    from services.lake.backend import Flush
    from services.lake.iceberg import IcebergSettings, SnapshotFiles

    ice = IcebergSettings(
        lake_format="iceberg", iceberg_catalog=SecretStr(f"sqlite:///{tmp_path / 'cat.db'}")
    )
    s3 = _settings(s3proxy)
    sink = open_writer(lake_url, s3=s3, iceberg=ice)
    sink.ensure_seeds()
    files = SnapshotFiles(sink.catalog, ice.iceberg_namespace, sink.seed_path)  # type: ignore[attr-defined]
    con = sqlload.connect(lake_url, s3=s3, iceberg=files)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (0,)
    for first in (0, 3):
        t = _samples(first, seconds=30)
        offsets = np.asarray(t.column("raw_offset").to_numpy(), np.int64)
        sink.land_flushes("samples", [Flush(0, first, first + 2, t, offsets)])  # type: ignore[attr-defined]
        sqlload.refresh(con)
        assert con.execute("SELECT count(*) FROM samples").fetchone() == ((first + 3) * 100,)
    assert all(p.startswith("s3://") for p in files("samples"))


@pytest.mark.kafka
def test_s3_server_killed_and_restarted_mid_run_lands_each_row_once(
    tmp_path: Path, kafka_bootstrap: str, unique_topic: Callable[..., str], unique_group: str
) -> None:
    """s3proxy is killed -9 while the lander's flushes are in flight, stays down 4 s and
    comes back on the same port and objects: the lander waits (commits no offset meanwhile)
    and carries on; every row lands exactly once."""
    local = LocalS3(tmp_path / "s3")
    try:
        st = local.start(port=0, bucket="lake")
    except BrokerError as e:
        pytest.skip(f"no s3proxy here: {e}")
    try:
        lake = f"s3://{st.bucket}/t-{uuid.uuid4().hex[:10]}"
        topic = unique_topic("refined", partitions=2)
        stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
        env = _env(st, lake, REFINERY_BOOTSTRAP_SERVERS=kafka_bootstrap)
        args = [*_land_args(topic, unique_group)]
        args[args.index("--once-idle") + 1] = "6"
        stream.produce(6)
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        store, deadline = _store(st, lake), time.monotonic() + 60
        while not any(o.key.endswith(".parquet") and "seed" not in o.key
                      for o in store.list("samples")):  # fmt: skip
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        down = 0.0
        for i in range(30):  # two records every 0.15 s: a flush (0.2 s) always due
            stream.produce(2)
            time.sleep(0.15)
            if i == 3:
                local.kill()
                down = time.monotonic()
            if i == 15:
                time.sleep(max(0.0, 4.0 - (time.monotonic() - down)))
                assert local.restart().port == st.port
        stderr = proc.communicate(timeout=180)[1]
        assert proc.returncode == 0, stderr[-3000:]
        assert "cannot reach the store" in stderr and "retrying" in stderr  # it waited
        assert _rows(lake, local.state()) == (stream.rows, stream.rows, stream.records)
    finally:
        local.stop()


def test_an_iceberg_warehouse_on_s3_is_compacted_in_one_commit_an_hour(
    s3proxy: S3ProxyState, lake_url: str, tmp_path: Path
) -> None:
    from pydantic import SecretStr

    from services.lake.backend import open_compactor
    from services.lake.iceberg import IcebergSettings, expire_snapshots
    from tests.unit.test_lake_iceberg_rewrite import _flush

    ice = IcebergSettings(
        lake_format="iceberg", iceberg_catalog=SecretStr(f"sqlite:///{tmp_path / 'cat.db'}")
    )
    s3 = _settings(s3proxy)
    sink = open_writer(lake_url, s3=s3, iceberg=ice)
    for first in (0, 3, 6):  # 00:59 to 01:01: a file in each of two hours
        sink.land_flushes("samples", [_flush(first)])  # type: ignore[attr-defined]
    before = sorted(sink.live_paths("samples"))
    report = open_compactor(lake_url, s3=s3, iceberg=ice).compact_closed(["samples"])
    assert (report.merged, len(report.written)) == (6, 2)
    after = sink.live_paths("samples")
    assert len(after) == 2 and all(p.startswith("s3://") for p in after)
    table = sink.table("samples")  # type: ignore[attr-defined]
    table.refresh()
    expire_snapshots(table, keep_s=0.0)
    store = _store(s3proxy, lake_url)
    keys = {store.url(o.key) for o in store.list("")}
    assert not keys & set(before) and set(after) <= keys  # replaced objects deleted
    assert sink.landed_high_water("samples") == {0: 8}
    count = "SELECT count(*), count(DISTINCT t) FROM read_parquet(?) AS t"  # whole rows
    assert sink.reader().execute(count, [after]).fetchone() == (900, 900)  # type: ignore[union-attr]
