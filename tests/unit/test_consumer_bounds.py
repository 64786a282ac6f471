"""The lander, detect and the alert consumers configure librdkafka with the fetch and
receive bounds the worker's own consumers use (services.kafka.internals): what one fetch
carries and what a zstd batch may inflate to. The configuration each hands librdkafka is
recorded by a stand-in for ``confluent_kafka.Consumer`` that refuses to start."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest

from lab.detect_reference import DetectService
from schemas.catalog import default_catalog
from schemas.topics import TOPICS
from services.alerts import tail, webhook
from services.detect.detector import Detector
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS
from services.lake.land import LandingService
from services.lake.writer import LakeWriter
from services.telemetry import ServiceTelemetry

CONF = {"bootstrap.servers": "127.0.0.1:9", "fetch.max.bytes": 1}  # a caller's own: bounded


class _Refused(Exception):
    pass


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    confs: list[dict[str, Any]] = []

    def consumer(conf: dict[str, Any]) -> None:
        confs.append(conf)
        raise _Refused

    for module in (confluent_kafka, tail, webhook):
        monkeypatch.setattr(module, "Consumer", consumer)
    return confs


def _bounded(conf: dict[str, Any]) -> None:
    assert {k: conf.get(k) for k in LIBRDKAFKA_CONSUMER_BOUNDS} == LIBRDKAFKA_CONSUMER_BOUNDS


def test_the_lander_is_bounded(tmp_path: Path) -> None:
    _bounded(LandingService(CONF, LakeWriter(tmp_path), {"telemetry.refined": "samples"}).conf)


def test_detect_is_bounded(seen: list[dict[str, Any]]) -> None:
    svc = DetectService(CONF, TOPICS, Detector(default_catalog()), ServiceTelemetry("t"))
    with pytest.raises(_Refused):
        svc.run(lambda: True)
    _bounded(seen[0])


def test_the_alert_consumers_are_bounded(seen: list[dict[str, Any]]) -> None:
    with pytest.raises(_Refused):
        tail.tail_alerts(CONF, tail.TailOptions(), io.StringIO())
    with pytest.raises(_Refused):
        webhook.WebhookForwarder(CONF, webhook.WebhookSettings(url="http://127.0.0.1:9/"))
    assert len(seen) == 2
    for conf in seen:
        _bounded(conf)
