"""The stream processors' Faust app builds its aiokafka consumer with a short fetch wait
(see services.kafka.faust_app): Faust's own fixes 1.5 s, which held records of partitions left out
of an in-flight fetch until the next exporter tick."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import faust
import pytest
from pydantic import ValidationError

from services.kafka.faust_app import FETCH_MAX_BYTES, FETCH_MAX_WAIT_MS, App
from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry
from services.worker.app import WorkerConfig, build_app


def _consumer_ms(app: faust.App, *names: str) -> list[int]:
    """Fields of the aiokafka consumer the app would build, in ms."""

    async def build() -> list[int]:
        thread: Any = getattr(app.consumer, "_thread")  # noqa: B009  (private: no stub)
        consumer = thread._create_worker_consumer(app.transport)
        got = [int(getattr(consumer, n)) for n in names]
        await consumer.stop()  # never started: closes its client
        return got

    return asyncio.run(build())


def _fetch_wait_ms(app: faust.App) -> int:
    return _consumer_ms(app, "_fetch_max_wait_ms")[0]


def test_the_app_waits_at_most_the_short_fetch_wait_where_faust_waits_1500_ms(
    tmp_path: Path,
) -> None:
    broker = "kafka://127.0.0.1:1"
    plain = faust.App("plain", broker=broker, autodiscover=False, datadir=str(tmp_path / "a"))
    assert _fetch_wait_ms(plain) == 1500
    assert FETCH_MAX_WAIT_MS <= 100
    ours = App("refinery", broker=broker, autodiscover=False, datadir=str(tmp_path / "b"))
    assert _fetch_wait_ms(ours) == FETCH_MAX_WAIT_MS
    assert _consumer_ms(ours, "_fetch_max_bytes") == [FETCH_MAX_BYTES]  # (bytes)


def test_the_worker_app_is_built_on_it(tmp_path: Path) -> None:
    worker = build_app(
        KafkaSettings(bootstrap_servers="127.0.0.1:1"),
        WorkerConfig(data_dir=tmp_path, web_port=None),
        ServiceTelemetry("test"),
    )
    app = worker.app
    assert isinstance(app, App)
    assert _fetch_wait_ms(app) == FETCH_MAX_WAIT_MS
    # the output producer (librdkafka) would keep dialling the unreachable broker and
    # logging it for the rest of the session
    worker.outputs.close()


def test_the_worker_joins_its_group_with_the_configured_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a killed worker's partitions move once its session expires: 15 s unless configured,
    # heartbeats ten times per session (Faust's own default is 60 s, every 3 s)
    monkeypatch.delenv("REFINERY_SESSION_TIMEOUT_S", raising=False)
    assert KafkaSettings().session_timeout_s == 15.0
    monkeypatch.setenv("REFINERY_SESSION_TIMEOUT_S", "8")
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1")
    worker = build_app(kafka, WorkerConfig(data_dir=tmp_path, web_port=None), ServiceTelemetry("t"))
    app = worker.app
    session, heartbeat = _consumer_ms(app, "_session_timeout_ms", "_heartbeat_interval_ms")
    assert (session, heartbeat) == (8000, 800)
    worker.outputs.close()
    # the broker refuses sessions under 6 s (group.min.session.timeout.ms)
    monkeypatch.setenv("REFINERY_SESSION_TIMEOUT_S", "5")
    with pytest.raises(ValidationError, match="session_timeout_s"):
        KafkaSettings()
