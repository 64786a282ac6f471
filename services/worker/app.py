"""The refining worker: a Faust app built by :func:`build_app` (no module-level App).

Agents, each a thin shim over :class:`services.worker.refiner.Refiner`:

- ``refine``: telemetry.raw → telemetry.refined, telemetry.deadletter, telemetry.accounting,
  telemetry.alerts (clock). State in the changelog-backed tables ``refine-streams`` (per
  source stream) and ``refine-nodes`` (per node, overlapping sources).
- ``align``: telemetry.events + telemetry.collectives → telemetry.events.aligned /
  telemetry.collectives.aligned, same contract; state in ``align-streams``.

Per group of records (``noack_take``): process each, publish the outputs and wait for their
acknowledgements. At most every ``checkpoint_every_s`` (and when the worker stops, its
partitions are revoked or input pauses) the state changed since the last checkpoint is
written to the tables and its changelog records acknowledged too — only then are the records
of the groups it covers acked, so Faust may commit their offsets; a group that failed is
never acked. When an offset is safe to commit, and why a crash anywhere loses and duplicates
nothing, is :mod:`services.worker.checkpoint`.

A failing agent crashes the worker (``CrashingSupervisor``): the process exits non-zero
instead of running on without committing. ``/health`` on the web port answers 200 while
groups complete (or nothing waits), 503 when progress has stalled.

The parts: :mod:`~services.worker.config` (settings), :mod:`~services.worker.groups` (the group
runner), :mod:`~services.worker.checkpoint` (the commit: outputs, state, offsets),
:mod:`~services.worker.gaps` (the gap guard), :mod:`~services.worker.health` (the watch and
``/health``); this module builds them and wires them to the Faust app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import faust
from mode import CrashingSupervisor

from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import Catalog, default_catalog
from schemas.ingest import IngestDecoder
from services.kafka import hooks
from services.kafka import internals as kafka_internals
from services.kafka.faust_app import App as FaustApp
from services.kafka.feed import TopologyFeed
from services.kafka.group import credentials
from services.kafka.outputs import OutputProducer
from services.kafka.watch import CommitWatch
from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry
from services.worker.checkpoint import Checkpoint
from services.worker.config import WorkerConfig
from services.worker.gaps import GapGuard
from services.worker.groups import GroupRunner, Lane
from services.worker.guard import DeadLetterStep
from services.worker.health import WorkerWatch
from services.worker.refiner import Refiner

__all__ = ["Worker", "WorkerConfig", "build_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Worker:
    """The built worker: its Faust app (run it with :func:`services.kafka.group.run_worker`),
    the process's output producer and the group runner both agents share."""

    app: faust.App
    outputs: OutputProducer
    runner: GroupRunner


def build_app(
    kafka: KafkaSettings,
    cfg: WorkerConfig,
    telemetry: ServiceTelemetry,
    catalog: Catalog | None = None,
) -> Worker:
    """The worker's parts, wired to a configured Faust app with the refining agents."""
    cat = catalog or default_catalog()
    kafka_internals.install()  # no batch of the inputs inflates past its bound
    app = _faust_app(kafka, cfg)
    feed = TopologyFeed(kafka.librdkafka(), cfg.topics.topology, cfg.topics.jobs)
    view = TopologyView(feed)
    streams = _table(app, "refine-streams", cfg.raw_partitions)
    nodes = _table(app, "refine-nodes", cfg.raw_partitions)
    aligned = _table(app, "align-streams", cfg.record_partitions)
    ingest = IngestDecoder(dict(cfg.ingest), cat) if cfg.ingest else None
    refiner = Refiner(cat, cfg.topics, view.index, _loader(streams), _loader(nodes), cfg.refine,
                      ingest, cfg.limits)  # fmt: skip
    aligner = Refiner(cat, cfg.topics, view.index, _loader(aligned), lambda _: None, cfg.refine,
                      limits=cfg.limits)  # fmt: skip
    outputs = OutputProducer(kafka, cfg.app_id)
    every_s, limit = cfg.checkpoint_every_s, cfg.dead_letters
    refine_cp = Checkpoint(every_s, outputs, streams, nodes, refiner.dirty_blobs)
    align_cp = Checkpoint(every_s, outputs, aligned, None, aligner.dirty_blobs)
    refine = Lane(refiner, refine_cp, DeadLetterStep(limit))
    align = Lane(aligner, align_cp, DeadLetterStep(limit))
    commits = CommitWatch(kafka.librdkafka(), cfg.app_id)  # the group's committed offsets
    guard = GapGuard(app, kafka.librdkafka(), commits, telemetry, cfg.stall_after_s)
    runner = GroupRunner(cfg, [refine, align], outputs, guard, feed, telemetry)
    watch = WorkerWatch(
        app, cfg.inputs(), runner, commits, guard, feed, telemetry, cfg.stall_after_s
    )
    _add_agents(app, cfg, runner, refine, align)

    async def start_feed() -> None:
        feed.start()
        caught = await asyncio.get_running_loop().run_in_executor(None, feed.wait_caught_up, 60)
        if feed.error is not None:
            raise RuntimeError(f"topology feed failed: {feed.error}")
        log.info("topology feed %s", "caught up" if caught else "not caught up after 60 s")

    async def subscribed() -> None:
        log.info("worker: subscribed to %s as group %s", ", ".join(sorted(cfg.inputs())),
                 cfg.app_id)  # fmt: skip

    async def assigned(partitions: set[Any]) -> None:
        shown = ", ".join(sorted(f"{tp.topic}:{tp.partition}" for tp in partitions))
        log.info("worker: group %s assigned %s", cfg.app_id, shown or "no partitions")
        commits.restart()

    hooks.on_revoked(app, runner.revoked)
    hooks.on_assigned(app, assigned)
    hooks.add_task(app, subscribed)
    hooks.add_task(app, start_feed)
    hooks.add_timer(app, max(cfg.checkpoint_every_s, 0.1), runner.checkpoint_paused)
    hooks.add_timer(app, 5.0, watch.watch)
    _add_pages(app, watch, telemetry)
    return Worker(app, outputs, runner)


class TopologyView:
    """The join index of the topology feed's latest snapshot, rebuilt when the feed moves."""

    def __init__(self, feed: TopologyFeed) -> None:
        self._feed = feed
        self._version = -1
        self._index = TopologyIndex([], [])

    def index(self) -> TopologyIndex:
        if self._feed.version != self._version:
            version, entities, jobs = self._feed.snapshot()
            # the nodes the change did not touch keep their resolved joins
            self._index = TopologyIndex(entities, jobs, previous=self._index)
            self._version = version
        return self._index


def _add_agents(
    app: faust.App, cfg: WorkerConfig, runner: GroupRunner, refine_lane: Lane, align_lane: Lane
) -> None:
    """The agents ``refine`` (raw and ingest topics) and ``align`` (events, collectives),
    named ``services.worker.app.refine`` and ``.align`` after their functions."""

    async def refine(stream: Any) -> None:
        await runner.run(stream, refine_lane)

    async def align(stream: Any) -> None:
        await runner.run(stream, align_lane)

    raw = (cfg.topics.raw, *(t for t, _ in cfg.ingest))
    records = (cfg.topics.events, cfg.topics.collectives)
    for fun, topics, partitions in (
        (refine, raw, cfg.raw_partitions),
        (align, records, cfg.record_partitions),
    ):
        topic = app.topic(
            *topics,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=partitions,
        )
        app.agent(topic, supervisor_strategy=CrashingSupervisor)(fun)


def _add_pages(app: faust.App, watch: WorkerWatch, telemetry: ServiceTelemetry) -> None:
    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        body, ok = watch.health()
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.text(telemetry.prometheus_text())


def _table(app: faust.App, name: str, partitions: int) -> Any:
    return app.Table(name, default=None, partitions=partitions, key_type=bytes, value_type=bytes)


def _loader(table: Any) -> Callable[[str], bytes | None]:
    def load(key: str) -> bytes | None:
        v = table.get(key.encode())
        return bytes(v) if v is not None else None

    return load


def _faust_app(kafka: KafkaSettings, cfg: WorkerConfig) -> faust.App:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    return FaustApp(
        cfg.app_id,
        broker=kafka.faust_broker(),
        broker_credentials=credentials(kafka),
        broker_session_timeout=kafka.session_timeout_s,
        broker_heartbeat_interval=kafka.heartbeat_interval_s,
        store="memory://",
        autodiscover=False,
        datadir=str(cfg.data_dir),
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=cfg.raw_partitions,
        topic_replication_factor=cfg.replication_factor,
        topic_allow_declare=True,
        broker_commit_interval=1.0,
        consumer_auto_offset_reset="earliest",
        consumer_max_fetch_size=32 * 1024 * 1024,
        producer_max_request_size=32 * 1024 * 1024,
        # the state checkpoint of a group is megabytes in records of tens of KB: with the
        # default 16 KB batches each record went in a batch of its own, a request carried one
        # batch per partition and aiokafka has one request in flight per broker, so a
        # checkpoint took tens of round trips (~0.2 s per group measured under load)
        producer_max_batch_size=4 * 1024 * 1024,
        producer_acks=-1,
        producer_linger_ms=5,
        # a produce that cannot complete fails after 30 s (Faust's default is 20 min): the
        # agent crashes, the worker exits non-zero and its supervisor restarts it
        producer_request_timeout=30.0,
        # on a rebalance, do not wait for in-flight records: their offsets are not committed
        # and the next owner replays them (waiting can deadlock after a session expiry)
        stream_wait_empty=False,
        stream_buffer_maxsize=8192,
        web_enabled=cfg.web_port is not None,
        web_port=cfg.web_port or 6066,
        web_bind=cfg.web_host,
        web_host=cfg.web_host,
    )
