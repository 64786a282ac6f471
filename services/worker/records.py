"""The refiner's input records, from a Faust event's message (aiokafka) or from a record
fetched directly (confluent-kafka)."""

from __future__ import annotations

from typing import Any

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

from services.worker.refiner_outputs import RawRecord


def raw_record(m: Any) -> RawRecord:
    """A Faust event's message."""
    return RawRecord(
        topic=m.topic,
        partition=m.partition,
        offset=m.offset,
        key=m.key,
        value=m.value,
        headers=_headers(m.headers),
        append_ms=round(m.timestamp * 1000),
        log_append=getattr(m, "timestamp_type", 1) == 1,  # aiokafka: 1 LogAppendTime
    )


def confluent_record(m: Any) -> RawRecord:
    """A confluent-kafka message (fetched directly)."""
    return RawRecord(
        topic=m.topic(),
        partition=m.partition(),
        offset=m.offset(),
        key=m.key(),
        value=m.value(),
        headers=[(k, v or b"") for k, v in (m.headers() or [])],
        append_ms=m.timestamp()[1],
        log_append=m.timestamp()[0] == TIMESTAMP_LOG_APPEND_TIME,
    )


def _headers(h: Any) -> list[tuple[str, bytes]]:
    if not h:
        return []
    items = h.items() if isinstance(h, dict) else h
    return [(str(k), v if isinstance(v, bytes) else str(v).encode()) for k, v in items]
