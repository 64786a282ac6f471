"""What the worker checks on the cluster before it starts.

The worker keeps each stream's state in the Faust tables' changelog topics, every record on
the partition of the input record that changed it (``services.worker.checkpoints``): the
changelog topics have as many partitions as the input topics they follow, fixed when they are
created.
An input topic whose partitions were raised since (as scaling out would suggest) sends a
stream's records to a partition its state is not on, and changelog records to partitions the
changelog topics lack: the worker refuses to start instead, saying what to do.
"""

from __future__ import annotations

from typing import Any

from schemas.errors import ConfigError

# the worker's tables and the input each is co-partitioned with (services.worker.app)
TABLES = (("refine-streams", "raw"), ("refine-nodes", "raw"), ("align-streams", "events"))


class PartitionMismatch(ConfigError):
    """An input topic's partitions differ from those of the state that follows it."""


def check_partitions(conf: dict[str, Any], app_id: str, inputs: dict[str, str]) -> None:
    """Raise :class:`PartitionMismatch` (one line: what and what to do) when an input topic
    (``inputs``: ``raw``, ``events`` → topic name) has a partition count other than that of an
    existing changelog topic of the worker's tables. Absent topics are fine: Faust creates
    the changelogs to match."""
    from confluent_kafka.admin import AdminClient

    md = AdminClient({**conf, "log_level": 3}).list_topics(timeout=15)

    def partitions(topic: str) -> int | None:
        t = md.topics.get(topic)
        return len(t.partitions) if t is not None and t.error is None and t.partitions else None

    for table, source in TABLES:
        changelog = f"{app_id}-{table}-changelog"
        have, want = partitions(changelog), partitions(inputs[source])
        if have is not None and want is not None and have != want:
            raise PartitionMismatch(
                f"{inputs[source]} has {want} partitions but the worker's state topic"
                f" {changelog} has {have}: the worker cannot follow a partition change of its"
                f" inputs; start it with a new --app-id (its state is rebuilt from the inputs)"
            )
