"""``refinery detect`` (default engine): the rules, episodes, stragglers and rollups evaluated
in the stream by a Faust agent. :func:`build_detect_app` builds the app (no module-level App);
run it with :func:`services.kafka.group.run_worker`.

One agent, ``detect``, reads telemetry.refined, telemetry.events.aligned,
telemetry.collectives.aligned and telemetry.accounting (raw bytes) in arrival order and
feeds one :class:`~services.detect.detector.Detector` through
:class:`~services.detect.core.DetectCore` (which the lab's reference loop
``lab.detect_reference`` shares: tests check that both publish the same records).

Per group of records (``noack_take``): route each to the detector, advance it to the
watermark, publish what came out and wait for the broker's acknowledgements — only then are
the records acked, so Faust commits no input whose derived records might be lost. That
contract is one object, :class:`~services.detect.checkpoint.Checkpoint`: the only place a
record is acked, and the only way out for detect's outputs. A timer advances the detector to the
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
between, fetched directly and declared a gap to Faust's consumer, so its commits move past
them (as the refining worker does: :meth:`Checkpoint.fetch_skipped
<services.detect.checkpoint.Checkpoint.fetch_skipped>`).

Replicas: several processes with one ``--group`` share the input partitions (Faust's
assignor). Node-local judgement (rules, silence, episodes, rollups) follows the refined,
events and accounting partitions a replica owns; a job's stragglers are judged by the owner
of its collectives partition (collectives are keyed by job), on what every replica publishes
to the group's progress topic after each group and tick: how far each refined partition is
read, its nodes' newest ts, its episodes (:mod:`~services.detect.progress`, followed by
:class:`~services.detect.progress_feed.ProgressFeed`). A replica killed holds the judgement
of collectives until its partitions are assigned again and warmed up; ids are functions of
the data, so they stay stable across replicas. A failing agent crashes the process non-zero
(``CrashingSupervisor``); SIGTERM stops it cleanly (exit 0) after publishing what the
detector still holds (:meth:`Detector.flush`); so does ``idle_exit_s`` without input,
counted from the end of the warm-up.

The parts: :mod:`~services.detect.runner` (the agent's groups, the warm-up, the tick, the
final flush, ``/health``), :mod:`~services.detect.checkpoint` (publish, then ack: where an
offset is committed), :mod:`~services.detect.warmup` (the warm-up read); this module
builds them and wires them to the Faust app.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import faust
from mode import CrashingSupervisor

from schemas.topics import Topics
from services.detect.checkpoint import Checkpoint
from services.detect.core import DetectCore, read_topics
from services.detect.detector import Detector
from services.detect.progress import ProgressView, replica_id
from services.detect.progress_feed import ProgressFeed, ensure_topic, progress_topic
from services.detect.runner import DetectConfig, DetectRunner
from services.kafka import hooks
from services.kafka.faust_app import GatheringApp as FaustApp
from services.kafka.feed import TopologyFeed
from services.kafka.group import credentials
from services.kafka.outputs import OutputProducer
from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry

log = logging.getLogger(__name__)

# Input in flight, bounded in bytes whatever the node count, for a process behind its input
# (a restart on a backlog, every source new at the start). A refined record is one node's
# rows of a worker group: ~500 kB as Arrow, ~50 kB as zstd stores it (309 and 31 B/sample). A
# fetch holds up to FETCH_BYTES (compressed) per partition; aiokafka decompresses and copies
# out at most POLL_RECORDS records per poll (unbounded before: every record fetched), and
# Faust buffers STREAM_BUFFER of them for the agent: ~24 MB of refined records in flight
# (1024 and 64 before: ~500 MB; 128 and 64: the process's peak RSS at 64 simulated nodes was
# 384 MiB against 343 MiB at 16 and 16, at the same CPU per sample).
FETCH_BYTES = 2 * 1024 * 1024
POLL_RECORDS = 16
STREAM_BUFFER = 32

__all__ = ["DetectApp", "DetectConfig", "build_detect_app"]


@dataclass(frozen=True)
class DetectApp:
    """The built detect process: its Faust app (run it with ``run_worker``), its
    :class:`DetectCore` (counts in ``stats``) and the process's output producer."""

    app: faust.App
    core: DetectCore
    outputs: OutputProducer
    runner: DetectRunner


def build_detect_app(
    kafka: KafkaSettings,
    topics: Topics,
    detector: Detector,
    telemetry: ServiceTelemetry,
    cfg: DetectConfig,
) -> DetectApp:
    """A configured Faust app with the ``detect`` agent, its tick, signals and pages."""
    app = _faust_app(kafka, cfg)
    conf = kafka.librdkafka()
    ptopic = progress_topic(cfg.group)
    view = ProgressView(replica_id(), ensure_topic(conf, ptopic, topics.refined) or None)
    detector.judge_on(view)
    core = DetectCore(topics, detector, telemetry, view, ptopic)
    feed = TopologyFeed(conf, topics.topology, topics.jobs)
    progress = ProgressFeed(conf, ptopic, view, cfg.lookback_s)
    outputs = OutputProducer(kafka, cfg.group)
    checkpoint = Checkpoint(app, conf, outputs)
    runner = DetectRunner(app, conf, core, feed, progress, checkpoint, telemetry, cfg)

    async def detect(stream: Any) -> None:  # the agent services.detect.agent.detect
        await runner.run(stream)

    async def start_feed() -> None:
        log.info("detect: subscribed to %s as group %s (replica %s)",
                 ", ".join(read_topics(topics)), cfg.group, view.replica)  # fmt: skip
        feed.start()
        progress.start()

    async def assigned(partitions: set[Any]) -> None:
        shown = ", ".join(sorted(f"{tp.topic}:{tp.partition}" for tp in partitions))
        log.info("detect: group %s assigned %s", cfg.group, shown or "no partitions")
        await runner.assigned(partitions)

    topic = app.topic(
        *read_topics(topics),
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )
    app.agent(topic, supervisor_strategy=CrashingSupervisor)(detect)
    hooks.on_assigned(app, assigned)
    hooks.add_task(app, start_feed)
    hooks.add_timer(app, cfg.tick_s, runner.tick)
    hooks.on_stopping(app, runner.stopping)

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        body, ok = runner.health()
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.text(telemetry.prometheus_text())

    return DetectApp(app, core, outputs, runner)


def _faust_app(kafka: KafkaSettings, cfg: DetectConfig) -> faust.App:
    """Faust's defaults but for: commits every second (a kill replays little), produce
    requests that fail after 30 s instead of 20 min (the agent crashes, the process exits
    non-zero), no wait for records in flight on a rebalance or a stop (not acked, so not
    committed: read again), input in flight bounded in bytes (see :data:`FETCH_BYTES`), and
    fetches that gather up to 50 ms of records (``services.kafka.faust_app.GatheringApp``).
    Input topics are never declared; Faust declares only its own assignor topic."""
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    return FaustApp(
        cfg.group,
        broker=kafka.faust_broker(),
        broker_credentials=credentials(kafka),
        broker_session_timeout=kafka.session_timeout_s,
        broker_heartbeat_interval=kafka.heartbeat_interval_s,
        autodiscover=False,
        datadir=str(cfg.data_dir),
        broker_commit_interval=1.0,
        consumer_max_fetch_size=FETCH_BYTES,
        broker_max_poll_records=POLL_RECORDS,
        producer_linger_ms=5,
        producer_compression_type="zstd",
        producer_request_timeout=30.0,
        stream_wait_empty=False,
        stream_buffer_maxsize=STREAM_BUFFER,
        web_enabled=cfg.web_port is not None,
        web_port=cfg.web_port or 6067,
        web_bind=cfg.web_host,
        web_host=cfg.web_host,
    )
