"""``refinery worker grow``: raise the raw topic's partitions under a worker group's state,
keeping every source's dedupe window, counter state and clock estimate
(docs/operations.md, "Scaling"; the pure parts in :mod:`services.worker.growth_plan`).

Faust tables are co-partitioned with their input: a source's state is on the changelog
partition of its node's raw partition. Raising the raw topic from ``n`` to ``N`` partitions
sends a node's records to ``partition_of(node, N)``, while its state and the records it sent
before the raise stay on ``partition_of(node, n)``. With every worker of the group stopped
(it refuses otherwise), :func:`grow`:

1. writes the marker ``started`` (``<app-id>-growth``): until it says ``done``, workers
   refuse to start (:mod:`services.worker.preflight`) and a new run resumes;
2. raises the raw topic, the ingest topics refined with it and both changelog topics to ``N``;
3. waits until the producers have moved (:class:`~services.worker.growth_plan.SettleWatch`):
   every node whose state moves seen on its new partition and no record sent to an old home
   for ``quiet_s``, or ``settle_s`` (a producer's metadata refresh; librdkafka's default is
   300 s) — raising :class:`GrowError` if records still go to old homes then;
4. refines what the group had not refined on the old partitions, up to their end now, as the
   worker would (the same :class:`~services.worker.refiner.Refiner`, outputs acknowledged):
   a source's records from before the raise, on its old partition, before the ones it sent
   to an old partition that became its home (:func:`~services.worker.growth_plan.phase_of`),
   so every source's seqs and counters are refined in order across the change;
5. writes every key's latest state to its node's new partition; a partition that held
   copies of keys that left is rewritten whole and its older records deleted, since a
   tombstone would not do (:func:`~services.worker.growth_plan.rekey`);
6. commits the group's offsets of the old partitions at the end it refined, and writes the
   marker ``done``.

A crash anywhere leaves the marker ``started``; the next run takes the old partition count
from it (the state topics were raised already), reads the changelogs again (a key written to
its new partition already is taken from there), refines from the committed offsets (records
whose state was written are replays, published once) and goes on.
Records a producer still sends to an old partition after step 4 (one that did not refresh
its metadata within ``settle_s``) are refined by that partition's owner: without their
source's state (as a new source's first records) where it is another worker than the new
home's, else with it but possibly after newer ones (Faust's in-memory table is one dict for
every partition a worker owns).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from pipelines.refine.types import RefineSettings
from schemas.errors import ConfigError, RefineryError
from schemas.topics import Topics
from services.settings import KafkaSettings
from services.topics import raise_partitions
from services.worker.growth_plan import (
    RAW_TABLES,
    GrowthMarker,
    Partitioner,
    SettleWatch,
    Write,
    choose,
    grown_from,
    home_of,
    marker_topic,
    node_of,
    rekey,
)
from services.worker.preflight import read_marker

log = logging.getLogger(__name__)

Copies = dict[bytes, dict[int, bytes]]  # table key -> partition -> its latest live value
Offsets = dict[tuple[str, int], int]  # (topic, partition) -> offset


class GrowError(RefineryError):
    """The growth cannot go on now (one line: why and what to do); it resumes when run again."""


@dataclass(frozen=True)
class GrowConfig:
    app_id: str
    topics: Topics  # the catalog, with the deployment's prefix
    ingest: tuple[tuple[str, str], ...]  # ingest topics refined with raw: (topic, format)
    partitions: int
    refine: RefineSettings
    partitioner: Partitioner = "consistent_random"
    settle_s: float = 300.0
    quiet_s: float = 15.0

    @property
    def changelogs(self) -> list[str]:
        return [f"{self.app_id}-{t}-changelog" for t in RAW_TABLES]

    @property
    def inputs(self) -> list[str]:
        return [self.topics.raw, *(t for t, _ in self.ingest)]


@dataclass
class GrowReport:
    from_partitions: int
    to_partitions: int
    moved: int = 0  # table keys whose state went to a new partition
    unplaced: int = 0
    tail_records: int = 0  # records on the old partitions refined here
    outcomes: dict[str, int] = field(default_factory=dict)
    settle_s: float = 0.0
    unseen_nodes: int = 0  # moving nodes not seen on their new partition (silent)


def grow(kafka: KafkaSettings, cfg: GrowConfig, say: Callable[[str], None]) -> GrowReport:
    """Run the procedure (module docstring); ``say`` gets a line per step. Raises
    :class:`~schemas.errors.ConfigError` when it must not start (workers running, fewer
    partitions asked for, an unfinished growth to another count or with another partitioner)
    and :class:`GrowError` when the producers did not move."""
    conf = kafka.librdkafka()
    require_stopped(conf, cfg.app_id)
    counts = _partition_counts(conf, [*cfg.inputs, *cfg.changelogs])
    raw_n, n_old = counts[cfg.topics.raw], counts.get(cfg.changelogs[0])
    if raw_n is None:
        raise ConfigError(f"{cfg.topics.raw}: no such topic")
    if cfg.partitions < raw_n:
        raise ConfigError(f"{cfg.topics.raw} has {raw_n} partitions: Kafka cannot lower them to"
                          f" {cfg.partitions}")  # fmt: skip
    if n_old is None:  # no state yet: nothing follows the partitions
        raise_partitions(conf, {t: cfg.partitions for t in cfg.inputs})
        say(f"no state of {cfg.app_id}: raised {', '.join(cfg.inputs)} to {cfg.partitions}")
        return GrowReport(raw_n, cfg.partitions)
    marker = _marker(conf, cfg.app_id)
    if n_old == cfg.partitions == raw_n and (marker is None or marker.state == "done"):
        raw = cfg.topics.raw
        say(f"{raw} and the state of {cfg.app_id} have {n_old} partitions: nothing to do")
        return GrowReport(n_old, n_old)
    try:  # a run cut short raised the state topics already: its start is in the marker
        n_old = grown_from(marker, n_old, cfg.partitions, cfg.partitioner)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if marker is not None and marker.state == "started":
        say(f"resuming the growth of {cfg.topics.raw} from {n_old} to {cfg.partitions} partitions")
    rep = GrowReport(n_old, cfg.partitions)
    started = GrowthMarker(n_old, cfg.partitions, cfg.partitioner, "started")
    _write_marker(conf, cfg.app_id, started)
    raise_partitions(conf, {t: cfg.partitions for t in [*cfg.inputs, *cfg.changelogs]})
    say(f"raised {', '.join([*cfg.inputs, *cfg.changelogs])} to {cfg.partitions} partitions")
    copies = {t: read_changelog(conf, t) for t in cfg.changelogs}
    ends = _settle(conf, cfg, n_old, copies[cfg.changelogs[0]], rep)
    say(f"producers moved after {rep.settle_s:.1f} s ({rep.unseen_nodes} nodes not seen)")
    committed = committed_offsets(conf, cfg.app_id, list(ends))
    updated = asyncio.run(_refine_tails(kafka, cfg, n_old, copies, committed, ends, rep))
    say(f"refined {rep.tail_records} records left on the old partitions: {rep.outcomes}")
    for table, new in zip(cfg.changelogs, updated, strict=True):
        plan = rekey(copies[table], n_old, cfg.partitions, cfg.partitioner, new)
        first = _write_state(conf, table, plan.writes)
        _truncate(conf, table, {p: first.get(p) for p in plan.truncate})
        rep.moved += plan.moved
        rep.unplaced += plan.unplaced
    say(f"state re-keyed: {rep.moved} keys moved to their new partitions")
    commit_offsets(conf, cfg.app_id, ends)
    _write_marker(conf, cfg.app_id, GrowthMarker(n_old, cfg.partitions, cfg.partitioner, "done"))
    say(f"done: {cfg.topics.raw} has {cfg.partitions} partitions; start the workers")
    return rep


def require_stopped(conf: dict[str, Any], app_id: str) -> None:
    """Raise ConfigError unless the consumer group ``app_id`` has no member."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**conf, "log_level": 3})
    g = admin.describe_consumer_groups([app_id], request_timeout=15)[app_id].result()
    if g.members:
        raise ConfigError(f"group {app_id} has {len(g.members)} members: stop every worker of"
                          f" it before `refinery worker grow`")  # fmt: skip


def _partition_counts(conf: dict[str, Any], topics: list[str]) -> dict[str, int | None]:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({**conf, "log_level": 3}).list_topics(timeout=15)
    out: dict[str, int | None] = {}
    for name in topics:
        t = md.topics.get(name)
        out[name] = len(t.partitions) if t is not None and t.partitions else None
    return out


def _consumer(conf: dict[str, Any], group: str | None = None) -> Consumer:
    return Consumer({**conf, "group.id": group or f"refinery-grow-{uuid.uuid4().hex[:8]}",
                     "enable.auto.commit": False, "enable.partition.eof": True,
                     "auto.offset.reset": "earliest", "log_level": 3})  # fmt: skip


def _records(c: Consumer, ends: Offsets, timeout: float = 120.0) -> Iterator[Any]:
    """Every record of the assigned partitions below ``ends``, in order per partition."""
    left = {tp for tp, end in ends.items() if end > 0}
    deadline = time.monotonic() + timeout
    while left:
        if time.monotonic() > deadline:
            raise GrowError(f"could not read {sorted(left)[:3]} to their end in {timeout:g} s")
        for m in c.consume(1000, 0.5):
            tp, offset = (str(m.topic()), m.partition() or 0), m.offset() or 0
            if m.error() is not None:
                if tp in left and offset >= ends[tp]:  # partition EOF
                    left.discard(tp)
                continue
            if tp in ends and offset < ends[tp]:
                yield m
            if tp in ends and offset + 1 >= ends[tp]:
                left.discard(tp)


def _high(conf: dict[str, Any], topics: list[str], below: int | None = None) -> Offsets:
    from services.topics import watermarks

    return {(t, p): hi for t in topics for p, (_, hi) in watermarks(conf, t).items()
            if below is None or p < below}  # fmt: skip


def read_changelog(conf: dict[str, Any], topic: str) -> Copies:
    """Every key of a changelog topic with its latest live value on each partition."""
    ends = _high(conf, [topic])
    copies: Copies = {}

    def keep(m: Any) -> None:
        key, value = m.key(), m.value()
        if value is None:
            copies.get(key, {}).pop(m.partition(), None)
        else:
            copies.setdefault(key, {})[m.partition()] = value

    c = _consumer(conf)
    try:
        c.assign([TopicPartition(t, p, 0) for (t, p), end in ends.items() if end > 0])
        for m in _records(c, ends):
            keep(m)
    finally:
        c.close()
    return {k: v for k, v in copies.items() if v}


def _settle(
    conf: dict[str, Any], cfg: GrowConfig, n_old: int, streams: Copies, rep: GrowReport
) -> Offsets:
    """Wait until the producers have moved (module docstring, step 3); the old partitions'
    ends then."""
    n, how = cfg.partitions, cfg.partitioner
    moving = {node_of(k) for k in streams if home_of(k, n_old, how) != home_of(k, n, how)}
    t0 = time.monotonic()
    watch = SettleWatch(moving, n, how, cfg.quiet_s, t0)
    c = _consumer(conf)
    try:
        # every partition, from its end at the raise: the old ones (records sent under the
        # old metadata) and the new ones (records of the nodes that moved)
        c.assign([TopicPartition(t, p, off) for (t, p), off in _high(conf, cfg.inputs).items()])
        while not watch.settled(now := time.monotonic()) and now - t0 < cfg.settle_s:
            for m in c.consume(1000, 0.5):
                if m.error() is None:
                    watch.see(m.partition() or 0, m.key(), time.monotonic())
    finally:
        c.close()
    rep.settle_s, rep.unseen_nodes = time.monotonic() - t0, len(watch.waiting)
    if not watch.quiet(time.monotonic()):
        raise GrowError(
            f"{watch.misplaced} records went to partitions their keys left, the last less than"
            f" {cfg.quiet_s:g} s ago, {cfg.settle_s:g} s after the raise: producers that do not"
            f" refresh their metadata (topic.metadata.refresh.interval.ms); run"
            f" `refinery worker grow --partitions {n}` again later (the workers refuse to"
            f" start until it is done)"
        )
    return _high(conf, cfg.inputs, n_old)


def committed_offsets(conf: dict[str, Any], group: str, tps: list[tuple[str, int]]) -> Offsets:
    """``group``'s committed offset of each partition, its low watermark where it has none."""
    from services.topics import watermarks

    c = _consumer(conf, group)
    try:
        got = c.committed([TopicPartition(t, p) for t, p in tps], timeout=15)
    finally:
        c.close()
    low = {(t, p): lo for t in {t for t, _ in tps} for p, (lo, _) in watermarks(conf, t).items()}
    return {(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else low[(tp.topic,
            tp.partition)] for tp in got}  # fmt: skip


def commit_offsets(conf: dict[str, Any], group: str, offsets: Offsets) -> None:
    c = _consumer(conf, group)
    try:
        c.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                 asynchronous=False)  # fmt: skip
    finally:
        c.close()


def _write_state(conf: dict[str, Any], topic: str, writes: list[Write]) -> dict[int, int]:
    """Send the records and wait for every acknowledgement; the offset of the first one
    written to each partition."""
    failed: list[str] = []
    first: dict[int, int] = {}

    def done(err: Any, msg: Any) -> None:
        if err is not None:
            failed.append(str(err))
        else:
            first[msg.partition()] = min(first.get(msg.partition(), msg.offset()), msg.offset())

    p = Producer({**conf, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                  "message.max.bytes": 33_554_432, "log_level": 3})  # fmt: skip
    for w in writes:
        p.produce(topic, w.value, w.key, partition=w.partition, on_delivery=done)
        p.poll(0)
    if p.flush(60) or failed:
        raise GrowError(f"{topic}: state records not acknowledged ({failed[:1]}); run again")
    return first


# Kafka deletes records (DeleteRecords) only from topics whose cleanup policy has "delete";
# a changelog is compacted: while records are deleted it is both, with nothing old enough
# for retention to take, then compacted only again
_DELETABLE: dict[str, str | None] = {
    "cleanup.policy": "compact,delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}
_COMPACTED: dict[str, str | None] = {"cleanup.policy": "compact", "retention.ms": None,
                                     "retention.bytes": None}  # fmt: skip


def _truncate(conf: dict[str, Any], topic: str, before: dict[int, int | None]) -> None:
    """Delete the records of each partition of ``topic`` before its offset in ``before``
    (None: all of them)."""
    from confluent_kafka.admin import AdminClient, ConfigResource

    if not before:
        return
    admin = AdminClient({**conf, "log_level": 3})
    res = ConfigResource("topic", topic)
    was = admin.describe_configs([res])[res].result()
    # as it was; as Faust makes it when a run cut short left it deletable
    restore = {k: None if was[k].is_default else was[k].value for k in _DELETABLE}
    if restore == _DELETABLE:
        restore = _COMPACTED
    _alter(admin, topic, _DELETABLE)
    try:
        ends = _high(conf, [topic])
        tps = [TopicPartition(topic, p, ends[(topic, p)] if off is None else off)
               for p, off in sorted(before.items())]  # fmt: skip
        for fut in admin.delete_records(tps, request_timeout=30).values():
            fut.result()
    finally:
        _alter(admin, topic, restore)


def _alter(admin: Any, topic: str, values: dict[str, str | None]) -> None:
    """Set (or, None, reset to the broker's default) ``topic``'s configs."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    entries = [
        ConfigEntry(k, v or "", incremental_operation=AlterConfigOpType.SET if v is not None
                    else AlterConfigOpType.DELETE)
        for k, v in values.items()
    ]  # fmt: skip
    res = ConfigResource("topic", topic, incremental_configs=entries)
    admin.incremental_alter_configs([res])[res].result()


def _write_marker(conf: dict[str, Any], app_id: str, marker: GrowthMarker) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = marker_topic(app_id)
    admin = AdminClient({**conf, "log_level": 3})
    if topic not in admin.list_topics(timeout=15).topics:
        new = NewTopic(topic, 1, -1, config={"cleanup.policy": "compact"})
        try:
            admin.create_topics([new])[topic].result()
        except Exception as e:
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise
    _write_state(conf, topic, [Write(0, b"raw", marker.encode())])


def _marker(conf: dict[str, Any], app_id: str) -> GrowthMarker | None:
    """The growth marker of ``app_id`` (None: it was never grown)."""
    topic = marker_topic(app_id)
    return read_marker(conf, app_id) if _partition_counts(conf, [topic])[topic] else None


async def _refine_tails(
    kafka: KafkaSettings,
    cfg: GrowConfig,
    n_old: int,
    copies: dict[str, Copies],
    start: Offsets,
    ends: Offsets,
    rep: GrowReport,
) -> list[dict[bytes, bytes]]:
    """Refine the records of the old partitions from ``start`` to ``ends`` (step 4); the
    state blobs they changed, per changelog (streams, nodes)."""
    from services.worker.grow_tails import TailRefiner

    streams, nodes = (copies[t] for t in cfg.changelogs)

    def loader(table: Copies) -> Callable[[str], bytes | None]:
        def load(key: str) -> bytes | None:
            k = key.encode()
            have = table.get(k)
            return choose(k, have, n_old, cfg.partitions, cfg.partitioner) if have else None

        return load

    tails = TailRefiner(kafka, cfg, loader(streams), loader(nodes), n_old)
    try:
        c = _consumer(kafka.librdkafka())
        try:
            c.assign([TopicPartition(t, p, start[(t, p)]) for (t, p) in ends])
            todo = {tp: end for tp, end in ends.items() if end > start[tp]}
            for m in _records(c, todo, timeout=600.0):
                await tails.add(m)
        finally:
            c.close()
        await tails.finish()
    finally:
        tails.close()
    rep.tail_records, rep.outcomes = tails.records, dict(tails.outcomes)
    s, n = tails.refiner.dirty_blobs()
    return [{k.encode(): v for k, v in s.items()}, {k.encode(): v for k, v in n.items()}]
