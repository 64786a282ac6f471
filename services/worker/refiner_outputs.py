"""The types of the worker's refining chain, at the bottom of it: the raw record
(:class:`RawRecord`), the limits on its outputs (:class:`OutputLimits`; the topics are the
catalog's, :class:`schemas.topics.Topics`), what a record turns into
(:class:`Outcome`), and a group of records on its way through the steps (:class:`Group`).
The steps are :mod:`services.worker.decoding`, :mod:`~services.worker.refining`,
:mod:`~services.worker.waves` and :mod:`~services.worker.outcomes` (which builds every
outcome's messages); :mod:`services.worker.refiner` wires them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from pipelines.refine.clock import ClockEstimate
from pipelines.refine.types import Joined
from schemas.wire import Batch
from services.kafka.outputs import OutMessage


class OutputTooLarge(ValueError):
    """One record's output is over the output topic's message limit and cannot be split
    (a record's refined rows go out in one message: consumers dedupe by its raw position)."""


@dataclass(frozen=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    append_ms: int  # broker LogAppendTime (ms)
    # the timestamp is the broker's append time; False: the producer's CreateTime (a topic
    # without LogAppendTime), on which no clock is aligned (pipelines.refine.clock)
    log_append: bool = True


@dataclass(frozen=True)
class OutputLimits:
    """What the worker's outputs may be, beside the topics they go to."""

    # the largest message values the worker sends, below the producer's message.max.bytes
    # (32 MiB) and the broker's limit of each topic (deploy/topics.yaml: 32 MiB for refined,
    # 16 MiB for the aligned ones), with room for key and headers. An output over it is
    # written with Arrow IPC compression (zstd; every Arrow reader inflates it), then a
    # refined message is split per record; one record's output still over it is
    # dead-lettered (output_too_large)
    max_refined_bytes: int = 31 * 1024 * 1024
    max_aligned_bytes: int = 15 * 1024 * 1024


@dataclass
class Outcome:
    messages: list[OutMessage]
    outcome: str  # refined | duplicate | replay | deadletter
    input_samples: int
    refined: int
    duplicate: int
    quarantined: int
    reasons: dict[str, int]
    stream: str | None
    clock_offset_ns: int | None
    freshness_ns: int | None  # broker append time - newest aligned ts
    clock: ClockEstimate | None = None  # the estimate the record's rows were aligned with


Held = tuple[int, RawRecord, Batch]  # a decoded record waiting to be refined, by its index


@dataclass
class Group:
    """The records of one call on their way through the steps (as arroyo's messages carry
    what they commit, this carries where their outcomes go): the time they are refined at,
    each record's outcome slot in group order (filled by the outputs step,
    :class:`services.worker.outcomes.OutputsStep`), the ingest records' joined sets by index,
    and the samples records held to be refined together."""

    now_ns: int
    outs: list[Outcome | None]
    sets: dict[int, Joined] = field(default_factory=dict)
    held: list[Held] = field(default_factory=list)


ZSTD = pa.ipc.IpcWriteOptions(compression="zstd")


def ipc_with(table: pa.Table | pa.RecordBatch, options: pa.ipc.IpcWriteOptions) -> pa.Buffer:
    """``table`` as an Arrow IPC stream written with ``options`` (:data:`ZSTD`: compressed,
    for an output over its topic's limit)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=options) as w:
        w.write(table)
    return sink.getvalue()


def detail_of(e: BaseException) -> str:
    """An exception as a dead letter's or a log line's detail: its class and message."""
    return f"{type(e).__name__}: {e}"[:1024]
