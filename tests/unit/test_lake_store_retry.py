"""Waiting out a store that cannot be reached: the one retry rule
(:func:`services.lake.store.patiently`) the object lake's writer and the Iceberg sink share,
and how the Iceberg sink tells its FileIO's errors of an unreachable store from others. The
errors are real ones (pyarrow's S3 client and the sink against an endpoint nobody listens
on); the store going away and coming back is tested on s3proxy
(tests/integration/test_lake_s3.py, tests/integration/test_lake_iceberg_s3.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from pydantic import SecretStr

from services.lake.backend import open_writer
from services.lake.iceberg import IcebergSettings, fileio_unavailable
from services.lake.iceberg_sink import IcebergLakeSink
from services.lake.layout import LakeError
from services.lake.s3store import S3Settings
from services.lake.store import StoreUnavailable, patiently

NOBODY = "http://127.0.0.1:1"  # connection refused at once


def test_a_call_is_retried_while_the_store_is_unavailable_then_returns() -> None:
    outcomes: list[object] = [StoreUnavailable("down"), StoreUnavailable("still down"), "ok"]
    retried: list[StoreUnavailable] = []

    def call() -> object:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert patiently(call, 30.0, retried.append) == "ok"
    assert [str(e) for e in retried] == ["down", "still down"]


def test_past_reconnect_s_the_store_error_propagates_and_others_at_once() -> None:
    retried: list[StoreUnavailable] = []

    def down() -> None:
        raise StoreUnavailable("down")

    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="down"):
        patiently(down, 0.5, retried.append)
    assert 0.5 <= time.monotonic() - t0 < 3.0 and len(retried) >= 2  # 0.2 s, 0.4 s, ...

    def broken() -> None:
        raise LakeError("another writer")

    retried.clear()
    with pytest.raises(LakeError, match="another writer"):
        patiently(broken, 30.0, retried.append)
    assert retried == []


def test_an_error_the_caller_calls_unavailable_is_raised_as_store_unavailable() -> None:
    def refused() -> None:
        raise ConnectionRefusedError("refused")

    def unavailable(e: Exception) -> StoreUnavailable | None:
        return StoreUnavailable(f"catalog: {e}") if isinstance(e, ConnectionError) else None

    with pytest.raises(StoreUnavailable, match="catalog: refused") as info:
        patiently(refused, 0.0, lambda e: None, unavailable)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_fileio_errors_of_an_unreachable_store_are_told_from_others(tmp_path: Path) -> None:
    s3 = pafs.S3FileSystem(
        endpoint_override=NOBODY,
        access_key="k",
        secret_key="s",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    ops: list[Callable[[], object]] = [
        lambda: s3.get_file_info("lake/k"),
        lambda: s3.open_output_stream("lake/k"),
    ]
    for op in ops:
        with pytest.raises(OSError) as info:
            op()
        err = fileio_unavailable(info.value, f"s3://lake at {NOBODY}")
        assert err is not None
        assert str(err).startswith(f"s3://lake at {NOBODY}: cannot reach the store (AWS Error ")
        assert "NETWORK_CONNECTION" in str(err) and len(str(err).splitlines()) == 1
    with pytest.raises(FileNotFoundError) as missing:
        (tmp_path / "none").read_bytes()
    assert fileio_unavailable(missing.value, "x") is None
    assert fileio_unavailable(IsADirectoryError(21, "is a directory"), "x") is None
    assert fileio_unavailable(ValueError("curlCode: 7"), "x") is None  # not an I/O error
    assert fileio_unavailable(ConnectionResetError("reset by peer"), "x") is not None
    busy = OSError("When reading 'k': AWS Error UNKNOWN (HTTP status 503) during GetObject")
    assert fileio_unavailable(busy, "x") is not None  # the store failing, as pyarrow says it
    denied = OSError("When reading 'k': AWS Error ACCESS_DENIED during GetObject: denied")
    assert fileio_unavailable(denied, "x") is None  # settings to fix: no waiting


def test_the_iceberg_sink_waits_for_an_unreachable_warehouse_then_raises_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3 = S3Settings(endpoint=NOBODY, access_key_id="k", secret_access_key=SecretStr("s"), retries=0)
    url = SecretStr(f"sqlite:///{tmp_path}/catalog.db")
    ice = IcebergSettings(lake_format="iceberg", iceberg_catalog=url)
    sink = open_writer("s3://lake/x", s3=s3, iceberg=ice, reconnect_s=0.5)
    assert isinstance(sink, IcebergLakeSink)
    where = f"s3://lake/x at {NOBODY}: cannot reach the store ("
    with caplog.at_level(logging.WARNING), pytest.raises(StoreUnavailable, match="cannot reach"):
        sink.ensure_seed("samples")  # the lake's store: retried, then given up
    assert sink.reconnects >= 2
    assert f"land: {where}" in caplog.text and "): retrying" in caplog.text
    sink.reconnect_s = 0.0  # one try: pyarrow's client retries it a few times already
    with pytest.raises(StoreUnavailable) as info:
        sink.landed_high_water("samples")  # creating the table writes metadata: the FileIO
    assert str(info.value).startswith(where) and "NETWORK_CONNECTION" in str(info.value)
    assert isinstance(info.value.__cause__, OSError) and sink.commits == 0
