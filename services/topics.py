"""Topics as data: ``deploy/topics.yaml`` applied idempotently to a cluster.

:func:`load_topic_specs` reads and checks the spec; :func:`apply_topics` creates missing
topics, raises partition counts and alters configs that differ, and returns the list of
:class:`Change` it made (empty on a second run). It never deletes a topic or lowers a
partition count: it reports such a difference as a ``refused`` change instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.durations import DurationNs
from schemas.errors import ConfigError
from schemas.ingest import Format
from schemas.topics import TOPICS, Topics
from services.data_files import data_path
from services.kafka.log import cluster_metadata

DEFAULT_SPEC = data_path("deploy", "topics.yaml")


class TopicSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    partitions: int = Field(ge=1, le=10_000)
    replication_factor: int | None = None  # None = auto: min(3, brokers)
    key: str = ""
    what: str = ""
    config: dict[str, str] = Field(default_factory=dict)
    # what its records are (schemas.ingest.Format): refinery (native, by content-type) or
    # a foreign format a site's producers send without headers (otlp, influx, ...)
    format: Format = Format.REFINERY
    # a foreign format's producer: the most a row waits between its stamp and its append
    # (docs/clock.md, "declared"); empty: the format's usual (services.worker.cli)
    send_delay: DurationNs | None = None
    # optional: the site's hosts keep their clocks within this of the broker's (chrony, PTP):
    # rows are bounded by it where their records allow it (docs/clock.md, "declared")
    clock_error: DurationNs | None = None


@dataclass(frozen=True)
class Change:
    topic: str
    action: str  # create | partitions | config | refused
    detail: str

    def __str__(self) -> str:
        return f"{self.action:<10} {self.topic}: {self.detail}"


def load_topic_specs(path: Path = DEFAULT_SPEC, prefix: str = "") -> list[TopicSpec]:
    """Read a topic spec file; ``prefix`` is prepended to every name (tests, tenants)."""
    try:
        doc: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}".splitlines()[0]) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("topics"), dict):
        raise ConfigError(f"{path}: expected a 'topics' mapping")
    default_rf = (doc.get("defaults") or {}).get("replication_factor", "auto")
    specs = []
    for name, body in doc["topics"].items():
        body = dict(body or {})
        rf = body.pop("replication_factor", default_rf)
        body["config"] = {k: str(v) for k, v in (body.get("config") or {}).items()}
        try:
            specs.append(
                TopicSpec(
                    name=prefix + name,
                    replication_factor=None if rf == "auto" else int(rf),
                    **body,
                )
            )
        except (ValidationError, ValueError) as e:
            raise ConfigError(f"{path}: topic {name}: {str(e).splitlines()[0]}") from e
    return specs


def load_topics(path: Path = DEFAULT_SPEC, prefix: str = "") -> Topics:
    """The topic catalog (:class:`schemas.topics.Topics`) with ``prefix``, checked against
    the spec file at ``path``: ConfigError when the file lacks one of its topics."""
    names = (s.name for s in load_topic_specs(path, prefix))
    return TOPICS.with_prefix(prefix).covering(names, str(path))


def apply_topics(
    conf: dict[str, Any], specs: list[TopicSpec], timeout: float = 30.0
) -> list[Change]:
    """Make the cluster at ``conf`` (librdkafka options) match ``specs``."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewPartitions,
        NewTopic,
    )

    admin, md = cluster_metadata({**conf, "log_level": 3}, timeout=min(timeout, 15.0))
    brokers = len(md.brokers)
    changes: list[Change] = []

    to_create = [s for s in specs if s.name not in md.topics]
    if to_create:
        new = [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=s.replication_factor or min(3, brokers),
                config=s.config,
            )
            for s in to_create
        ]
        for name, fut in admin.create_topics(new, request_timeout=timeout).items():
            try:
                fut.result()
            except KafkaException as e:
                if "TOPIC_ALREADY_EXISTS" not in str(e):
                    raise
            spec = next(s for s in to_create if s.name == name)
            changes.append(Change(name, "create", f"{spec.partitions} partitions"))

    existing = [s for s in specs if s.name in md.topics]
    for s in existing:
        have = len(md.topics[s.name].partitions)
        held = _state_following(md, s, have) if have < s.partitions else []
        if held:
            changes.append(Change(s.name, "refused", _held_says(s, have, held)))
        elif have < s.partitions:
            admin.create_partitions([NewPartitions(s.name, s.partitions)])[s.name].result()
            changes.append(Change(s.name, "partitions", f"{have} -> {s.partitions}"))
        elif have > s.partitions:
            changes.append(
                Change(s.name, "refused", f"has {have} partitions > spec {s.partitions}")
            )
    if existing:
        resources = [ConfigResource("topic", s.name) for s in existing]
        described = admin.describe_configs(resources, request_timeout=timeout)
        for res, fut in described.items():
            current = fut.result()
            spec = next(s for s in existing if s.name == res.name)
            diff = {
                k: v for k, v in spec.config.items() if k not in current or current[k].value != v
            }
            if diff:
                entries = [
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
                    for k, v in diff.items()
                ]
                admin.incremental_alter_configs(
                    [ConfigResource("topic", spec.name, incremental_configs=entries)]
                )[ConfigResource("topic", spec.name)].result()
                for k, v in diff.items():
                    old = current[k].value if k in current else None
                    changes.append(Change(spec.name, "config", f"{k}: {old} -> {v}"))
    return changes


# a worker's state that follows the partitions of the raw topic and the ingest topics refined
# with it (services.worker.app): raised only with it, by ``refinery worker grow``
STATE_SUFFIX = "-refine-streams-changelog"


def _state_following(md: Any, spec: TopicSpec, have: int) -> list[str]:
    """The worker state topics whose partitions follow ``spec``'s (``have`` of them) when it
    is a topic the worker refines keyed by node: raising it alone would strand their state."""
    if not (spec.name.endswith(TOPICS.raw) or spec.format != Format.REFINERY):
        return []
    return sorted(
        name
        for name, t in md.topics.items()
        if name.endswith(STATE_SUFFIX) and len(t.partitions) == have
    )


def _held_says(spec: TopicSpec, have: int, held: list[str]) -> str:
    apps = ", ".join(h.removesuffix(STATE_SUFFIX) for h in held)
    return (
        f"not raised {have} -> {spec.partitions}: the state of worker app {apps} follows its"
        f" partitions; stop its workers and run `refinery worker grow --partitions"
        f" {spec.partitions} --app-id APP` (docs/operations.md, Scaling)"
    )


def raise_partitions(conf: dict[str, Any], want: dict[str, int], timeout: float = 30.0) -> None:
    """Raise each topic of ``want`` to its partition count (those already there are left);
    for ``refinery worker grow``, which raises a worker's inputs and state together."""
    from confluent_kafka.admin import NewPartitions

    admin, md = cluster_metadata({**conf, "log_level": 3}, timeout=min(timeout, 15.0))
    todo = [NewPartitions(t, n) for t, n in want.items() if len(md.topics[t].partitions) < n]
    if todo:
        for fut in admin.create_partitions(todo, request_timeout=timeout).values():
            fut.result()


def _transient(code: int, retriable: bool) -> bool:
    """Errors a metadata or watermark query meets while a new topic's leaders are elected
    or a leader moves: asked again. Anything else (authorization above all) is not."""
    from confluent_kafka import KafkaError

    return retriable or code in {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.UNKNOWN_TOPIC_OR_PART,  # metadata of a new topic not everywhere yet
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.OFFSET_NOT_AVAILABLE,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError._UNKNOWN_TOPIC,
    }


def watermarks(
    conf: dict[str, Any], topic: str, deadline_s: float = 60.0
) -> dict[int, tuple[int, int]]:
    """Low and high watermark of every partition of ``topic`` at the cluster at ``conf``.

    A topic created a moment ago answers "not leader" until its leaders are elected: such
    transient errors are retried with backoff until ``deadline_s`` has passed, then
    raised; any other error is raised at once."""
    import time
    import uuid

    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    c = Consumer({**conf, "group.id": f"refinery-marks-{uuid.uuid4().hex[:8]}", "log_level": 0})
    deadline = time.monotonic() + deadline_s
    backoff = 0.2
    try:
        while True:
            timeout = min(10.0, max(1.0, deadline - time.monotonic()))
            try:
                tmd = c.list_topics(topic, timeout=timeout).topics[topic]
                if tmd.error is not None:
                    raise KafkaException(tmd.error)
                out: dict[int, tuple[int, int]] = {}
                for p in sorted(tmd.partitions):
                    lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
                    out[p] = (int(lo), int(hi))
                return out
            except KafkaException as e:
                err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
                if err is None or not _transient(err.code(), err.retriable()):
                    raise
                if time.monotonic() + backoff > deadline:
                    raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
    finally:
        c.close()
