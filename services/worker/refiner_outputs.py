"""What the refiner hands back: the record and output types, and the messages that account
for a record (accounting, dead letters) whatever became of it."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from pipelines.refine.batch import RefineResult
from pipelines.refine.clock import ClockEstimate
from schemas.codec import content_type_of
from schemas.errors import RejectedInput
from schemas.records import DeadLetter, compact_json
from schemas.topics import TOPICS
from services.kafka.outputs import OutMessage


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
class OutputTopics:
    refined: str = TOPICS.refined
    events: str = TOPICS.events_aligned
    collectives: str = TOPICS.collectives_aligned
    deadletter: str = TOPICS.deadletter
    accounting: str = TOPICS.accounting
    alerts: str = TOPICS.alerts
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


def rejected_record(
    topics: OutputTopics, rec: RawRecord, ct: str | None, e: RejectedInput, now_ns: int
) -> Outcome:
    """A record rejected whole: its dead letter (the original value in it) and accounting."""
    node = rec.key.decode("utf-8", "replace")[:128] if rec.key else None
    dl = DeadLetter(
        reason=e.reason,
        detail=e.detail[:1024],
        topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        node=node,
        content_type=ct,
        scope="record",
        samples=0,
        original_b64=base64.b64encode(rec.value or b"").decode(),
        ts_ns=now_ns,
    )
    msgs = [
        OutMessage(topics.deadletter, rec.key or b"", dl.model_dump_json().encode()),
        accounting(topics, rec, "deadletter", 0, 0, 0, 0, node, reason=e.reason.value),
    ]
    return Outcome(msgs, "deadletter", 0, 0, 0, 0, {e.reason.value: 1}, None, None, None)


def sample_dead_letters(
    topics: OutputTopics, rec: RawRecord, node: str, r: RefineResult, now_ns: int
) -> tuple[list[OutMessage], dict[str, int]]:
    """A dead letter per group of a record's rejected rows (the first with the original
    value), and the samples per reason."""
    msgs: list[OutMessage] = []
    reasons: dict[str, int] = {}
    key = node.encode()
    for i, group in enumerate(r.dead_letters):
        reasons[group.reason.value] = reasons.get(group.reason.value, 0) + group.count
        dl = DeadLetter(
            reason=group.reason,
            detail=group.detail[:1024],
            topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            node=node,
            content_type=content_type_of(rec.headers),
            scope="samples",
            samples=group.count,
            rows=group.rows,
            original_b64=base64.b64encode(rec.value or b"").decode() if i == 0 else None,
            ts_ns=now_ns,
        )
        msgs.append(OutMessage(topics.deadletter, key, dl.model_dump_json().encode()))
    return msgs, reasons


def accounting(
    topics: OutputTopics,
    rec: RawRecord,
    outcome: str,
    n: int,
    refined: int,
    dup: int,
    quarantined: int,
    node: str | None,
    reason: str | None = None,
    ts_max: int | None = None,
) -> OutMessage:
    """The accounting message of one raw record (one per record, whatever its outcome);
    ``ts_max``: the newest aligned ts of its refined rows (None: it gave none), how far in
    data time the refiner has come on its partition (detect judges silence on it)."""
    doc = {
        "raw_topic": rec.topic,
        "raw_partition": rec.partition,
        "raw_offset": rec.offset,
        "node": node,
        "outcome": outcome,
        "reason": reason,
        "input_samples": n,
        "refined_samples": refined,
        "duplicate_samples": dup,
        "quarantined_samples": quarantined,
        "append_ms": rec.append_ms,
    }
    if ts_max is not None:
        doc["ts_max"] = ts_max
    return OutMessage(topics.accounting, str(rec.partition).encode(), compact_json(doc))
