"""The pure parts of growing the raw topic's partitions under a worker's state
(:mod:`services.worker.grow` does the I/O; docs/operations.md, "Scaling").

Where a key's records go (:func:`partition_of`: the producers' partitioner, CRC-32 for
librdkafka's default ``consistent_random`` that Refinery's exporters use, murmur2 for the Java
client and aiokafka), where each table key's state must live once the topic has ``n``
partitions (:func:`home_of`, the partition of its node), what to write to the changelogs so
that every key has one live copy, at its home (:func:`rekey`), in which order the records
left on the old partitions are refined (:func:`phase_of`), when the producers have moved
(:class:`SettleWatch`), and the growth's marker (:class:`GrowthMarker`) by which the
worker's preflight tells a growth made by the procedure from one made by hand
(:func:`judge`).

>>> partition_of(b"node0002", 8), partition_of(b"node0002", 16)
(7, 15)
>>> home_of(b"node0002|node|0", 16)
15
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from typing import Literal

Partitioner = Literal["consistent_random", "murmur2_random"]
PARTITIONERS: tuple[Partitioner, ...] = ("consistent_random", "murmur2_random")

# the tables whose state follows the raw topic (services.worker.app) and the procedure's name
RAW_TABLES = ("refine-streams", "refine-nodes")
PROCEDURE = "refinery worker grow"


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as a signed int32."""
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    rest = length % 4
    tail = length - rest
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_of(key: bytes, n: int, partitioner: Partitioner = "consistent_random") -> int:
    """The partition a producer with ``partitioner`` sends a record keyed ``key`` to."""
    if partitioner == "murmur2_random":
        return (murmur2(key) & 0x7FFFFFFF) % n
    return zlib.crc32(key) % n


def node_of(key: bytes) -> bytes:
    """The node of a table key: a stream key ``node|exporter|instance`` or a node."""
    return key.split(b"|", 1)[0]


def home_of(key: bytes, n: int, partitioner: Partitioner = "consistent_random") -> int:
    """The changelog partition a table key's state belongs on with ``n`` partitions: that of
    its node's raw records (the raw topic is keyed by node)."""
    return partition_of(node_of(key), n, partitioner)


def phase_of(partition: int, key: bytes | None, n_old: int, partitioner: Partitioner) -> int:
    """When a record left on an old partition is refined: 0 when it is on its key's old home
    (a source's records from before the raise, or of a source that stays), 1 when its source
    moved onto this partition at the raise (its records on its old home come first)."""
    if key is None or partition_of(key, n_old, partitioner) == partition:
        return 0
    return 1


@dataclass(frozen=True)
class Write:
    """One changelog record."""

    partition: int
    key: bytes
    value: bytes


@dataclass
class Rekeyed:
    writes: list[Write]  # appended, in order
    # partitions rewritten whole by ``writes``: their records before the first of them go
    truncate: set[int]
    moved: int  # keys whose state is written to a new partition
    unplaced: int  # keys whose state was on no home of its node (keyless sources)


def rekey(
    copies: dict[bytes, dict[int, bytes]],
    n_old: int,
    n_new: int,
    partitioner: Partitioner,
    updated: dict[bytes, bytes] | None = None,
) -> Rekeyed:
    """The changelog records that leave each key of ``copies`` (key → partition → its latest
    live value there) with one live copy, at its home with ``n_new`` partitions.

    The value kept is ``updated[key]`` when given (state refined since the changelogs were
    read), else :func:`choose`'s. A partition that holds a copy of a key whose home is
    elsewhere is rewritten whole (every key whose home it is, written again) and its records
    before the rewrite are deleted (``truncate``): no tombstone will do, since Faust's
    in-memory store applies the partitions it recovers in no set order and a tombstone read
    after the key's live copy on another partition deletes it. Running it again on the
    result writes nothing.
    """
    final: dict[bytes, tuple[int, bytes]] = {}
    out = Rekeyed([], set(), 0, 0)
    for key in sorted(set(copies) | set(updated or {})):
        have = copies.get(key, {})
        new, old = home_of(key, n_new, partitioner), home_of(key, n_old, partitioner)
        if have and new not in have and old not in have:
            out.unplaced += 1
        value = (updated or {}).get(key)
        final[key] = (new, value if value is not None else
                      choose(key, have, n_old, n_new, partitioner))  # fmt: skip
        out.moved += new not in have
        out.truncate |= {p for p in have if p != new}
    for key, (home, value) in final.items():
        if home in out.truncate or copies.get(key, {}).get(home) != value:
            out.writes.append(Write(home, key, value))
    return out


def choose(
    key: bytes, have: dict[int, bytes], n_old: int, n_new: int, partitioner: Partitioner
) -> bytes:
    """The copy of ``key``'s state that is its state (``have``: partition → live value, not
    empty): the one at its new home (a run cut short after writing it there), else at its old
    home, else the lowest partition's (a keyless source's, which has no home)."""
    new, old = home_of(key, n_new, partitioner), home_of(key, n_old, partitioner)
    if new in have:
        return have[new]
    return have[old] if old in have else have[min(have)]


class SettleWatch:
    """Whether the producers have moved to the new partitions: the records appended to the
    old partitions since the raise, as they are read (:meth:`see`). Settled when every node
    in ``moving`` (those whose state moves) has been seen on its new home and no record has
    come to a partition other than its key's new home for ``quiet_s``. Keyless records say
    nothing and are ignored. Times in seconds, of any monotonic clock."""

    def __init__(
        self, moving: set[bytes], n_new: int, partitioner: Partitioner, quiet_s: float, t0: float
    ) -> None:
        self.waiting = set(moving)
        self.n_new, self.partitioner, self.quiet_s = n_new, partitioner, quiet_s
        self.last_misplaced = t0
        self.misplaced = 0

    def see(self, partition: int, key: bytes | None, now: float) -> None:
        if key is None:
            return
        if partition_of(key, self.n_new, self.partitioner) == partition:
            self.waiting.discard(key)
        else:
            self.misplaced += 1
            self.last_misplaced = now

    def quiet(self, now: float) -> bool:
        return now - self.last_misplaced >= self.quiet_s

    def settled(self, now: float) -> bool:
        return not self.waiting and self.quiet(now)


@dataclass(frozen=True)
class GrowthMarker:
    """What the procedure last did to a worker's state (topic ``<app-id>-growth``): growing
    it from ``from_partitions`` to ``to_partitions`` (``state`` ``started``) or done."""

    from_partitions: int
    to_partitions: int
    partitioner: Partitioner
    state: Literal["started", "done"]

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, blob: bytes) -> GrowthMarker:
        d = json.loads(blob)
        return cls(int(d["from_partitions"]), int(d["to_partitions"]), d["partitioner"],
                   d["state"])  # fmt: skip


def marker_topic(app_id: str) -> str:
    return f"{app_id}-growth"


def grown_from(
    marker: GrowthMarker | None, state_n: int, want: int, partitioner: Partitioner
) -> int:
    """The partition count the state is keyed for, which a growth to ``want`` starts from:
    ``state_n`` (the state topics' partitions), or the ``from_partitions`` of a growth that
    was not finished (its raise already gave the state topics ``want``). Raises
    ``ValueError`` (one line) when an unfinished growth went elsewhere or with another
    partitioner: it must be finished as it began."""
    if marker is None or marker.state == "done":
        return state_n
    if (marker.to_partitions, marker.partitioner) != (want, partitioner):
        raise ValueError(
            f"the growth to {marker.to_partitions} partitions ({marker.partitioner}) was not"
            f" finished: run `{PROCEDURE} --partitions {marker.to_partitions} --partitioner"
            f" {marker.partitioner}` again"
        )
    return marker.from_partitions


def judge(
    raw: str, raw_n: int, changelog: str, changelog_n: int, marker: GrowthMarker | None
) -> str | None:
    """Why a worker must not start on this state (one line naming the procedure), or None:
    the raw topic's partitions (``raw_n``) differ from its state topic's, a growth was not
    finished, or the state topic's partitions differ from those the state was keyed for."""
    grow = f"stop every worker of the group and run `{PROCEDURE} --partitions {raw_n}`"
    if marker is not None and marker.state == "started":
        return (
            f"the growth of {raw} from {marker.from_partitions} to {marker.to_partitions}"
            f" partitions was not finished: run `{PROCEDURE} --partitions"
            f" {marker.to_partitions}` again (docs/operations.md, Scaling)"
        )
    if raw_n != changelog_n:
        return (
            f"{raw} has {raw_n} partitions but the worker's state topic {changelog} has"
            f" {changelog_n}: they were changed outside `{PROCEDURE}`, whose re-keying keeps"
            f" the state; {grow} (docs/operations.md, Scaling), or start it with a new"
            f" --app-id (its state is rebuilt from the inputs)"
        )
    if marker is not None and marker.to_partitions != changelog_n:
        return (
            f"the worker's state topic {changelog} has {changelog_n} partitions but its state"
            f" was keyed for {marker.to_partitions} by `{PROCEDURE}`: partitions were raised"
            f" outside it; {grow} (docs/operations.md, Scaling)"
        )
    return None
