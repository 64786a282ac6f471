"""Follow the compacted ``topology``, ``topology.nodes`` and ``jobs`` topics into an in-memory,
versioned view.

``topology`` carries the fabric as the admin's importers publish it (topology file,
ibnetdiscover, NCCL, scheduler); ``topology.nodes`` what each node exporter reports of itself: its
``netdev`` entities (interface ↔ RDMA device ↔ port, LLDP neighbour). The exporters may write only
the latter, so a record there that is not a netdev entity keyed by its own id is refused
(counted as bad), and where both topics hold the same id the ``topology`` one wins: an exporter
can neither overwrite nor add switch, link or NIC facts.

Every worker reads the topics whole (no consumer group: all partitions assigned from the
beginning) in a background thread and keeps the latest record per key. :meth:`TopologyFeed.
wait_caught_up` blocks until the end offsets seen at start have been read, so no sample is
enriched against a half-loaded topology. :meth:`snapshot` returns the current entity and job
lists plus a version number that changes whenever either changed (a record republished
unchanged does not count), so the caller rebuilds its join index only then; :attr:`version`
reads the number alone. During the first load the version moves once, when it is caught up.

A record that does not parse is logged, counted in ``stats['bad']`` and skipped; a tombstone
(null value) deletes its key.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import ValidationError

from schemas.records import EntityKind, JobPlacement, TopologyEntity
from services.topology.topofile import netdev_id

log = logging.getLogger(__name__)

NODES_SUFFIX = ".nodes"


def nodes_topic(topology_topic: str) -> str:
    """The topic of node-reported facts beside ``topology_topic`` (``topology.nodes``, or
    ``<prefix>topology.nodes`` under a prefix)."""
    return topology_topic + NODES_SUFFIX


class TopologyFeed:
    """Background reader of the topology, node facts and jobs topics. Start with
    :meth:`start`. ``node_topic`` defaults to :func:`nodes_topic` of ``topology_topic``."""

    def __init__(
        self,
        conf: dict[str, Any],
        topology_topic: str,
        jobs_topic: str,
        node_topic: str | None = None,
    ) -> None:
        self._conf = conf
        self._topics = {
            topology_topic: "topology",
            node_topic or nodes_topic(topology_topic): "nodes",
            jobs_topic: "jobs",
        }
        self._lock = threading.Lock()
        self._entities: dict[str, TopologyEntity] = {}
        self._node_facts: dict[str, TopologyEntity] = {}
        self._jobs: dict[str, JobPlacement] = {}
        self._version = 0
        self._caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"records": 0, "bad": 0}
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="topology-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def wait_caught_up(self, timeout: float = 60.0) -> bool:
        return self._caught_up.wait(timeout)

    @property
    def version(self) -> int:
        """Changes whenever an entity or job changed (cheap: no copy)."""
        return self._version

    def snapshot(self) -> tuple[int, list[TopologyEntity], list[JobPlacement]]:
        with self._lock:
            ents = list(self._entities.values())
            ents += [e for k, e in self._node_facts.items() if k not in self._entities]
            return self._version, ents, list(self._jobs.values())

    def _run(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        from services.kafka.internals import LIBRDKAFKA_CONSUMER_BOUNDS

        try:
            c = Consumer(
                {
                    **self._conf,
                    **LIBRDKAFKA_CONSUMER_BOUNDS,
                    "group.id": "refinery-topology-feed",  # never used to commit
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                    "auto.offset.reset": "earliest",
                }
            )
            md = c.list_topics(timeout=30)
            parts: list[TopicPartition] = []
            for topic in self._topics:
                tmd = md.topics.get(topic)
                if tmd is None or tmd.error is not None:
                    log.warning("topic %s not found; enrichment will carry reasons", topic)
                    continue
                parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in tmd.partitions]
            c.assign(parts)
            pending = set()
            for tp in parts:
                lo, hi = c.get_watermark_offsets(tp, timeout=10)
                if hi > lo:
                    pending.add((tp.topic, tp.partition))
            caught = not pending
            if caught:
                self._caught_up.set()
            changed = False  # applied since the version last moved
            while not self._stop.is_set():
                msgs = c.consume(500, 0.2)
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            pending.discard((m.topic(), m.partition()))
                            caught = caught or not pending
                        continue
                    changed |= self._apply(m.topic(), m.key(), m.value())
                # while the first load runs the version stands still: a reader waiting for it
                # would otherwise rebuild its join index for every half-loaded view; it moves
                # before waiters are released, so they see the whole load at once
                if changed and caught:
                    with self._lock:
                        self._version += 1
                    changed = False
                if caught and not self._caught_up.is_set():
                    self._caught_up.set()
            c.close()
        except BaseException as e:  # surfaced to the worker, which crashes on it
            log.exception("topology feed failed")
            self.error = e
            self._caught_up.set()

    def _apply(self, topic: str | None, key: bytes | None, value: bytes | None) -> bool:
        kind = self._topics.get(topic or "")
        if kind is None or key is None:
            return False
        k = key.decode("utf-8", "replace")
        self.stats["records"] += 1
        stores: dict[str, dict[str, Any]] = {
            "topology": self._entities,
            "nodes": self._node_facts,
            "jobs": self._jobs,
        }
        with self._lock:
            store = stores[kind]
            if value is None:
                return store.pop(k, None) is not None
            try:
                new = _parse(kind, k, value)
            except (ValueError, ValidationError) as e:
                self.stats["bad"] += 1
                log.warning("bad %s record %r: %s", kind, k, str(e).splitlines()[0])
                return False
            if store.get(k) == new:
                return False  # republished unchanged: the join index stays valid
            store[k] = new
        return True


def _parse(kind: str, key: str, value: bytes) -> TopologyEntity | JobPlacement:
    """One record of a ``kind`` topic; raises ValueError for what it may not carry."""
    doc = json.loads(value)
    if kind == "jobs":
        return JobPlacement.model_validate(doc)
    ent = TopologyEntity.model_validate(doc)
    if kind == "nodes":
        if ent.kind is not EntityKind.NETDEV:
            raise ValueError(f"a node reports only netdev entities, not {ent.kind.value}")
        own = netdev_id(ent.node or "", ent.device or "")
        if ent.id != own or key != own:
            raise ValueError(f"a node's netdev entity is keyed {own!r}")
    return ent
