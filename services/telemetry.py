"""Refinery's own telemetry with the OpenTelemetry SDK: metrics and traces for every stage.

:class:`ServiceTelemetry` is built once by ``main()`` and handed to the components that report
(no global registry: it owns its own ``MeterProvider``/``TracerProvider``). Export goes over
OTLP/HTTP when an endpoint is configured; otherwise the numbers stay readable locally through
:meth:`snapshot` (and a Prometheus-format text page from :meth:`prometheus_text`).

Rule, as in the SDK itself: log, count, never raise into the data path — every recording
method swallows and logs its own failures.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

Attrs = Mapping[str, str | int | float | bool]


class ServiceTelemetry:
    """Counters, histograms and gauges of one Refinery process."""

    def __init__(self, service: str, *, otlp_endpoint: str | None = None) -> None:
        resource = Resource.create({"service.name": f"refinery-{service}"})
        self._local = InMemoryMetricReader()
        readers: list[MetricReader] = [self._local]
        self._tracer_provider = TracerProvider(resource=resource)
        if otlp_endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,
                )
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
                from opentelemetry.sdk.trace.export import BatchSpanProcessor

                readers.append(
                    PeriodicExportingMetricReader(
                        OTLPMetricExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/metrics"),
                        export_interval_millis=10_000,
                    )
                )
                self._tracer_provider.add_span_processor(
                    BatchSpanProcessor(
                        OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces")
                    )
                )
            except Exception:  # never let telemetry stop the service
                log.exception("OTLP export disabled")
        self._provider = MeterProvider(resource=resource, metric_readers=readers)
        self._meter = self._provider.get_meter("refinery")
        self.tracer = self._tracer_provider.get_tracer("refinery")
        self._lock = threading.Lock()
        self._counters: dict[str, Any] = {}
        self._histograms: dict[str, Any] = {}
        self._gauges: dict[str, dict[tuple[tuple[str, Any], ...], float]] = {}

    # -- recording (never raises) -------------------------------------------------------------

    def count(self, name: str, value: int = 1, attrs: Attrs | None = None) -> None:
        try:
            c = self._counters.get(name)
            if c is None:
                with self._lock:
                    c = self._counters.setdefault(name, self._meter.create_counter(name))
            c.add(value, dict(attrs or {}))
        except Exception:
            log.exception("telemetry count %s failed", name)

    def record(self, name: str, value: float, attrs: Attrs | None = None, unit: str = "") -> None:
        try:
            h = self._histograms.get(name)
            if h is None:
                with self._lock:
                    h = self._histograms.setdefault(
                        name, self._meter.create_histogram(name, unit=unit)
                    )
            h.record(value, dict(attrs or {}))
        except Exception:
            log.exception("telemetry record %s failed", name)

    def gauge(self, name: str, value: float, attrs: Attrs | None = None) -> None:
        """Last value per attribute set, observed at each collection."""
        try:
            key = tuple(sorted((attrs or {}).items()))
            with self._lock:
                series = self._gauges.get(name)
                if series is None:
                    series = self._gauges[name] = {}
                    self._meter.create_observable_gauge(name, callbacks=[self._observe(name)])
                series[key] = value
        except Exception:
            log.exception("telemetry gauge %s failed", name)

    def _observe(self, name: str) -> Any:
        from opentelemetry.metrics import CallbackOptions, Observation

        def cb(_: CallbackOptions) -> Iterator[Observation]:
            with self._lock:
                items = list(self._gauges.get(name, {}).items())
            for key, v in items:
                yield Observation(v, dict(key))

        return cb

    @contextmanager
    def span(self, name: str, attrs: Attrs | None = None) -> Iterator[None]:
        try:
            cm = self.tracer.start_as_current_span(name, attributes=dict(attrs or {}))
        except Exception:
            log.exception("telemetry span %s failed", name)
            yield
            return
        with cm:
            yield

    # -- reading ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Current values: metric name → list of {attributes, value} (sum, last or histogram
        count/sum)."""
        out: dict[str, list[dict[str, Any]]] = {}
        try:
            data = self._local.get_metrics_data()
        except Exception:
            log.exception("telemetry snapshot failed")
            return out
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    rows = out.setdefault(m.name, [])
                    for p in m.data.data_points:
                        v: Any
                        if hasattr(p, "value"):
                            v = p.value
                        else:
                            v = {"count": p.count, "sum": p.sum, "max": p.max}
                        rows.append({"attributes": dict(p.attributes or {}), "value": v})
        return out

    def total(self, name: str, **match: Any) -> float:
        """Sum of a counter's points whose attributes include ``match``."""
        total = 0.0
        for row in self.snapshot().get(name, []):
            if all(row["attributes"].get(k) == v for k, v in match.items()):
                v = row["value"]
                total += v["sum"] if isinstance(v, dict) else v
        return total

    def prometheus_text(self) -> str:
        """The snapshot in Prometheus text exposition format (for a local scrape)."""
        lines = []
        for name, rows in sorted(self.snapshot().items()):
            metric = name.replace(".", "_").replace("-", "_")
            for row in rows:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(row["attributes"].items()))
                lab = "{" + labels + "}" if labels else ""
                v = row["value"]
                if isinstance(v, dict):
                    lines.append(f"{metric}_count{lab} {v['count']}")
                    lines.append(f"{metric}_sum{lab} {v['sum']}")
                else:
                    lines.append(f"{metric}{lab} {v}")
        return "\n".join(lines) + "\n"

    def shutdown(self) -> None:
        try:
            self._provider.shutdown()
            self._tracer_provider.shutdown()
        except Exception:
            log.exception("telemetry shutdown failed")
