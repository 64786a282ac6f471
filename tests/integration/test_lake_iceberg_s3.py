"""An Iceberg lake whose warehouse is on S3 (s3proxy through ``lab.s3``; a SQLite catalog),
landed by the lander subprocess from a real broker while records keep arriving: the lander
killed -9 at random moments of its uploads and commits again and again, then restarted; the
S3 server killed -9 mid-run and restarted on the same port, the lander waiting it out; and,
driving the sink directly, the store killed just before a commit. Every row lands exactly
once, counted through the ``sql/`` views.

Skipped, saying why, where Java or the Maven download of s3proxy is not available."""

from __future__ import annotations

import logging
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from lab.s3 import LocalS3, S3ProxyState
from schemas.errors import BrokerError
from services.lake import sqlload
from services.lake.backend import Flush, open_writer
from services.lake.iceberg import SnapshotFiles
from services.lake.iceberg_sink import IcebergLakeSink
from services.lake.s3store import S3ObjectStore
from tests.integration.test_lake_iceberg import _settings as _iceberg
from tests.integration.test_lake_landing import RefinedStream
from tests.integration.test_lake_s3 import (
    REPO,
    _env,
    _land_args,
    _run,
    _settings,
    _store,
    lake_url,
    s3proxy,
)
from tests.unit.test_lake_s3_store import _samples

__all__ = ["lake_url", "s3proxy"]  # the fixtures, imported


@pytest.fixture(scope="module")
def killable_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """An s3proxy of this module's own, for the tests that kill it (each restarts it)."""
    local = LocalS3(tmp_path_factory.mktemp("s3proxy-killed"))
    try:
        local.start(port=0, bucket="lake")
    except BrokerError as e:
        pytest.skip(f"no s3proxy here: {e}")
    try:
        yield local
    finally:
        local.stop()


def _lander_env(st: S3ProxyState, lake: str, bootstrap: str, tmp: Path) -> dict[str, str]:
    """The lander's environment: the lake on ``st``, Iceberg, the catalog in ``tmp``."""
    return _env(
        st,
        lake,
        REFINERY_BOOTSTRAP_SERVERS=bootstrap,
        REFINERY_LAKE_FORMAT="iceberg",
        REFINERY_ICEBERG_CATALOG=f"sqlite:///{tmp}/catalog.db",
    )


def _data_objects(store: S3ObjectStore) -> set[str]:
    """The data files on the store, committed or not (orphans of killed flushes)."""
    return {store.url(o.key) for o in store.list("refinery/samples/data")}


def _sink(st: S3ProxyState, lake: str, tmp: Path) -> IcebergLakeSink:
    sink = open_writer(lake, s3=_settings(st), iceberg=_iceberg(tmp))
    assert isinstance(sink, IcebergLakeSink)
    return sink


def _rows(st: S3ProxyState, lake: str, tmp: Path) -> tuple[int, int, int]:
    """rows, distinct rows, distinct lineage positions of samples through the sql/ views."""
    sink = _sink(st, lake, tmp)
    sink.ensure_seeds()  # as `refinery sql` does
    files = SnapshotFiles(sink.catalog, "refinery", sink.seed_path)
    con = sqlload.connect(lake, s3=_settings(st), iceberg=files)
    row = con.execute(
        "SELECT count(*), count(DISTINCT (raw_partition, raw_offset, node, device, metric, ts)),"
        " count(DISTINCT (raw_partition, raw_offset)) FROM samples"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@contextmanager
def _feeding(stream: RefinedStream) -> Iterator[None]:
    """Records keep arriving meanwhile (two every 0.1 s, a replay of one now and then), so a
    lander is always flushing: uploading data files or committing. ``stream`` is the
    thread's until the block ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def feed() -> None:
        try:
            for i in range(100_000):
                if stop.wait(0.1):
                    return
                stream.produce(2)
                if i % 7 == 6:
                    stream.replay(1)  # a refiner replaying: same lineage at a new offset
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors


def _until_it_uploads(proc: subprocess.Popen[bytes], store: S3ObjectStore, seen: int) -> None:
    """Wait until the lander has uploaded a data file past the ``seen`` on the store."""
    deadline = time.monotonic() + 60
    while len(_data_objects(store)) <= seen:
        assert proc.poll() is None, f"the lander exited ({proc.returncode})"
        assert time.monotonic() < deadline, "the lander uploaded nothing in 60 s"
        time.sleep(0.05)


@pytest.mark.kafka
def test_lander_killed_9_while_uploading_and_committing_to_s3_then_restarted_lands_once(
    s3proxy: S3ProxyState,
    lake_url: str,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    unique_group: str,
    tmp_path: Path,
) -> None:
    """Six landers in turn, while records keep arriving: four are killed -9 from outside a
    random 0-0.8 s after their first upload, in the middle of a flush (a data file uploaded,
    others uploading, the commit on its way) or of the next one; two die (exit 137, no
    cleanup) at the sink's seams: after the first data file of their second flush was
    uploaded, and with all its files uploaded just before the commit. A last lander, not
    killed, lands the rest."""
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    env = _lander_env(s3proxy, lake_url, kafka_bootstrap, tmp_path)
    store = _store(s3proxy, lake_url)
    rng = random.Random(11)
    killed = 0
    with _feeding(stream):
        for crash_at in (None, "mid_upload@2", None, "before_commit@2", None, None):
            seen = len(_data_objects(store))
            args = _land_args(topic, unique_group, crash_at)
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                if crash_at is None:
                    _until_it_uploads(proc, store, seen)
                    time.sleep(rng.uniform(0.0, 0.8))
                    proc.kill()
                code = proc.wait(60)
            finally:
                proc.kill()
            killed += code in (-9, 137)
    done = _run(_land_args(topic, unique_group), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert killed == 6
    live = set(_sink(s3proxy, lake_url, tmp_path).live_paths("samples"))
    assert live < _data_objects(store)  # kills left uploaded files that no snapshot names
    assert _rows(s3proxy, lake_url, tmp_path) == (stream.rows, stream.rows, stream.records)


@pytest.mark.kafka
def test_s3_server_killed_and_restarted_mid_run_the_iceberg_lander_waits_and_lands_once(
    killable_s3: LocalS3,
    tmp_path: Path,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    unique_group: str,
) -> None:
    """s3proxy is killed -9 while the lander uploads and commits, stays down 4 s and comes
    back on the same port and objects: the lander waits (commits no offset meanwhile, never
    exits) and carries on; every row lands exactly once."""
    local = killable_s3
    st = local.restart()  # running: as it is
    lake = f"s3://{st.bucket}/t-{uuid.uuid4().hex[:10]}"
    topic = unique_topic("refined", partitions=2)
    stream = RefinedStream(kafka_bootstrap, topic, partitions=2)
    env = _lander_env(st, lake, kafka_bootstrap, tmp_path)
    store = _store(st, lake)
    err = tmp_path / "lander.err"
    with _feeding(stream), open(err, "wb") as stderr:
        proc = subprocess.Popen(_land_args(topic, unique_group), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        try:
            _until_it_uploads(proc, store, 0)
            local.kill()
            time.sleep(4.0)  # the outage: its flushes fail and wait
            assert proc.poll() is None, err.read_text()[-3000:]
            assert local.restart().port == st.port
            _until_it_uploads(proc, store, len(_data_objects(store)))  # it carries on
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(120) == 0, err.read_text()[-3000:]
    log = err.read_text()
    assert "cannot reach the store" in log and "retrying" in log  # it waited
    assert _rows(st, lake, tmp_path) == (stream.rows, stream.rows, stream.records)


def test_a_commit_tried_while_the_store_is_down_waits_and_lands_once(
    killable_s3: LocalS3, tmp_path: Path
) -> None:
    """The sink driven directly: its flush (two hours: two data files) is uploaded, then the
    store is killed before the commit and restarted once the sink has logged the commit's
    failure (a restart on a timer raced the S3 client's own retries: a store back within them
    let the first commit through). The commit (manifests, metadata) fails and is retried from
    the re-read offsets with the files already uploaded, once the store is back: one
    snapshot, each row once, no file left over."""
    local = killable_s3
    st = local.restart()
    lake = f"s3://{st.bucket}/t-{uuid.uuid4().hex[:10]}"
    calls: list[int] = []
    restarts: list[int] = []

    class _RestartOnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage() and not restarts:
                restarts.append(1)
                local.restart()

    def pause() -> None:  # before each commit attempt: the first finds the store killed
        calls.append(1)
        if len(calls) == 1:
            local.kill()

    sink = open_writer(lake, s3=_settings(st), iceberg=_iceberg(tmp_path), pause=pause)
    assert isinstance(sink, IcebergLakeSink)
    t = _samples(0)
    offsets = np.asarray(t.column("raw_offset").to_numpy(), np.int64)
    watch = _RestartOnRetry()
    sink_log = logging.getLogger("services.lake.iceberg_sink")
    sink_log.addHandler(watch)
    try:
        files = sink.land_flushes("samples", [Flush(0, 0, 2, t, offsets)])
    finally:
        sink_log.removeHandler(watch)
        if not restarts:
            local.restart()
    assert restarts == [1]
    assert len(calls) == 2 and sink.reconnects >= 1 and sink.commits == 1
    assert set(files) == _data_objects(_store(st, lake))  # uploaded once, reused
    assert sink.landed_high_water("samples") == {0: 2}
    assert _rows(st, lake, tmp_path) == (300, 300, 3)
