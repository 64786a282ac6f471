"""detect_stage's input: a simulated cluster refined in-process into the records detect reads.

:func:`write_detect_input` runs a seeded :class:`~lab.simulate.engine.Simulation` (with
congestion, throttling and Xid incidents, so rules fire and episodes open) through
:meth:`services.worker.refiner.Refiner.process_group`, in arrival order and in groups as the
worker takes them, and writes every record detect consumes (``telemetry.refined``, the aligned
events and collectives, ``telemetry.accounting``) to one file, each with the partition its
key would land on and the offset it would get there. :func:`read_detect_input` streams them
back, so a process replaying the file holds one record at a time, not the file.

File format: per record ``topic index (u8), partition (u16), offset (u64), length (u32)``,
little endian, then the value bytes compressed with zstd (refined rows are wide: a few hundred
bytes each uncompressed). Deterministic in ``(nodes, seconds, seed)``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation, Stream
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.records import JobPlacement
from schemas.topics import TOPICS
from services.detect.core import read_topics
from services.worker.refiner import RawRecord, Refiner

S = 1_000_000_000
T0 = 1_700_000_000 * S
GROUP = 500  # raw records per process_group call (the worker's take)
FAULTS = "pfc_storm:count=2,throttle:count={n},xid:count={n}"
# partitions of the topics as deployed (deploy/topics.yaml)
PARTITIONS = {
    "telemetry.raw": 8,
    "telemetry.events": 4,
    "telemetry.collectives": 4,
    "telemetry.refined": 8,
    "telemetry.events.aligned": 4,
    "telemetry.collectives.aligned": 4,
    "telemetry.accounting": 8,
}
RAW_TOPIC = {
    Stream.RAW: "telemetry.raw",
    Stream.EVENTS: "telemetry.events",
    Stream.COLLECTIVES: "telemetry.collectives",
}
DETECT_TOPICS = TOPICS
INPUTS = tuple(read_topics(DETECT_TOPICS))  # the file's topic indexes
_ZSTD = pa.Codec("zstd", compression_level=1)
_HEAD = struct.Struct("<BHQII")  # topic, partition, offset, compressed and plain length


@dataclass(frozen=True)
class InputFacts:
    """What was written: records per topic, refined rows (the samples detect evaluates)."""

    nodes: int
    seconds: int
    seed: int
    records: dict[str, int]
    refined_rows: int
    bytes: int
    # per topic, per partition: the offset after its last record (its high watermark)
    ends: dict[str, dict[str, int]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulation(nodes: int, seconds: int, seed: int) -> Simulation:
    """The run both the writer and the reader rebuild (the reader for its topology)."""
    faults = FAULTS.format(n=max(1, nodes // 8))
    return Simulation(Cluster.build(nodes, seed=seed), faults, seed=seed, start_ns=T0,
                      duration_ns=seconds * S)  # fmt: skip


def topology(nodes: int, seed: int) -> tuple[TopologyIndex, list[JobPlacement]]:
    """The topology index and job placements detect is handed (the topology feed's)."""
    cluster = Cluster.build(nodes, seed=seed)
    jobs = cluster.jobs(T0)
    return TopologyIndex(cluster.topology(), jobs), jobs


def _partition(topic: str, key: bytes | None) -> int:
    return zlib.crc32(key or b"") % PARTITIONS.get(topic, 1)


class _Offsets:
    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}

    def take(self, topic: str, partition: int) -> int:
        k = (topic, partition)
        n = self.next.get(k, 0)
        self.next[k] = n + 1
        return n


def write_detect_input(path: Path, nodes: int, seconds: int, seed: int = 7) -> InputFacts:
    """Simulate and refine ``nodes`` x ``seconds``; write detect's input to ``path``. CPU-bound
    (the refiner's rate: about a million samples per CPU-second); raises only on a bug."""
    sim = simulation(nodes, seconds, seed)
    topo, _ = topology(nodes, seed)
    refiner = Refiner(default_catalog(), TOPICS, lambda: topo, _none, _none)
    raw_offsets, out_offsets = _Offsets(), _Offsets()
    counts = {t: 0 for t in INPUTS}
    rows = size = 0
    pending: list[RawRecord] = []
    with path.open("wb") as f:

        def refine() -> None:
            nonlocal rows, size
            now = max(r.append_ms for r in pending) * 1_000_000
            for out in refiner.process_group(pending, now):
                for m in out.messages:
                    if m.topic not in counts:
                        continue
                    value = bytes(m.value)
                    part = _partition(m.topic, m.key)
                    off = out_offsets.take(m.topic, part)
                    size += _write(f, INPUTS.index(m.topic), part, off, value)
                    counts[m.topic] += 1
                    if m.topic == DETECT_TOPICS.refined:
                        rows += _rows_of(value)
            pending.clear()

        for tick in sim.ticks(greet=True):
            for msg in tick.messages:
                topic = RAW_TOPIC[msg.stream]
                part = _partition(topic, msg.key)
                ct, body = msg.encode()
                pending.append(
                    RawRecord(topic, part, raw_offsets.take(topic, part), msg.key, body,
                              [("content-type", ct.encode())], msg.due_ns // 1_000_000)
                )  # fmt: skip
                if len(pending) >= GROUP:
                    refine()
        if pending:
            refine()
    ends: dict[str, dict[str, int]] = {t: {} for t in INPUTS}
    for (topic, part), n in out_offsets.next.items():
        if topic in ends:
            ends[topic][str(part)] = n
    return InputFacts(nodes, seconds, seed, counts, rows, size, ends)


def _write(f: BinaryIO, topic: int, partition: int, offset: int, value: bytes) -> int:
    packed = _ZSTD.compress(value, asbytes=True)
    f.write(_HEAD.pack(topic, partition, offset, len(packed), len(value)))
    f.write(packed)
    return _HEAD.size + len(packed)


def _rows_of(value: bytes) -> int:
    return int(pa.ipc.open_stream(value).read_all().num_rows)


def read_detect_input(path: Path) -> Iterator[tuple[str, int, int, bytes]]:
    """The records of a :func:`write_detect_input` file, in order, one at a time:
    ``(topic, partition, offset, value)``."""
    with path.open("rb") as f:
        while head := f.read(_HEAD.size):
            topic, partition, offset, n, plain = _HEAD.unpack(head)
            value = _ZSTD.decompress(f.read(n), decompressed_size=plain, asbytes=True)
            yield INPUTS[topic], partition, offset, value


def _none(_: str) -> bytes | None:
    return None
