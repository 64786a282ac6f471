"""Drive a :class:`~lab.simulate.engine.Simulation` into Kafka and record the truth.

Time mapping: the simulator's true clock is ``start_ns + simulated offset``. When the simulation
has no ``start_ns``, :func:`publish` sets it to the wall clock at the start of publishing plus
``GREET_LEAD_NS`` (2 s: the exporters' greetings, batches without rows sent first, have their
reports back before any batch with rows is stamped with exchanges), and at ``speed`` 1 each
message is handed to the producer when the wall clock reaches its true arrival time
(``due_ns``), so the broker's ``LogAppendTime`` ≈ true arrival time (plus the real loopback
delay). At ``speed`` X the wall clock runs X times slower than true time
(``wall = wall0 + (due - start) / X``); ``speed`` 0 or ``inf`` publishes as fast as possible. Only
at speed 1 with the default start is ``LogAppendTime`` comparable with true time.

Records: samples/late/malformed batches → ``topics.raw`` (key node), duplicates → the same topic
from a second producer session, events → ``topics.events`` (key node), collectives →
``topics.collectives`` (key job), topology entities → ``topics.topology`` (JSON, key id) but
the netdev ones, which the node exporters report, → ``topics.topology_nodes``, jobs →
``topics.jobs`` (JSON, key job). The topology is published and acknowledged before the true
clock starts; the jobs are published at its start (``JobPlacement.start_ns`` = ``start_ns``).

Exchanges (speed 1 only, where the broker's clock is the true one): each acknowledged record
of a node's batch is an exchange of that node's exporter with the broker
(:mod:`pipelines.refine.clock_bounds`): the wall-clock send and ack times the producer read, put on
the node's simulated wall clock, with the broker's append time, and its raw clock's readings
then (``CLOCK_MONOTONIC_RAW``: the oscillator, never stepped nor slewed; :mod:`.clocks`). Each
node keeps its own :class:`~pipelines.refine.clock_bounds.ExchangeLog` per stream, and its
batches carry them in their clock block, on the setting (``wall - raw``) of the batch's send,
widened over the settings its rows were stamped on, as :meth:`BatchProducer.with_exchanges`
does for the exporters. At other speeds the simulated clocks bear no relation to the broker's: no
exchanges are carried, except for a backlog stamped with its simulated arrival (``stamp_due``,
CreateTime topics), whose record timestamps are the simulated broker clock: its exchanges are
read off the simulated timeline (:meth:`_Publisher.timeline`) into the same logs.
"""

from __future__ import annotations

import math
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import KafkaError

from lab.simulate.clocks import NodeClocks
from lab.simulate.collectives import CollectiveTick
from lab.simulate.engine import GREET_LEAD_NS, Message, SendKind, Simulation, Stream
from lab.simulate.truth import TruthWriter
from pipelines.refine.clock_bounds import Exchange, ExchangeLog
from schemas.codec import JSON
from schemas.records import EntityKind
from schemas.wire import ClockBlock
from services.kafka.feed import nodes_topic
from services.kafka.producer import BatchProducer
from services.settings import KafkaSettings


@dataclass(frozen=True)
class Topics:
    raw: str = "telemetry.raw"
    events: str = "telemetry.events"
    collectives: str = "telemetry.collectives"
    topology: str = "topology"
    jobs: str = "jobs"
    # the node exporters' netdev facts (their own topic: exporters may not write topology);
    # empty: beside ``topology`` (services.kafka.feed.nodes_topic), so a prefix carries over
    topology_nodes: str = ""

    def __post_init__(self) -> None:
        if not self.topology_nodes:
            object.__setattr__(self, "topology_nodes", nodes_topic(self.topology))

    def of(self, stream: Stream) -> str:
        return {
            Stream.RAW: self.raw,
            Stream.EVENTS: self.events,
            Stream.COLLECTIVES: self.collectives,
        }[stream]


@dataclass
class Progress:
    """Counters of a run so far; handed to the progress callback every few seconds."""

    ticks: int = 0
    messages_sent: int = 0
    messages_acked: int = 0
    messages_failed: int = 0
    samples_sent: int = 0
    samples_acked: int = 0
    elapsed_s: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples_acked / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        return (
            f"simulate: tick {self.ticks}  sent {self.messages_sent} msgs / "
            f"{self.samples_sent} samples, acked {self.samples_acked} "
            f"({self.samples_per_s:,.0f} samples/s), failed {self.messages_failed}"
        )


@dataclass
class PublishReport(Progress):
    """What :func:`publish` did; ``unacked`` messages were never acknowledged."""

    unacked: int = 0
    start_ns: int = 0
    topics: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": round(self.samples_per_s, 1)}


ProgressCallback = Callable[[Progress], None]


def _stderr_progress(p: Progress) -> None:
    print(p.line(), file=sys.stderr, flush=True)


class _Publisher:
    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        truth: TruthWriter | None,
        extra_conf: dict[str, Any] | None,
        stamp_due: bool = False,
        sim: Simulation | None = None,
        partitions: dict[str, int] | None = None,
        restamp: bool = True,
    ) -> None:
        self.topics, self.truth, self.p = topics, truth, Progress()
        self.stamp_due = stamp_due
        # at speed 1, stamp a batch's send when it is published (False: a loaded host's
        # batches held with their stamps as they were, ``hold_s``)
        self.restamp = restamp
        self.pending: dict[int, tuple[Message, str]] = {}
        self.msg_no = 0
        # exchanges (speed 1): the simulation whose clocks they are read on, each node's
        # log per stream, and the node and stream of each message awaiting its report
        self.sim = sim
        self.nodes = {n: i for i, n in enumerate(sim.cluster.node_names)} if sim else {}
        self.logs: dict[tuple[int, Stream], ExchangeLog] = {}
        self.sources: dict[int, tuple[int, Stream]] = {}
        # a backlog stamped with its simulated arrival: each node's exchanges not acknowledged
        # yet on the simulated timeline, and the partition count of each topic
        self.queued: dict[tuple[int, Stream], list[Exchange]] = {}
        self.partitions = partitions if stamp_due and sim is not None else None

        def prod(topic: str) -> BatchProducer:
            return BatchProducer(
                kafka,
                topic=topic,
                on_delivery=self.delivered,
                extra_conf=extra_conf,
                on_exchange=self.exchanged if sim is not None else None,
            )

        self.producers = {s: prod(topics.of(s)) for s in Stream}
        self.dup_session = prod(topics.raw)  # a second producer session: a new producer id

    def exchanged(self, tag: str, ex: Exchange, mono_sent: int, mono_ack: int) -> None:
        """A report of a node's batch: an exchange of that node's exporter, on its clock."""
        src = self.sources.get(int(tag)) if tag.isdigit() else None
        if src is not None and self.partitions is None:  # else: read off the timeline
            self._log(src, ex)

    def _log(self, src: tuple[int, Stream], ex: Exchange) -> None:
        """Keep exchange ``ex`` (wall = true clock) in node ``src``'s log, on its clock."""
        if self.sim is None:
            return
        clocks, i = self.sim.clocks, src[0]
        wall, raw = clocks.node_offsets(i, np.asarray([ex.sent_ns, ex.ack_ns]))
        node_ex = Exchange(
            ex.sent_ns + int(wall[0]), ex.append_ms, ex.ack_ns + int(wall[1]), ex.partition
        )
        raw_s, raw_a = ex.sent_ns + int(raw[0]), ex.ack_ns + int(raw[1])
        self.logs.setdefault(src, ExchangeLog()).add(node_ex, raw_s, raw_a)

    def with_exchanges(self, msg: Message) -> None:
        """Put the node's exchanges into ``msg``'s clock block (a batch of a known node)."""
        env = msg.envelope
        i = self.nodes.get(env.source.node) if env is not None else None
        if env is None or i is None or self.sim is None:
            return
        if msg.kind not in (SendKind.BATCH, SendKind.LATE):
            return  # a resend is the same bytes; a malformed record has no clock to bound
        self.sources[self.msg_no] = (i, msg.stream)
        if self.partitions is not None:
            self.timeline(msg, (i, msg.stream))
        log = self.logs.get((i, msg.stream))
        if log is None:
            return
        clocks, t = self.sim.clocks, msg.sent_true_ns
        if self.partitions is None and self.restamp:
            # at speed 1 an exporter reads its send time just before produce(), as
            # BatchProducer's callers do: now, not when the batch was due (a publisher
            # falling behind would otherwise look like a record that waited, which the
            # worker's bound must take for a paused machine)
            now = time.time_ns()
            if now > t and not bool(clocks.paused(i, np.asarray([now]))[0]):
                t = now  # (a node paused now stands still: its batch keeps its stamp)
                env = env.model_copy(update={"sent_ns": t + _node_offset(clocks, i, t)})
                msg.envelope, msg.body = env, None
        # the node's setting (wall - raw) at the send, and the lowest and highest its rows
        # were stamped on: the exchanges are carried on the first, widened over the others
        skew = _node_offset(clocks, i, t) - _node_offset(clocks, i, t, steps=False)
        at = _stamped_at(msg)
        stamps = first_raw = None
        if at.size:
            wall, raw = clocks.node_offsets(i, at)
            stamps = (int((wall - raw).min()), int((wall - raw).max()))
            # as an exporter carries: only exchanges acknowledged before its first stamp
            first = int(at.min())
            first_raw = first + _node_offset(clocks, i, first, steps=False)
        carried = log.for_batch(env.source.key(), skew=skew, stamps=stamps, first_raw=first_raw)
        if not carried:
            return
        clock = env.clock or ClockBlock(source="none")
        update: dict[str, Any] = {"exchanges": [tuple(e.as_list()) for e in carried]}
        if log.last_stamps != (0, 0):  # as BatchProducer.with_exchanges carries them
            update["stamps_ns"] = log.last_stamps
        msg.envelope = env.model_copy(update={"clock": clock.model_copy(update=update)})
        msg.body = None

    def timeline(self, msg: Message, src: tuple[int, Stream]) -> None:
        """A backlog stamped with its simulated arrival: ``msg``'s exchange is read off the
        simulated timeline, not a delivery report (sent when it was, appended when it is due
        on the broker's clock, the true one, acknowledged as long after, at least 1 ms; on the
        partition the default partitioner gives its key), and the node's exchanges
        acknowledged before ``msg`` is sent join its log. A source's first batch finds the
        exchange of the batch it sent one interval earlier: the backlog is the tail of
        exporters that ran before it, as a real one is."""
        assert self.sim is not None
        queue = self.queued.get(src)
        if queue is None:
            queue = [self._exchange_of(msg, -self.sim.interval_ns)]
        later = []
        for ex in queue:
            if ex.ack_ns <= msg.sent_true_ns:
                self._log(src, ex)
            else:
                later.append(ex)
        self.queued[src] = [*later, self._exchange_of(msg, 0)]

    def _exchange_of(self, msg: Message, shift_ns: int) -> Exchange:
        """``msg``'s exchange on the true clock, ``shift_ns`` later (librdkafka's default
        partitioner, consistent_random: CRC-32 of the key modulo the partition count)."""
        n = (self.partitions or {}).get(self.topics.of(msg.stream), 0)
        part = zlib.crc32(msg.key) % n if n else -1
        sent, due = msg.sent_true_ns + shift_ns, msg.due_ns + shift_ns
        return Exchange(sent, due // 1_000_000, due + max(due - sent, 1_000_000), part)

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, serving delivery reports as they arrive (their ack times)."""
        deadline = time.monotonic() + seconds
        raw = self.producers[Stream.RAW]
        others = [self.producers[Stream.EVENTS], self.producers[Stream.COLLECTIVES]]
        while (left := deadline - time.monotonic()) > 0:
            raw.poll(min(left, 0.005))
            for prod in others:
                prod.poll(0)

    def delivered(self, tag: str, err: KafkaError | None, partition: int, offset: int) -> None:
        if not tag.isdigit():
            return
        no = int(tag)
        if err is None or not (err.retriable() or err.code() == KafkaError._MSG_TIMED_OUT):
            self.sources.pop(no, None)
        item = self.pending.get(no)
        if item is None:
            return
        if err is not None:
            self.p.messages_failed += 1
            if err.retriable() or err.code() == KafkaError._MSG_TIMED_OUT:
                return  # BatchProducer re-spools it; a later report settles it
            self.pending.pop(no)
            return
        msg, topic = self.pending.pop(no)
        self.p.messages_acked += 1
        self.p.samples_acked += msg.samples
        self.p.by_kind[msg.kind.value] = self.p.by_kind.get(msg.kind.value, 0) + 1
        if self.truth is not None:
            # BatchProducer reports offset 0 as -1; a successful delivery has a real offset
            self.truth.acked(msg, no, topic, partition, 0 if offset < 0 else offset)

    def send(self, msg: Message) -> None:
        self.msg_no += 1
        self.with_exchanges(msg)
        ct, body = msg.encode()
        topic = self.topics.of(msg.stream)
        self.pending[self.msg_no] = (msg, topic)
        prod = self.dup_session if msg.kind is SendKind.DUPLICATE else self.producers[msg.stream]
        stamp = msg.due_ns // 1_000_000 if self.stamp_due else 0
        prod.send_encoded(msg.key, body, (("content-type", ct.encode()),), str(self.msg_no), stamp)
        self.p.messages_sent += 1
        self.p.samples_sent += msg.samples

    def close(self, timeout: float) -> int:
        left = 0
        for prod in (*self.producers.values(), self.dup_session):
            left += prod.close(timeout)
        return left


def _node_offset(clocks: NodeClocks, i: int, true_ns: int, steps: bool = True) -> int:
    """Node ``i``'s wall clock error at ``true_ns`` (:meth:`NodeClocks.offset`); ``steps``
    False: its raw clock's, what ``CLOCK_MONOTONIC_RAW`` follows (the oscillator, never
    stepped nor slewed)."""
    return clocks.offset(i, true_ns) if steps else clocks.raw_offset(i, true_ns)


def _stamped_at(msg: Message) -> np.ndarray:
    """The true times at which ``msg``'s rows were stamped (its good rows': a bad row's
    stamp may be anything): each row's stamp less its offset, and the collectives' starts
    and ends from their truth (:class:`CollectiveTick`'s table is on the true clock)."""
    t = msg.table
    if t is None or t.num_rows == 0:
        return np.zeros(0, np.int64)
    if isinstance(msg.extra, CollectiveTick):
        cols = [msg.extra.table.column(c).to_numpy() for c in ("ts_ns", "end_ns")]
        return np.unique(np.concatenate(cols).astype(np.int64))
    n = t.num_rows - len(msg.bad or ())
    ts = np.asarray(t.column("ts_ns").to_numpy(), np.int64)
    off = np.broadcast_to(np.asarray(msg.offset_ns, np.int64), ts.shape)
    return np.unique(ts[:n] - off[:n])


def _partition_counts(kafka: KafkaSettings, topics: Topics) -> dict[str, int]:
    """The partition count of each stream's topic (those that exist)."""
    from confluent_kafka.admin import AdminClient

    md = AdminClient({**kafka.librdkafka(), "log_level": 3}).list_topics(timeout=30)
    names = (topics.raw, topics.events, topics.collectives)
    return {t: len(md.topics[t].partitions) for t in names if t in md.topics}


def _send_json(prod: BatchProducer, items: list[tuple[str, str]]) -> None:
    for key, doc in items:
        prod.send_encoded(key.encode(), doc.encode(), (("content-type", JSON.encode()),), key)


def publish_topology(
    sim: Simulation, kafka: KafkaSettings, topic: str, nodes: str | None = None
) -> int:
    """Publish every topology entity (JSON, key = entity id) and wait for the acks; returns how
    many were not acknowledged within 60 s. The netdev entities go to ``nodes`` (default
    :func:`nodes_topic` of ``topic``), as the node exporters publish them; the rest, what the
    admin's importers publish, to ``topic``."""
    ents = sim.cluster.topology()
    prod = BatchProducer(kafka, topic=topic)
    _send_json(prod, [(e.id, e.model_dump_json()) for e in ents if e.kind != EntityKind.NETDEV])
    node_prod = BatchProducer(kafka, topic=nodes or nodes_topic(topic))
    node_facts = [(e.id, e.model_dump_json()) for e in ents if e.kind == EntityKind.NETDEV]
    _send_json(node_prod, node_facts)
    return prod.close(60.0) + node_prod.close(60.0)


def publish(
    sim: Simulation,
    kafka_settings: KafkaSettings,
    topics: Topics | None = None,
    truth_path: str | Path | None = None,
    speed: float = 1.0,
    progress_cb: ProgressCallback | None = _stderr_progress,
    *,
    progress_every_s: float = 3.0,
    stop: Callable[[], bool] | None = None,
    extra_conf: dict[str, Any] | None = None,
    flush_timeout_s: float = 120.0,
    stamp_due: bool = False,
    hold_s: Callable[[float], float] | None = None,
) -> PublishReport:
    """Publish the whole simulation (blocks until it ends, ``stop()`` is true or Ctrl-C), then
    flush and write the truth. Returns a :class:`PublishReport`. Raises what the producer raises
    on a bad configuration; delivery failures are counted, never raised.

    ``stamp_due``: each record's CreateTime is when the simulation says it reaches the broker
    (for topics with CreateTime). A backlog published at ``speed=0`` then carries the arrival
    times it would have had, as a real backlog in LogAppendTime topics does; otherwise every
    record of it looks appended at once and the sources' clocks look ahead by up to the
    simulated duration. Its batches carry the exchanges of that timeline (as at speed 1), so
    a worker bounds their clocks as it does on live data.

    ``hold_s``: a loaded exporter host (paced runs): each message is handed to the producer
    ``hold_s(seconds since the start)`` after it is due, its stamps left as they were."""
    topics = topics or Topics()
    fast = speed <= 0 or math.isinf(speed)
    conf = dict(extra_conf or {})
    if not fast:
        # paced: arrival time matters more than batching, and the exchanges' round trips
        # (pipelines.refine.clock_bounds) are the producer's delay
        conf.setdefault("linger.ms", 0)
    truth = TruthWriter(truth_path) if truth_path is not None else None
    # producers first (they fetch their idempotent producer ids meanwhile), then the topology,
    # and only then the true clock starts, so the first batches are not late by the set-up time
    timeline = sim if speed == 1 or stamp_due else None
    parts = _partition_counts(kafka_settings, topics) if stamp_due else None
    pub = _Publisher(
        kafka_settings, topics, truth, conf, stamp_due, timeline, parts, restamp=hold_s is None
    )
    jobs_prod = BatchProducer(kafka_settings, topic=topics.jobs)
    publish_topology(sim, kafka_settings, topics.topology, topics.topology_nodes)
    wall0 = time.monotonic()
    if sim.start_ns is None:
        # the exporters greet the broker first (engine.GREET_LEAD_NS before the start): the
        # true clock starts once their reports have had that long to come back
        sim.start_ns = time.time_ns() + GREET_LEAD_NS
        wall0 += 0.0 if fast else GREET_LEAD_NS / 1e9  # the wall clock reads start_ns then
    start = sim.start_ns
    _send_json(jobs_prod, [(j.job, j.model_dump_json()) for j in sim.cluster.jobs(start)])
    last = wall0
    try:
        for tick in sim.ticks(greet=True):
            for msg in tick.messages:
                if not fast:
                    wait = (msg.due_ns - start) / speed / 1e9 - (time.monotonic() - wall0)
                    if hold_s is not None:
                        wait += hold_s((msg.due_ns - start) / 1e9)
                    if wait > 0.002:
                        pub.wait(wait)
                pub.send(msg)
            pub.p.ticks = tick.index
            now = time.monotonic()
            if progress_cb is not None and now - last >= progress_every_s:
                pub.p.elapsed_s, last = now - wall0, now
                progress_cb(pub.p)
            if stop is not None and stop():
                break
    except KeyboardInterrupt:
        pass
    finally:
        left = pub.close(flush_timeout_s) + jobs_prod.close(flush_timeout_s)
        p = pub.p
        p.elapsed_s = time.monotonic() - wall0
        if truth is not None:
            truth.close(
                [i.row() for i in sim.incidents],
                sim.clocks.table(sim.cluster.node_names),
                run_facts(sim, None if fast else speed, start, p.ticks),
            )
    if progress_cb is not None:
        progress_cb(p)
    return PublishReport(
        **asdict(p),
        unacked=max(left, len(pub.pending)),
        start_ns=start,
        topics={s.value: topics.of(s) for s in Stream}
        | {
            "topology": topics.topology,
            "topology.nodes": topics.topology_nodes,
            "jobs": topics.jobs,
        },
    )


def run_facts(sim: Simulation, speed: float | None, start_ns: int, ticks: int) -> dict[str, Any]:
    """How the run was published, for the truth's ``FILE.run.json`` (``refinery verify``):
    its true time ends after the last tick published."""
    end = start_ns + (ticks + 1) * sim.interval_ns
    if sim.duration_ns is not None:
        end = min(end, start_ns + sim.duration_ns)
    return {
        "speed": speed,
        "start_ns": start_ns,
        "end_ns": end,
        "interval_ns": sim.interval_ns,
        "nodes": sim.cluster.n_nodes,
        "seed": sim.seed,
        "spread": sim.spread,
        "faults": sorted(k.value for k in sim.faults.enabled),
    }


def bench_publish(
    bootstrap: str,
    nodes: int,
    seconds: float,
    *,
    seed: int = 0,
    extra_conf: dict[str, Any] | None = None,
) -> float:
    """Acknowledged samples per second published as fast as possible into fresh topics of the
    broker at ``bootstrap`` for about ``seconds`` of wall time (no faults, no truth)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from lab.simulate.cluster import Cluster

    tag = uuid.uuid4().hex[:8]
    topics = Topics(
        *(f"bench.{n}.{tag}" for n in ("raw", "events", "collectives", "topology", "jobs"))
    )
    admin = AdminClient({"bootstrap.servers": bootstrap})
    conf = {"message.timestamp.type": "LogAppendTime", "max.message.bytes": "16777216"}
    futs = admin.create_topics(
        [
            NewTopic(t, num_partitions=4, replication_factor=1, config=conf)
            for t in asdict(topics).values()
        ]
    )
    for f in futs.values():
        f.result(30)
    sim = Simulation(Cluster.build(nodes, seed=seed), None, seed=seed)
    deadline = time.monotonic() + seconds
    rep = publish(
        sim,
        KafkaSettings(bootstrap_servers=bootstrap),
        topics,
        None,
        speed=math.inf,
        progress_cb=None,
        stop=lambda: time.monotonic() >= deadline,
        extra_conf=extra_conf,
    )
    admin.delete_topics(list(asdict(topics).values()))
    return rep.samples_per_s
