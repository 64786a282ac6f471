"""A refined group's telemetry, summed per group before it is reported."""

from __future__ import annotations

from services.telemetry import ServiceTelemetry
from services.worker.refiner_outputs import Outcome, RawRecord


class GroupTally:
    """A group's telemetry, summed before it is reported: one counter call per name and
    attribute set per group instead of five or more per record (each call into the
    OpenTelemetry SDK costs microseconds of the refining thread). Histograms still get every
    record's value; the clock gauges the last offset and error bound of each stream, and
    ``refinery.clock.widened`` counts the records whose bound was widened, by why."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self.batch_samples: list[int] = []
        self.freshness_s: list[float] = []
        self.offsets: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def add(self, out: Outcome, rec: RawRecord) -> None:
        c = self.counts
        for key, n in (
            (("refinery.records", (("outcome", out.outcome), ("topic", rec.topic))), 1),
            (("refinery.samples.in", ()), out.input_samples),
            (("refinery.samples.refined", ()), out.refined),
            (("refinery.samples.duplicate", ()), out.duplicate),
            (("refinery.samples.quarantined", ()), out.quarantined),
            *((("refinery.deadletter", (("reason", r),)), n) for r, n in out.reasons.items()),
        ):
            c[key] = c.get(key, 0) + n
        self.batch_samples.append(out.input_samples)
        if out.freshness_ns is not None:
            self.freshness_s.append(out.freshness_ns / 1e9)
        if out.stream is not None and out.clock_offset_ns is not None:
            self.offsets[out.stream] = out.clock_offset_ns
        if out.stream is not None and out.clock is not None:
            self.errors[out.stream] = out.clock.error_ns
            if out.clock.widened is not None:
                key = ("refinery.clock.widened", (("why", out.clock.widened),))
                c[key] = c.get(key, 0) + 1

    def report(self, t: ServiceTelemetry) -> None:
        for (name, attrs), n in self.counts.items():
            t.count(name, n, dict(attrs) if attrs else None)
        for v in self.batch_samples:
            t.record("refinery.batch.samples", v)
        for f in self.freshness_s:
            # a sample is never younger than 0: an aligned time within its bound but ahead of
            # now (a fast clock's sample refined at once) is fresh, not negative
            t.record("refinery.freshness", max(0.0, f), unit="s")
        for stream, off in self.offsets.items():
            t.gauge("refinery.clock.offset_ns", off, {"source": stream})
        for stream, err in self.errors.items():
            t.gauge("refinery.clock.error_ns", err, {"source": stream})
