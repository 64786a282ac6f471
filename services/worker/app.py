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
written to the tables and its changelog records acknowledged too (sent by the same librdkafka
producer as the outputs) — only then are the records of the groups it covers acked, so Faust
may commit their offsets; a group that failed is never acked. That end of a group runs while
the next group is refined (the ends one at a time, in order). So a crash anywhere replays
records whose outputs were either never published (recomputed identically from the older
state) or already published and remembered in the state (skipped as ``replay``), or
published but not yet in a checkpoint (published again: the same rows with the same
lineage, which a consumer drops by its raw partition and offset).

A failing agent crashes the worker (``CrashingSupervisor``): the process exits non-zero
instead of running on without committing. ``/health`` on the web port answers 200 while
groups complete (or nothing waits), 503 when progress has stalled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME
from faust.types import TP
from mode import CrashingSupervisor

from pipelines.refine.batch import RefineSettings
from pipelines.refine.dedupe import SeqWindow
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import Catalog, default_catalog
from schemas.ingest import IngestDecoder
from services.gc_pacer import GcPacer
from services.kafka import internals as kafka_internals
from services.kafka.faust_app import App as FaustApp
from services.kafka.feed import TopologyFeed
from services.kafka.group import (
    Progress,
    attach_outputs,
    credentials,
    manual_acks,
)
from services.kafka.outputs import Delivery, OutMessage, OutputProducer
from services.kafka.watch import CommitWatch, fetch_range
from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry
from services.worker.refiner import Outcome, OutputTopics, RawRecord, Refiner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputTopics:
    raw: str = "telemetry.raw"
    events: str = "telemetry.events"
    collectives: str = "telemetry.collectives"
    topology: str = "topology"
    jobs: str = "jobs"
    # ingest topics of foreign formats, (topic, format) (schemas.ingest): refined with raw
    ingest: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WorkerConfig:
    app_id: str = "refinery-worker"
    inputs: InputTopics = field(default_factory=InputTopics)
    outputs: OutputTopics = field(default_factory=OutputTopics)
    raw_partitions: int = 8
    record_partitions: int = 4  # events and collectives (co-partitioned)
    replication_factor: int = 1
    data_dir: Path = Path(".refinery/worker")
    web_port: int | None = 6066
    web_host: str = "127.0.0.1"  # /health's bind address (a pod's IP where probes call it)
    # A group's outputs are acknowledged and its state checkpointed once: a large group
    # under backlog writes each stream's state once for several of its batches. It yields
    # to the event loop between chunks (heartbeats run in the consumer's own thread).
    take_max: int = 600
    take_within_s: float = 0.05
    # The state of a stream is megabytes a second under backlog (every series' counter
    # state, rewritten for each group): written at most this often, the groups between two
    # checkpoints are acked together with the later one, and a crash replays up to this
    # much more input. 0: every group (the offsets commit every broker_commit_interval, 1 s).
    checkpoint_every_s: float = 1.0
    refine_chunk: int = 300  # records refined in one call (one vectorized pass per wave)
    stall_after_s: float = 30.0
    gc_settle_every_s: float = 600.0  # full garbage collections on this schedule (GcPacer)
    refine: RefineSettings = field(default_factory=lambda: RefineSettings(seq_window=512))


class Checkpoints:
    """What one agent refined since its state was last written: the events of the groups
    whose outputs are acknowledged (acked only once a checkpoint covers them), the latest
    event that changed each stream or node (its changelog record goes to that event's
    partition), and whether the refiner's state is that after whole groups only."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.saved_at = -math.inf
        self.ended: list[Any] = []
        self.last_for: dict[str, Any] = {}
        # False from the start of a group's refining until its end is started: the state
        # then holds rows whose records may never be acked, and no checkpoint is taken
        self.clean = True
        self.epoch = 0  # moves when the partitions are revoked: earlier groups replay
        self.stream: Any = None

    def due(self) -> bool:
        return time.monotonic() - self.saved_at >= self.every_s

    def waiting(self) -> bool:
        return bool(self.ended or self.last_for)

    def take(self, proc: Refiner, stream_table: Any, node_table: Any | None) -> list[OutMessage]:
        """The changelog records of every stream and node changed since the last
        checkpoint, as the state is now."""
        streams, nodes = proc.dirty_blobs()
        changelog = [_put(stream_table, self.last_for[k], k, b) for k, b in streams.items()]
        if node_table is not None:
            changelog += [_put(node_table, self.last_for["node:" + n], n, b)
                          for n, b in nodes.items()]  # fmt: skip
        self.last_for = {}
        self.saved_at = time.monotonic()
        return changelog

    def drop(self) -> None:
        """Forget the groups not yet in a checkpoint (partitions revoked): they replay."""
        self.ended, self.last_for, self.epoch = [], {}, self.epoch + 1


class GroupEnds:
    """The ends of refined groups still in flight (see ``run_groups`` in :func:`build_app`).
    A failed end is kept in :attr:`error` for a caller that is not awaiting it (the worker's
    watch timer raises it when no next group comes to do so)."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.error: BaseException | None = None

    def start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()

    @property
    def idle(self) -> bool:
        return not self._tasks

    async def settle(self) -> None:
        """Wait (at most ``settle_s``) for every end in flight; failures stay in :attr:`error`
        and with their own awaiters."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.settle_s)


def build_app(
    kafka: KafkaSettings,
    cfg: WorkerConfig,
    telemetry: ServiceTelemetry,
    catalog: Catalog | None = None,
) -> faust.App:
    """A configured Faust app with the refining agents; run it with :func:`run_worker`."""
    cat = catalog or default_catalog()
    kafka_internals.install()  # no batch of the inputs inflates past its bound
    cfg.data_dir.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    app = FaustApp(
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
    progress = Progress()
    feed = TopologyFeed(kafka.librdkafka(), cfg.inputs.topology, cfg.inputs.jobs)
    index_cache: dict[str, Any] = {"version": -1, "index": TopologyIndex([], [])}

    def topology() -> TopologyIndex:
        if feed.version != index_cache["version"]:
            version, entities, jobs = feed.snapshot()
            # the nodes the change did not touch keep their resolved joins
            index_cache["index"] = TopologyIndex(entities, jobs, previous=index_cache["index"])
            index_cache["version"] = version
        index: TopologyIndex = index_cache["index"]
        return index

    def raw_topic(name: str, partitions: int, *more: str) -> Any:
        return app.topic(
            name,
            *more,
            key_type=bytes,
            value_type=bytes,
            key_serializer="raw",
            value_serializer="raw",
            partitions=partitions,
        )

    def table(name: str, partitions: int) -> Any:
        return app.Table(
            name, default=None, partitions=partitions, key_type=bytes, value_type=bytes
        )

    refine_streams = table("refine-streams", cfg.raw_partitions)
    refine_nodes = table("refine-nodes", cfg.raw_partitions)
    align_streams = table("align-streams", cfg.record_partitions)

    def loader(t: Any) -> Any:
        def load(key: str) -> bytes | None:
            v = t.get(key.encode())
            return bytes(v) if v is not None else None

        return load

    ingest = IngestDecoder(dict(cfg.inputs.ingest), cat) if cfg.inputs.ingest else None
    refiner = Refiner(
        cat,
        cfg.outputs,
        topology,
        loader(refine_streams),
        loader(refine_nodes),
        cfg.refine,
        ingest,
    )
    aligner = Refiner(cat, cfg.outputs, topology, loader(align_streams), lambda _: None, cfg.refine)

    last_offset: dict[tuple[str, int], int] = {}  # per input partition, this assignment
    commits = CommitWatch(kafka.librdkafka(), cfg.app_id)  # the group's committed offsets
    # primed when the first agent starts (the long first settle before any record waits),
    # then again after the first group, once that has built the refiner's caches and state
    gc_pacer = GcPacer(cfg.gc_settle_every_s)
    # the process's output producer (refine_group reads it from the app at each group)
    producer = attach_outputs(app, kafka, cfg.app_id)
    # a group's end waits at most the producer's deadline plus its 5 s of delivery polling
    ends = GroupEnds(settle_s=producer.deadline_s + 10.0)

    async def skipped_gap(topic: str, partition: int, first: int, last: int) -> None:
        # faust 0.15.3 (pinned): Consumer._add_gap is how its own fetcher declares offsets
        # it will never deliver (compacted away)
        consumer: Any = app.consumer
        await consumer._add_gap(TP(topic, partition), first, last)

    async def with_skipped(chunk: list[Any]) -> tuple[list[Any], list[RawRecord]]:
        """The chunk's records, preceded where a partition's offsets jump by the records in
        between, fetched directly: input offsets are contiguous, so a jump is a record the
        stream never handed over (seen with Faust's take_events under backlog after a
        restart, and at the first event after a partition moved between two workers) and it
        must be refined, not skipped. A newly assigned partition's first event is compared
        with the group's committed offset. Each is paired with the event after
        it (same partition: its state goes to the same changelog partition)."""
        evs: list[Any] = []
        recs: list[RawRecord] = []
        new = sorted({(e.message.topic, e.message.partition) for e in chunk} - set(last_offset))
        if new:  # first events of this assignment: compare them with where reading starts
            try:
                starts = await asyncio.get_running_loop().run_in_executor(
                    None, commits.start_offsets, new
                )
            except Exception as e:  # no answer: the in-assignment check still runs
                log.warning("start offsets of %s: %s", new, e)
                starts = {}
            for tp, start in starts.items():
                last_offset[tp] = start - 1
        for ev in chunk:
            m = ev.message
            tp = (m.topic, m.partition)
            last = last_offset.get(tp)
            if last is not None and m.offset > last + 1:
                got = await asyncio.get_running_loop().run_in_executor(
                    None, fetch_range, kafka.librdkafka(), m.topic, m.partition, last + 1, m.offset
                )
                log.warning(
                    "%s[%d]: offsets %d..%d never reached the agent; refining the %d fetched",
                    m.topic, m.partition, last + 1, m.offset - 1, len(got),
                )  # fmt: skip
                telemetry.count("worker.skipped_refetched", len(got), {"topic": m.topic})
                # Faust's consumer counts these offsets as read but never sees them acked,
                # and it commits nothing past a hole in its acked offsets: the partition
                # would stall at its committed offset for good (seen after a rebalance).
                # Declared as a gap, they count as acked once an offset after them is, and
                # those are acked only when this group has ended.
                await skipped_gap(m.topic, m.partition, last + 1, m.offset - 1)
                for g in got:
                    evs.append(ev)
                    recs.append(_confluent_record(g))
            last_offset[tp] = m.offset if last is None else max(last, m.offset)
            evs.append(ev)
            recs.append(_raw_record(m))
        return evs, recs

    refine_cp = Checkpoints(cfg.checkpoint_every_s)
    align_cp = Checkpoints(cfg.checkpoint_every_s)
    agents = (
        (refine_cp, refiner, refine_streams, refine_nodes),
        (align_cp, aligner, align_streams, None),
    )

    async def save_now(
        cp: Checkpoints, proc: Refiner, stream_table: Any, node_table: Any | None
    ) -> None:
        """Write the state and ack every group refined so far, when the state is that after
        whole groups whose ends are all done (a stop, a revocation, input pausing);
        otherwise leave them to a later checkpoint or to replay."""
        await ends.settle()
        if not (cp.clean and ends.idle and ends.error is None and cp.waiting()):
            return
        changelog = cp.take(proc, stream_table, node_table)
        events, cp.ended = cp.ended, []
        outputs: OutputProducer = app.refinery_outputs  # type: ignore[attr-defined]
        await outputs.publish(changelog)
        for ev in events:
            await cp.stream.ack(ev)

    async def run_groups(
        stream: Any,
        proc: Refiner,
        stream_table: Any,
        node_table: Any | None,
        cp: Checkpoints,
    ) -> AsyncIterator[None]:
        # noack_take: Faust's take_events acks a group when its generator closes, also when
        # processing it failed, and this process would then commit records whose outputs the
        # broker never acknowledged. Here a group is acked only once it is done and in a
        # checkpoint; a failed one stays uncommitted and the next owner replays it.
        # A group's end (outputs acknowledged, then, when it takes a checkpoint, the state and
        # the acks of every group the checkpoint covers) runs while the next group is refined:
        # the refining thread does not sit idle through the broker round trips. The ends run
        # one at a time, in group order.
        ending: asyncio.Task[None] | None = None
        cp.stream = stream
        if gc_pacer.prime():
            telemetry.record("worker.gc_settle_s", gc_pacer.last_pause_s, unit="s")
        async with manual_acks(stream, cfg.take_max, cfg.take_within_s) as groups:
            try:
                async for events in groups:
                    epoch, cp.clean = cp.epoch, False
                    end, saves = await refine_group(
                        events, proc, stream_table, node_table, cp, epoch
                    )
                    if epoch != cp.epoch:
                        # the partitions were revoked while it was refined: its rows leave
                        # the state (which reloads from the tables) and its records replay
                        proc.forget()
                    if ending is not None:
                        try:
                            await ending  # the previous group's end; raises its failure here
                        except BaseException:
                            end.close()  # this group's end never starts: its records stay unacked
                            raise
                    ending = ends.start(acked(cp, events, end, saves, epoch))
                    cp.clean = True
                    yield None
            finally:
                # a stop or a crash lets the last group end first; a stop (the state that of
                # whole groups) writes a last checkpoint and acks them
                if ending is not None:
                    await save_now(cp, proc, stream_table, node_table)

    async def acked(
        cp: Checkpoints, events: list[Any], end: Coroutine[Any, Any, None], saves: bool, epoch: int
    ) -> None:
        await end
        if epoch != cp.epoch:  # revoked meanwhile: no checkpoint holds this group, it replays
            return
        cp.ended += events
        if saves:  # the checkpoint covers this group and every one before it
            done, cp.ended = cp.ended, []
            for ev in done:
                await cp.stream.ack(ev)

    async def refine_group(
        events: list[Any],
        proc: Refiner,
        stream_table: Any,
        node_table: Any | None,
        cp: Checkpoints,
        epoch: int,
    ) -> tuple[Coroutine[Any, Any, None], bool]:
        """Refine a group and hand its outputs to the producer; returns the coroutine that
        ends the group (wait for the outputs' acknowledgements, then write the state when a
        checkpoint is due) and whether it writes one."""
        progress.last_group_started = time.monotonic()
        if not progress.groups and not feed.wait_caught_up(0):
            # the first group waits for the topology and jobs to be read whole: no sample is
            # enriched against a half-loaded view (and no join index rebuilt for each part)
            await asyncio.get_running_loop().run_in_executor(None, feed.wait_caught_up, 60)
        now = time.time_ns()
        outputs: OutputProducer = app.refinery_outputs  # type: ignore[attr-defined]
        sent: list[Delivery] = []
        tally = GroupTally()
        with telemetry.span("refine.group", {"records": len(events)}):
            for lo in range(0, len(events), cfg.refine_chunk):
                chunk, recs = await with_skipped(events[lo : lo + cfg.refine_chunk])
                pending: list[OutMessage] = []
                for ev, rec, out in zip(chunk, recs, proc.process_group(recs, now), strict=True):
                    tally.add(out, rec)
                    pending += out.messages
                    if out.stream is not None:
                        cp.last_for[out.stream] = ev
                        cp.last_for["node:" + out.stream.split("|", 1)[0]] = ev
                # librdkafka sends a chunk's outputs while the next chunk is refined
                sent.append(await outputs.enqueue(pending))
                await asyncio.sleep(0)  # let heartbeats and fetches run
            tally.report(telemetry)
            # a checkpoint's state is encoded now (the next group changes this refiner's
            # state) and sent only once the outputs of its groups are acknowledged
            due = cp.due() and cp.epoch == epoch
            changelog = cp.take(proc, stream_table, node_table) if due else None
        progress.groups += 1
        progress.records += len(events)
        progress.last_group_done = time.monotonic()
        if gc_pacer.maybe():  # between groups: the one full collection it takes
            telemetry.record("worker.gc_settle_s", gc_pacer.last_pause_s, unit="s")

        async def end() -> None:
            await outputs.wait(sent)  # outputs acknowledged first
            if changelog is not None:  # then the state; the caller acks the groups after
                await outputs.publish(changelog)

        return end(), changelog is not None

    @app.agent(
        raw_topic(cfg.inputs.raw, cfg.raw_partitions, *(t for t, _ in cfg.inputs.ingest)),
        supervisor_strategy=CrashingSupervisor,
    )
    async def refine(stream: Any) -> None:
        async for _ in run_groups(stream, refiner, refine_streams, refine_nodes, refine_cp):
            pass

    records_in = app.topic(
        cfg.inputs.events,
        cfg.inputs.collectives,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=cfg.record_partitions,
    )

    @app.agent(records_in, supervisor_strategy=CrashingSupervisor)
    async def align(stream: Any) -> None:
        async for _ in run_groups(stream, aligner, align_streams, None, align_cp):
            pass

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app_: Any, revoked: Any, **kwargs: Any) -> None:
        # another worker may own these now: the groups refined so far end first (outputs,
        # state, acks), so that their offsets commit now and none of them is replayed there
        # (unless one was being refined: then those not in a checkpoint replay)
        for agent in agents:
            await save_now(*agent)
        for cp, *_ in agents:
            cp.drop()
        # state must come back from the tables
        refiner.forget()
        aligner.forget()
        last_offset.clear()  # the next assignment starts from the committed offsets

    @app.task  # type: ignore[untyped-decorator]
    async def start_feed() -> None:
        feed.start()
        caught = await asyncio.get_running_loop().run_in_executor(None, feed.wait_caught_up, 60)
        if feed.error is not None:
            raise RuntimeError(f"topology feed failed: {feed.error}")
        log.info("topology feed %s", "caught up" if caught else "not caught up after 60 s")

    inputs = {cfg.inputs.raw, cfg.inputs.events, cfg.inputs.collectives}
    inputs |= {t for t, _ in cfg.inputs.ingest}

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: Any, **kwargs: Any) -> None:
        commits.restart()

    reread_at: dict[tuple[str, int], float] = {}

    async def reread(tp: tuple[str, int]) -> None:
        """Seek a partition whose records wait while its commits stand still back to its
        committed offset. Faust drops the events it buffered when partitions are reassigned
        but counts them read; when they were a partition's last records no later event shows
        the jump (``with_skipped``) and nothing would refine them: read again, they are.
        Once per stall: if that does not help, the watch's crash follows."""
        if time.monotonic() - reread_at.get(tp, -math.inf) <= cfg.stall_after_s:
            return
        reread_at[tp] = time.monotonic()
        try:
            starts = await asyncio.get_running_loop().run_in_executor(
                None, commits.start_offsets, [tp]
            )
        except Exception as e:  # no answer: this stall is not read again (the crash follows)
            log.warning("committed offset of %s: %s", tp, e)
            return
        log.warning("%s[%d]: records wait and no commit moves; reading again from %d",
                    tp[0], tp[1], starts[tp])  # fmt: skip
        telemetry.count("worker.reread", 1, {"topic": tp[0]})
        last_offset[tp] = starts[tp] - 1
        consumer: Any = app.consumer
        await consumer.seek(TP(*tp), starts[tp])

    @app.timer(interval=max(cfg.checkpoint_every_s, 0.1))  # type: ignore[untyped-decorator]
    async def checkpoint() -> None:
        # input paused: the last groups are written and acked without waiting for more
        for cp, *rest in agents:
            if cp.clean and ends.idle and cp.waiting() and cp.due():
                await save_now(cp, *rest)

    @app.timer(interval=5.0)  # type: ignore[untyped-decorator]
    async def watch() -> None:
        if feed.error is not None:
            raise RuntimeError(f"topology feed failed: {feed.error}")
        if ends.error is not None:  # a group's end failed and no next group came to raise it
            raise RuntimeError(f"a refined group did not end: {ends.error}")
        owned = [(tp.topic, tp.partition) for tp in app.consumer.assignment()
                 if tp.topic in inputs]  # fmt: skip
        try:
            stalled = await asyncio.get_running_loop().run_in_executor(None, commits.check, owned)
        except Exception as e:  # the broker did not answer: not evidence of a stall
            log.warning("commit watch: %s", e)
            stalled = 0.0
        progress.commit_stalled_s = stalled
        tp = commits.stalled_partition
        if stalled > cfg.stall_after_s and tp is not None:
            await reread(tp)
        telemetry.gauge("worker.groups", progress.groups)
        telemetry.gauge("worker.lag", commits.lag)
        telemetry.gauge("worker.seq_gaps_forgotten", SeqWindow.forgotten_total)
        telemetry.gauge("worker.healthy", 1.0 if progress.healthy(cfg.stall_after_s) else 0.0)
        if stalled > 2 * cfg.stall_after_s:
            raise RuntimeError(
                f"no commit progress on {commits.stalled_partition} for {stalled:.0f}s"
                f" ({commits.lag} records waiting in all)"
            )

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        ok = progress.healthy(cfg.stall_after_s)
        stalled_s = progress.commit_stalled_s
        body = {
            "healthy": ok,
            "groups": progress.groups,
            "records": progress.records,
            "since_last_group_s": round(time.monotonic() - progress.last_group_done, 1),
            "commit_stalled_s": round(progress.commit_stalled_s, 1),
            "lag": commits.lag,
            "stalled_partition": list(commits.stalled_partition or ()) if stalled_s else None,
        }
        return web.json(body, status=200 if ok else 503)

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.text(telemetry.prometheus_text())

    app.refinery_feed = feed  # type: ignore[attr-defined]
    return app


def _put(table: Any, event: Any, key: str, blob: bytes) -> OutMessage:
    """Set a table key and return its changelog record, on the partition of the input record
    that changed it (the table is co-partitioned with its input topic), for the output
    producer to send: the record Faust's ``table[key] = blob`` would send (raw key and value,
    no headers), built here because the group's records come from several partitions and the
    stream's current event is only the last one, and sent by librdkafka instead of the app's
    aiokafka producer. Faust's recovery reads it back as its own."""
    k = key.encode()
    table.data[k] = blob
    topic = table.changelog_topic.get_topic_name()
    return OutMessage(topic, k, blob, partition=event.message.partition)


def _raw_record(m: Any) -> RawRecord:
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


def _confluent_record(m: Any) -> RawRecord:
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
            t.record("refinery.freshness", f, unit="s")
        for stream, off in self.offsets.items():
            t.gauge("refinery.clock.offset_ns", off, {"source": stream})
        for stream, err in self.errors.items():
            t.gauge("refinery.clock.error_ns", err, {"source": stream})
