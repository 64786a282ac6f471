"""What the worker checks on the cluster before it starts.

The worker keeps each stream's state in the Faust tables' changelog topics, every record on
the partition of the input record that changed it (``services.worker.checkpoint``): the
changelog topics have as many partitions as the input topics they follow, and each key's
state is on the partition its node's records go to.
The raw topic's partitions are raised with its state by ``refinery worker grow``
(:mod:`services.worker.grow`), which raises the changelogs with it and moves every key's
state to its node's new partition. An input topic whose partitions were raised otherwise
sends a stream's records to a partition its state is not on, and changelog records to
partitions the changelog topics lack: the worker refuses to start instead, in one line
naming the procedure (:func:`services.worker.growth_plan.judge`); so it does while a growth
is not finished.
"""

from __future__ import annotations

from typing import Any

from schemas.errors import ConfigError
from services.worker.growth_plan import GrowthMarker, judge, marker_topic

# the worker's tables and the input each is co-partitioned with (services.worker.app)
TABLES = (("refine-streams", "raw"), ("refine-nodes", "raw"), ("align-streams", "events"))


class PartitionMismatch(ConfigError):
    """An input topic's partitions differ from those of the state that follows it."""


def check_partitions(conf: dict[str, Any], app_id: str, inputs: dict[str, str]) -> None:
    """Raise :class:`PartitionMismatch` (one line: what and what to do) when an input topic
    (``inputs``: ``raw``, ``events`` → topic name) has a partition count other than that of an
    existing changelog topic of the worker's tables, or when a growth of the raw topic by
    ``refinery worker grow`` was not finished. Absent topics are fine: Faust creates the
    changelogs to match."""
    from confluent_kafka.admin import AdminClient

    md = AdminClient({**conf, "log_level": 3}).list_topics(timeout=15)

    def partitions(topic: str) -> int | None:
        t = md.topics.get(topic)
        return len(t.partitions) if t is not None and t.error is None and t.partitions else None

    marker = read_marker(conf, app_id) if marker_topic(app_id) in md.topics else None
    for table, source in TABLES:
        changelog = f"{app_id}-{table}-changelog"
        have, want = partitions(changelog), partitions(inputs[source])
        if have is None or want is None:
            continue
        if source == "raw":
            why = judge(inputs[source], want, changelog, have, marker)
            if why is not None:
                raise PartitionMismatch(why)
        elif have != want:
            raise PartitionMismatch(
                f"{inputs[source]} has {want} partitions but the worker's state topic"
                f" {changelog} has {have}: the worker cannot follow a partition change of this"
                f" input; start it with a new --app-id (its state is rebuilt from the inputs)"
            )


def read_marker(conf: dict[str, Any], app_id: str, timeout: float = 15.0) -> GrowthMarker | None:
    """The last growth marker of ``app_id`` (:class:`GrowthMarker`), None if it has none."""
    import time
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    topic = marker_topic(app_id)
    c = Consumer({**conf, "group.id": f"refinery-growth-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "log_level": 3})  # fmt: skip
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout)
        if hi <= lo:
            return None
        c.assign([TopicPartition(topic, 0, hi - 1)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            value = m.value() if m is not None and m.error() is None else None
            if value is not None:
                return GrowthMarker.decode(value)
        raise ConfigError(f"{topic}: its last record could not be read in {timeout:g} s")
    finally:
        c.close()
