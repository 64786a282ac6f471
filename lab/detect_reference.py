"""The lab's reference detect engine: one plain confluent-kafka loop over telemetry.refined,
the aligned events and collectives topics and the accounting topic, feeding
:class:`~services.detect.detector.Detector` through :class:`~services.detect.core.DetectCore`,
publishing alerts, episodes and rollups, committing input offsets only after those are
acknowledged. The product's engine is the Faust agent of :mod:`services.detect.agent`; this loop
is kept only to check it against (``tests/integration/test_detect_faust.py``):
``python -m lab.detect_reference --topic-prefix P --group G [--idle-exit S]``.

Restart: on assignment the loop rewinds each partition to the start of its warm-up span
(``lookback_s`` of broker time before its committed offset) and replays that span *without
publishing* what its records produce, then publishes from the committed offset on. The
watermark is handed to :meth:`Detector.advance` after every poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from schemas.topics import TOPICS, Topics
from services.detect.core import DetectCore, assigned_spans, read_topics
from services.detect.detector import Detector, Emitted
from services.kafka.feed import TopologyFeed
from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS
from services.telemetry import ServiceTelemetry

log = logging.getLogger(__name__)


class DetectService:
    """The consume → detect → publish → commit loop. Not thread-safe."""

    def __init__(
        self,
        conf: dict[str, Any],
        topics: Topics,
        detector: Detector,
        telemetry: ServiceTelemetry,
        group: str = "refinery-detect",
        lookback_s: float = 600.0,
    ) -> None:
        self.conf = conf
        self.topics = topics
        self.core = DetectCore(topics, detector, telemetry)
        self.detector = detector
        self.group = group
        self.lookback_ms = int(lookback_s * 1000)
        self._emit_from: dict[tuple[str, int], int] = {}

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    def run(self, stop: Callable[[], bool], idle_exit_s: float | None = None) -> int:
        from confluent_kafka import Consumer, Producer

        consumer = Consumer(
            {
                **self.conf,
                **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
                "group.id": self.group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "max.poll.interval.ms": 300000,
            }
        )
        producer = Producer(
            {
                **self.conf,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "compression.type": "zstd",
            }
        )
        feed = TopologyFeed(self.conf, self.topics.topology, self.topics.jobs)
        feed.start()
        feed.wait_caught_up(60)
        consumer.subscribe(read_topics(self.topics), on_assign=self._on_assign(consumer))
        last_tick = last_commit = last_data = time.monotonic()
        pending: dict[tuple[str, int], int] = {}
        try:
            while not stop():
                self.core.sync_topology(feed)
                msgs: list[Any] = consumer.consume(500, 0.2)
                now = time.time_ns()
                warm: list[tuple[str, int, int, bytes]] = []  # read again, not published
                live: list[tuple[str, int, int, bytes]] = []
                for m in msgs:
                    if m.error() is not None:
                        continue
                    tp = (m.topic(), m.partition())
                    pending[tp] = m.offset() + 1
                    rec = (tp[0], tp[1], m.offset(), m.value())
                    (warm if m.offset() < self._emit_from.get(tp, 0) else live).append(rec)
                self.stats["warmup"] += len(warm)
                self.core.route_group(warm, now)  # a partition's warm-up precedes its live
                self._publish(producer, self.core.route_group(live, now))
                if msgs:
                    last_data = time.monotonic()
                wm = self._watermark(consumer)
                if wm is not None:
                    self._publish(producer, self.detector.advance(wm, time.time_ns()))
                if time.monotonic() - last_tick >= 1.0:
                    last_tick = time.monotonic()
                    self._publish(producer, self.detector.tick(time.time_ns()))
                if pending and time.monotonic() - last_commit >= 1.0:
                    self._commit(consumer, producer, pending)
                    last_commit = time.monotonic()
                if idle_exit_s is not None and time.monotonic() - last_data > idle_exit_s:
                    break
            self._publish(producer, self.detector.flush())
            self._commit(consumer, producer, pending)
        finally:
            consumer.close()
            feed.stop()
        return 0

    def _on_assign(self, consumer: Any) -> Callable[[Any, Any], None]:
        from confluent_kafka import TopicPartition

        def on_assign(c: Any, parts: list[Any]) -> None:
            spans = assigned_spans(consumer, parts, self.lookback_ms)
            self.core.begin(spans)
            for s in spans:
                self._emit_from[(s.topic, s.partition)] = s.resume
            c.assign([TopicPartition(s.topic, s.partition, s.start) for s in spans])

        return on_assign

    def _watermark(self, consumer: Any) -> int | None:
        """The watermark with the high watermarks as last fetched (no broker round trip)."""
        from confluent_kafka import TopicPartition

        def high(p: int) -> int:
            tp = TopicPartition(self.topics.refined, p)
            return int((consumer.get_watermark_offsets(tp, cached=True) or (-1, -1))[1])

        return self.core.watermark(high)

    def _publish(self, producer: Any, out: Emitted) -> None:
        for m in self.core.messages(out):
            producer.produce(m.topic, m.value, key=m.key, headers=m.headers or None)
        producer.poll(0)

    def _commit(self, consumer: Any, producer: Any, pending: dict[tuple[str, int], int]) -> None:
        from confluent_kafka import TopicPartition

        left = producer.flush(30)
        if left:
            raise RuntimeError(f"{left} derived records not acknowledged; not committing")
        if pending:
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in pending.items()],
                asynchronous=False,
            )
            pending.clear()


def main(argv: list[str] | None = None) -> int:
    """Run the reference loop with the detect command's topic, group and warm-up options; the
    cluster settings come from the environment as for every Refinery command."""
    import argparse
    import signal
    import sys

    from schemas.catalog import default_catalog
    from services.detect.detector import DEFAULT_RULES
    from services.settings import load_settings

    p = argparse.ArgumentParser(prog="python -m lab.detect_reference")
    p.add_argument("--topic-prefix", default="")
    p.add_argument("--group", default="refinery-detect-reference")
    p.add_argument("--lookback", type=float, default=600.0)
    p.add_argument("--idle-exit", type=float, default=None)
    p.add_argument("--rules", default=None)
    p.add_argument("--loglevel", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.loglevel.upper(), stream=sys.stderr)
    settings = load_settings()
    rules = args.rules or DEFAULT_RULES
    detector = Detector(default_catalog(), rules, raw_topic=args.topic_prefix + "telemetry.raw")
    telemetry = ServiceTelemetry("detect-reference")
    stopping = {"now": False}

    def stop(*_: Any) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service = DetectService(
        settings.kafka().librdkafka(),
        TOPICS.with_prefix(args.topic_prefix),
        detector,
        telemetry,
        group=args.group,
        lookback_s=args.lookback,
    )
    try:
        rc = service.run(lambda: stopping["now"], idle_exit_s=args.idle_exit)
    finally:
        telemetry.shutdown()
    print(f"detect-reference: {service.stats}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
