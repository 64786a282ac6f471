"""The Kafka clients' own log lines: repeats collapsed, the cause of a failure named."""

from __future__ import annotations

import logging

import pytest

from services.kafka.log import KAFKA_LOG, RECENT, CollapseRepeats, describe
from services.settings import KafkaSettings


def test_repeated_lines_are_collapsed_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("refinery.kafka.test-collapse")
    log.addFilter(CollapseRepeats())
    with caplog.at_level(logging.INFO, logger=log.name):
        for ms in range(600):  # librdkafka retries every 50 ms: only the numbers change
            log.error("FAIL 127.0.0.1:1: Connect failed: Connection refused (after %dms)", ms % 3)
        log.error("FAIL 127.0.0.1:1: SSL handshake failed")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert msgs[0].startswith("FAIL 127.0.0.1:1: Connect failed")
    assert (
        msgs[1] == "FAIL 127.0.0.1:1: SSL handshake failed (the previous line repeated 599 times)"
    )


def test_every_confluent_client_logs_through_python_logging() -> None:
    assert KafkaSettings(bootstrap_servers="h:1").librdkafka()["logger"] is KAFKA_LOG


def test_a_failure_names_the_address_and_the_cause() -> None:
    from confluent_kafka import KafkaError, KafkaException

    RECENT.append(
        "FAIL [rdkafka#producer-1] [thrd:10.0.0.9:9093/bootstrap]: 10.0.0.9:9093/bootstrap: "
        "SASL authentication error: Authentication failed (after 12ms in state AUTH_REQ)"
    )
    err = KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))
    line = describe(err, "10.0.0.9:9093")
    assert describe(err, "10.0.0.8:9093") == (  # another address's lines are not its cause
        "cannot use Kafka at 10.0.0.8:9093: Failed to get metadata"
    )
    RECENT.clear()
    assert line == (
        "cannot use Kafka at 10.0.0.9:9093: SASL authentication error: Authentication failed "
        "(after 12ms in state AUTH_REQ) (Failed to get metadata)"
    )
