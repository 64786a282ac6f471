"""``refinery detect`` (default engine): the rules, episodes, stragglers and rollups evaluated
in the stream by a Faust agent. :func:`build_detect_app` builds the app (no module-level App);
run it with :func:`services.kafka.group.run_worker`.

One agent, ``detect``, reads telemetry.refined, telemetry.events.aligned,
telemetry.collectives.aligned and telemetry.accounting (raw bytes) in arrival order and
feeds one :class:`~services.detect.detector.Detector` through
:class:`~services.detect.core.DetectCore` (which the lab's reference loop
``lab.detect_reference`` shares: tests check that both publish the same records).

Per group of records (``noack_take``): route each to the detector, advance it to the
watermark, publish what came out and wait for the broker's acknowledgements
(:func:`~services.kafka.group.publish_acked`) — only then are the records acked, so Faust
commits no input whose derived records might be lost. A timer advances the detector to the
watermark and runs its time-driven checks every ``tick_s``; the watermark's high watermarks
are the consumer's, as last fetched.

Warm-up: when partitions are assigned, records are held back until the span of each newly
assigned partition, ``lookback_s`` of broker time before its committed offset, has been
read directly (confluent-kafka) and fed to the detector without publishing what it
produced, so alert and episode ids continue those of the previous process. Time-driven
outputs of the warm-up (the watermark's judgements, one tick) are published: a previous
process may have died before publishing them, and consumers deduplicate on ``(id, state)``.
A record at an offset already fed (a rebalance makes the consumer resume from the committed
offset) is skipped; one after a jump in a partition's offsets is preceded by the records in
between, fetched directly (as the refining worker does).

One process owns every partition: cross-layer answers need every node's episodes next to
every job's collectives. Run one per cluster. A failing agent crashes the process non-zero
(``CrashingSupervisor``); SIGTERM stops it cleanly (exit 0) after publishing what the
detector still holds (:meth:`Detector.flush`); so does ``idle_exit_s`` without input,
counted from the end of the warm-up.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from mode import CrashingSupervisor

from services.detect.core import DetectCore, DetectTopics, Span, assigned_spans
from services.detect.detector import Detector, Emitted
from services.gc_pacer import GcPacer
from services.kafka.faust_app import App as FaustApp
from services.kafka.feed import TopologyFeed
from services.kafka.group import (
    Progress,
    credentials,
    manual_acks,
    publish_acked,
)
from services.kafka.outputs import OutMessage, OutputProducer
from services.kafka.watch import fetch_range
from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DetectConfig:
    group: str = "refinery-detect"  # the Faust app id, hence the consumer group
    lookback_s: float = 600.0
    idle_exit_s: float | None = None
    web_port: int | None = None  # /health and /metrics on web_host (None: off)
    web_host: str = "127.0.0.1"  # the bind address (a pod's IP where probes call it)
    data_dir: Path = Path(".refinery/detect")
    take_max: int = 500
    take_within_s: float = 0.2
    tick_s: float = 1.0
    warmup_stall_s: float = 60.0  # warm-up reads nothing this long: crash
    stall_after_s: float = 30.0  # /health: a group in flight this long is unhealthy
    gc_settle_every_s: float = 600.0  # full garbage collections on this schedule (GcPacer)


@dataclass
class _State:
    owned: set[tuple[str, int]] = field(default_factory=set)
    next_offset: dict[tuple[str, int], int] = field(default_factory=dict)  # next to feed
    warmups: int = 0  # warm-ups under way
    last_data: float = field(default_factory=time.monotonic)
    flushed: bool = False
    skipped: int = 0  # records at offsets already fed, or of partitions no longer owned
    refetched: int = 0  # records after an offset jump, fetched directly


def build_detect_app(
    kafka: KafkaSettings,
    topics: DetectTopics,
    detector: Detector,
    telemetry: ServiceTelemetry,
    cfg: DetectConfig,
) -> faust.App:
    """A configured Faust app with the ``detect`` agent; run it with ``run_worker``. Its
    :class:`DetectCore` (counts in ``stats``) is the app's ``refinery_detect``."""
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    # Faust's defaults but for: commits every second (a kill replays little), produce
    # requests that fail after 30 s instead of 20 min (the agent crashes, the process exits
    # non-zero), no wait for records in flight on a rebalance or a stop (not acked, so not
    # committed: read again), a bounded stream buffer (refined records are large). Input
    # topics are never declared; Faust declares only its own assignor topic.
    app = FaustApp(
        cfg.group,
        broker=kafka.faust_broker(),
        broker_credentials=credentials(kafka),
        broker_session_timeout=kafka.session_timeout_s,
        broker_heartbeat_interval=kafka.heartbeat_interval_s,
        autodiscover=False,
        datadir=str(cfg.data_dir),
        broker_commit_interval=1.0,
        consumer_max_fetch_size=16 * 1024 * 1024,
        producer_linger_ms=5,
        producer_compression_type="zstd",
        producer_request_timeout=30.0,
        stream_wait_empty=False,
        stream_buffer_maxsize=1024,
        web_enabled=cfg.web_port is not None,
        web_port=cfg.web_port or 6067,
        web_bind=cfg.web_host,
        web_host=cfg.web_host,
    )
    conf = kafka.librdkafka()
    core = DetectCore(topics, detector, telemetry)
    feed = TopologyFeed(conf, topics.topology, topics.jobs)
    state = _State()
    progress = Progress()
    outputs = OutputProducer(kafka, cfg.group)
    # primed when the agent starts (the long first settle before any record waits), then
    # again after the first group
    gc_pacer = GcPacer(cfg.gc_settle_every_s)
    lock = asyncio.Lock()  # one user of the detector at a time, outputs in order
    ready = asyncio.Event()  # set while no warm-up is under way
    inputs = set(topics.inputs)

    def high(p: int) -> int:
        try:
            h = app.consumer.highwater(faust.types.TP(topics.refined, p))
        except Exception:  # not assigned (any more), or not started
            return -1
        return -1 if h is None else int(h)

    def advanced(out: Emitted, now: int) -> Emitted:
        wm = core.watermark(high)
        if wm is not None:
            out.extend(detector.advance(wm, now))
        return out

    async def route(events: list[Any]) -> list[OutMessage]:
        """Feed a group of events to the detector; the records to publish."""
        core.sync_topology(feed)
        now = time.time_ns()
        todo: list[tuple[str, int, int, bytes]] = []
        for ev in events:
            m = ev.message
            tp = (m.topic, m.partition)
            nxt = state.next_offset.get(tp)
            if tp not in state.owned or (nxt is not None and m.offset < nxt):
                state.skipped += 1
                continue
            if nxt is not None and m.offset > nxt:
                for g in await _fetch_between(conf, m.topic, m.partition, nxt, m.offset):
                    state.refetched += 1
                    todo.append((m.topic, m.partition, g.offset(), g.value()))
            todo.append((m.topic, m.partition, m.offset, m.value))
            state.next_offset[tp] = m.offset + 1
        # in a thread: a group's evaluation is one long Arrow call sequence, and the loop
        # meanwhile serves fetches, sends, heartbeats and the web page
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, core.route_group, todo, now)
        return core.messages(advanced(out, now))

    @app.agent(
        app.topic(
            *topics.inputs,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
        ),
        supervisor_strategy=CrashingSupervisor,
    )
    async def detect(stream: Any) -> None:
        if gc_pacer.prime():
            telemetry.record("detect.gc_settle_s", gc_pacer.last_pause_s, unit="s")
        async with manual_acks(stream, cfg.take_max, cfg.take_within_s) as groups:
            async for events in groups:
                await ready.wait()
                progress.last_group_started = time.monotonic()
                async with lock:
                    with telemetry.span("detect.group", {"records": len(events)}):
                        # derived records first
                        await publish_acked(app, outputs, await route(events))
                for ev in events:  # then Faust may commit the input
                    await stream.ack(ev)
                progress.groups += 1
                progress.records += len(events)
                progress.last_group_done = state.last_data = time.monotonic()
                if gc_pacer.maybe():  # between groups: the one full collection it takes
                    telemetry.record("detect.gc_settle_s", gc_pacer.last_pause_s, unit="s")

    def warm_up(parts: list[tuple[str, int]], keep: list[int]) -> tuple[list[Span], Emitted]:
        """Read the warm-up spans of ``parts`` into the detector (blocking: runs in a
        thread while the lock keeps every other user of the detector away)."""
        from confluent_kafka import Consumer, TopicPartition

        from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

        c = Consumer(
            {
                **conf,
                **LIBRDKAFKA_CONSUMER_BOUNDS,  # what a fetch carries and a batch inflates to
                "group.id": cfg.group,  # only to read the committed offsets: never joins
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        out = Emitted()
        try:
            spans = assigned_spans(
                c, [TopicPartition(t, p) for t, p in parts], int(cfg.lookback_s * 1000)
            )
            core.begin(spans, keep=keep)
            highs = {
                p: int(c.get_watermark_offsets(TopicPartition(topics.refined, p), timeout=10)[1])
                for p in core.refined_partitions
            }
            todo = {(s.topic, s.partition): s.resume for s in spans if s.start < s.resume}
            c.assign([TopicPartition(s.topic, s.partition, s.start) for s in spans
                      if s.start < s.resume])  # fmt: skip
            last = time.monotonic()
            while todo:
                msgs: list[Any] = c.consume(500, 0.5)
                now = time.time_ns()
                got: list[tuple[str, int, int, bytes]] = []
                for m in msgs:
                    tp = (m.topic(), m.partition())
                    if m.error() is not None or m.offset() >= todo.get(tp, -1):
                        continue
                    got.append((tp[0], tp[1], m.offset(), m.value()))
                    if m.offset() >= todo[tp] - 1:
                        del todo[tp]
                        c.pause([TopicPartition(*tp)])  # read up to its committed offset
                core.route_group(got, now)  # not published
                core.stats["warmup"] += len(got)
                if msgs:
                    last = time.monotonic()
                else:
                    for tp, end in list(todo.items()):
                        if c.position([TopicPartition(*tp)])[0].offset >= end:
                            del todo[tp]
                    if time.monotonic() - last > cfg.warmup_stall_s:
                        raise RuntimeError(f"warm-up read nothing for {cfg.warmup_stall_s}s; "
                                           f"left: {sorted(todo.items())}")  # fmt: skip
                wm = core.watermark(lambda p: highs.get(p, -1))
                if wm is not None:
                    out.extend(detector.advance(wm, now))
            out.extend(detector.tick(time.time_ns()))
        finally:
            c.close()
        return spans, out

    async def run_warm_up(parts: list[tuple[str, int]], keep: list[int]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with lock:
                await loop.run_in_executor(None, feed.wait_caught_up, 60)
                core.sync_topology(feed)
                t0, n0 = time.monotonic(), core.stats["warmup"]
                spans, out = await loop.run_in_executor(None, warm_up, parts, keep)
                await publish_acked(app, outputs, core.messages(out))
                for s in spans:
                    state.next_offset[(s.topic, s.partition)] = s.resume
                log.info(
                    "warm-up of %d partitions: %d records in %.1fs",
                    len(spans), core.stats["warmup"] - n0, time.monotonic() - t0,
                )  # fmt: skip
        finally:
            state.warmups -= 1
        if state.warmups == 0:
            state.last_data = time.monotonic()
            ready.set()

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: Iterable[Any], **kwargs: Any) -> None:
        mine = {(tp.topic, tp.partition) for tp in assigned if tp.topic in inputs}
        new = sorted(mine - state.owned)
        state.owned = mine
        for tp in list(state.next_offset):
            if tp not in mine:
                del state.next_offset[tp]
        if not new:
            return
        ready.clear()  # the agent holds its records back until the warm-up is done
        state.warmups += 1
        keep = [p for t, p in mine if t == topics.refined and (t, p) not in new]
        app.add_future(run_warm_up(new, keep))  # in the background: the rebalance completes

    @app.task  # type: ignore[untyped-decorator]
    async def start_feed() -> None:
        feed.start()

    async def publish_flush() -> None:
        if state.flushed:
            return
        state.flushed = True
        await asyncio.wait_for(lock.acquire(), 10)
        try:
            await publish_acked(app, outputs, core.messages(detector.flush()))
        finally:
            lock.release()

    @app.timer(interval=cfg.tick_s)  # type: ignore[untyped-decorator]
    async def tick() -> None:
        if not ready.is_set() or state.flushed:
            return
        async with lock:
            core.sync_topology(feed)
            now = time.time_ns()
            out = advanced(Emitted(), now)  # the watermark first, then what it makes due
            out.extend(detector.tick(now))
            await publish_acked(app, outputs, core.messages(out))
        telemetry.gauge("detect.groups", progress.groups)
        idle = time.monotonic() - state.last_data
        if cfg.idle_exit_s is not None and idle > cfg.idle_exit_s:
            log.info("no input for %.0fs: stopping", idle)
            await publish_flush()
            signal.raise_signal(signal.SIGTERM)  # the worker's own clean stop

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def on_shutdown(app_: Any, **kwargs: Any) -> None:
        try:
            await publish_flush()
        except Exception as e:  # stopping anyway; the next process warms up again
            log.warning("detect: final flush not published: %s", e)
        feed.stop()

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        ok = ready.is_set() and progress.healthy(cfg.stall_after_s)
        body = {
            "healthy": ok,
            "warm": ready.is_set(),
            "groups": progress.groups,
            "records": progress.records,
            "since_last_group_s": round(time.monotonic() - progress.last_group_done, 1),
            "stats": {**core.stats, "skipped": state.skipped, "refetched": state.refetched},
        }
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.text(telemetry.prometheus_text())

    app.refinery_detect = core  # type: ignore[attr-defined]
    return app


async def _fetch_between(conf: dict[str, Any], topic: str, partition: int, start: int,
                         end: int) -> list[Any]:  # fmt: skip
    """Records ``[start, end)`` the stream never handed over (offsets are contiguous)."""
    got = await asyncio.get_running_loop().run_in_executor(
        None, fetch_range, conf, topic, partition, start, end
    )
    log.warning("%s[%d]: offsets %d..%d never reached the agent; fetched %d",
                topic, partition, start, end - 1, len(got))  # fmt: skip
    return got
