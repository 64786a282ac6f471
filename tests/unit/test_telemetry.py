"""The service's own telemetry: readable locally, and it never raises into the caller."""

from __future__ import annotations

from services.telemetry import ServiceTelemetry


def test_counts_gauges_and_histograms_are_readable_locally() -> None:
    t = ServiceTelemetry("test")
    t.count("records", 3, {"outcome": "refined"})
    t.count("records", 2, {"outcome": "refined"})
    t.count("records", 1, {"outcome": "deadletter", "reason": "undecodable"})
    t.gauge("clock.offset_ns", -5.0, {"source": "n1"})
    t.gauge("clock.offset_ns", 7.0, {"source": "n1"})
    t.record("batch.samples", 100)
    t.record("batch.samples", 300)
    assert t.total("records", outcome="refined") == 5
    assert t.total("records", reason="undecodable") == 1
    assert t.total("batch.samples") == 400
    text = t.prometheus_text()
    assert 'clock_offset_ns{source="n1"} 7.0' in text
    assert "batch_samples_count 2" in text
    t.shutdown()


def test_bad_attributes_never_raise() -> None:
    t = ServiceTelemetry("test")
    t.count("records", 1, {"bad": object()})  # type: ignore[dict-item]
    t.record("x", float("nan"))
    t.gauge("g", 1.0, {"k": [1, 2]})  # type: ignore[dict-item]
    with t.span("stage", {"a": 1}):
        pass
    t.snapshot()
