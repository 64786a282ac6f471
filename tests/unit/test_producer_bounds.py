"""The exporters' producer's buffer bounds: what they drop is the oldest, counted, reported and
logged, never silent. No broker: an unreachable one keeps every batch in the buffers."""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest

from schemas.wire import SAMPLES_SCHEMA, Envelope, SourceId
from services.kafka.producer import BatchProducer
from services.settings import KafkaSettings

SOURCE = SourceId(node="n1", exporter="t", instance="0", boot_id="b")


def _batch(seq: int, n: int) -> tuple[Envelope, pa.Table]:
    t = pa.table(
        {
            "ts_ns": [seq] * n,
            "metric": ["cpu.user_seconds"] * n,
            "device": [f"cpu{i}" for i in range(n)],
            "value": [float(i) for i in range(n)],
            "raw": pa.array(range(n), pa.uint64()),
            "text": pa.nulls(n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return Envelope(source=SOURCE, seq=seq, sent_ns=seq), t


def _producer(dropped: list[tuple[str, int]], **kw: int) -> BatchProducer:
    return BatchProducer(
        KafkaSettings(bootstrap_servers="127.0.0.1:1"),
        topic="telemetry.raw",
        on_drop=lambda tag, n: dropped.append((tag, n)),
        extra_conf={"queue.buffering.max.messages": 2, "log_level": 0},
        **kw,  # type: ignore[arg-type]
    )


def test_a_full_spool_drops_the_oldest_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="services.kafka.producer")
    dropped: list[tuple[str, int]] = []
    p = _producer(dropped, spool_max_batches=3)
    for seq in range(10):
        p.send(*_batch(seq, 4 + seq))
    # two in librdkafka's queue (0, 1), the newest three in the spool (7, 8, 9)
    assert [int(t.rsplit("|", 1)[1]) for t, _ in dropped] == [2, 3, 4, 5, 6]
    assert [n for _, n in dropped] == [6, 7, 8, 9, 10]
    assert (p.stats.dropped_overflow, p.stats.dropped_samples) == (5, 40)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "dropped 1 oldest batches (6 samples)" in said[0], said
    assert p.close(0.2) == 5  # 2 queued + 3 spooled still unsent
    assert "dropped 4 oldest batches (34 samples), 5 batches (40 samples) in all" in (
        caplog.records[-1].getMessage()
    )


def test_later_drops_are_logged_by_poll_once_the_interval_passed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="services.kafka.producer")
    p = _producer([], spool_max_batches=1, drop_log_every_s=0.3)  # type: ignore[arg-type]
    for seq in range(6):  # 2 queued, 1 spooled, 3 dropped: the first one logged at once
        p.send(*_batch(seq, 2))
    assert len(caplog.records) == 1
    p.poll(0.1)
    assert len(caplog.records) == 1  # within the interval: not yet
    p.poll(0.3)
    assert len(caplog.records) == 2
    assert "dropped 2 oldest batches (4 samples), 3 batches (6 samples)" in (
        caplog.records[-1].getMessage()
    )
    p.poll(0.4)
    assert len(caplog.records) == 2  # nothing new: nothing said
    p.close(0.1)


def test_the_spool_is_bounded_in_bytes_too() -> None:
    dropped: list[tuple[str, int]] = []
    p = _producer(dropped, spool_max_bytes=1)  # no room beyond the newest batch
    for seq in range(6):
        p.send(*_batch(seq, 50))
    assert [int(t.rsplit("|", 1)[1]) for t, _ in dropped] == [2, 3, 4]
    assert p.stats.dropped_samples == 150
    p.close(0.1)


def test_the_firmware_exporter_counts_the_drops_in_its_telemetry() -> None:
    from services.exporters.firmware_cli import BatchSink, _count_drops
    from services.settings import RefinerySettings
    from services.telemetry import ServiceTelemetry

    sink = BatchSink(RefinerySettings(), SOURCE, stdout=True, interval_ns=None)
    p = _producer([], spool_max_batches=1)
    sink._producers["telemetry.raw"] = p  # as its first send builds it
    telemetry = ServiceTelemetry("firmware-exporter")
    counted: dict[str, tuple[int, int]] = {}
    for seq in range(5):
        p.send(*_batch(seq, 3))
        _count_drops(telemetry, sink, counted)
    assert p.stats.dropped_overflow == 2  # 2 queued, 1 spooled, 2 dropped
    got = telemetry.total("refinery.exporter.dropped_batches", topic="telemetry.raw")
    assert got == 2
    assert telemetry.total("refinery.exporter.dropped_samples", topic="telemetry.raw") == 6
    p.close(0.1)
    telemetry.shutdown()
