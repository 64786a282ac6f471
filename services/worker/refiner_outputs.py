"""What the refiner hands back: the record and output types, and the messages that account
for a record (accounting, dead letters) whatever became of it.

Every dead letter the worker sends is built by :func:`dead_letter`: a record rejected whole
(:func:`rejected_record`, and :func:`failed` for one whose refining raised) or the rejected
rows of a refined one (:func:`sample_dead_letters`).
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass

from pipelines.refine.clock import ClockEstimate
from pipelines.refine.types import RefineResult
from schemas.codec import content_type_of
from schemas.errors import RejectedInput
from schemas.ingest.assemble import RejectedSamples
from schemas.reasons import Reason
from schemas.records import DeadLetter, compact_json
from schemas.topics import TOPICS
from schemas.wire import Batch
from services.kafka.outputs import OutMessage

log = logging.getLogger(__name__)


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
    """A record rejected whole: its dead letter (the original value in it) and accounting.
    A foreign record that decoded before it was rejected (no host identity: an ingest
    :class:`~schemas.ingest.assemble.RejectedSamples`) accounts for its samples, quarantined."""
    node = rec.key.decode("utf-8", "replace")[:128] if rec.key else None
    n = e.samples if isinstance(e, RejectedSamples) else 0
    return dead_lettered(topics, rec, e.reason, e.detail, key=rec.key or b"", node=node,
                         ct=ct, samples=n, stream=None, now_ns=now_ns)  # fmt: skip


def detail_of(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1024]


def failed(
    topics: OutputTopics, rec: RawRecord, batch: Batch, e: Exception, now_ns: int
) -> Outcome:
    """The outcome of a record whose refining raised (:mod:`services.worker.guard`):
    dead-lettered whole (its samples quarantined), its state as before it."""
    too_large = isinstance(e, OutputTooLarge)
    reason = Reason.OUTPUT_TOO_LARGE if too_large else Reason.REFINE_FAILED
    if not too_large:  # a bug: its traceback is worth a log line
        log.warning("%s[%d]@%d: refining raised; dead-lettered", rec.topic, rec.partition,
                    rec.offset, exc_info=e)  # fmt: skip
    src = batch.envelope.source
    return dead_lettered(topics, rec, reason, detail_of(e), key=src.node.encode(), node=src.node,
                         ct=content_type_of(rec.headers), samples=batch.table.num_rows,
                         stream=src.stream_key(), now_ns=now_ns)  # fmt: skip


def dead_lettered(
    topics: OutputTopics,
    rec: RawRecord,
    reason: Reason,
    detail: str,
    *,
    key: bytes,
    node: str | None,
    ct: str | None,
    samples: int,
    stream: str | None,
    now_ns: int,
) -> Outcome:
    """The outcome of a record dead-lettered whole (``samples`` quarantined): its dead letter
    with the original value, and its accounting."""
    n = samples
    msgs = [
        dead_letter(topics, rec, reason, detail, key=key, node=node, ct=ct, scope="record",
                    samples=n, now_ns=now_ns),
        accounting(topics, rec, "deadletter", n, 0, 0, n, node, reason=reason.value),
    ]  # fmt: skip
    return Outcome(msgs, "deadletter", n, 0, 0, n, {reason.value: 1}, stream, None, None)


def dead_letter(
    topics: OutputTopics,
    rec: RawRecord,
    reason: Reason,
    detail: str,
    *,
    key: bytes,
    node: str | None,
    ct: str | None,
    scope: str,
    samples: int,
    now_ns: int,
    rows: list[int] | None = None,
    original: bool = True,
) -> OutMessage:
    """The worker's one dead-letter message: ``rec`` rejected whole (``scope`` ``record``) or
    its ``rows`` (``samples``) for ``reason``, ``samples`` of its samples, with the original
    value when ``original``; ``detail`` cut to the field's 1024 characters."""
    dl = DeadLetter(
        reason=reason,
        detail=detail[:1024],
        topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        node=node,
        content_type=ct,
        scope=scope,
        samples=samples,
        rows=rows or [],
        original_b64=base64.b64encode(rec.value or b"").decode() if original else None,
        ts_ns=now_ns,
    )
    return OutMessage(topics.deadletter, key, dl.model_dump_json().encode())


def sample_dead_letters(
    topics: OutputTopics, rec: RawRecord, node: str, r: RefineResult, now_ns: int
) -> tuple[list[OutMessage], dict[str, int]]:
    """A dead letter per group of a record's rejected rows (the first with the original
    value), and the samples per reason."""
    msgs: list[OutMessage] = []
    reasons: dict[str, int] = {}
    if not r.dead_letters:
        return msgs, reasons
    key, ct = node.encode(), content_type_of(rec.headers)
    for i, group in enumerate(r.dead_letters):
        reasons[group.reason.value] = reasons.get(group.reason.value, 0) + group.count
        dl = dead_letter(topics, rec, group.reason, group.detail, key=key, node=node, ct=ct,
                         scope="samples", samples=group.count, now_ns=now_ns, rows=group.rows,
                         original=i == 0)  # fmt: skip
        msgs.append(dl)
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
    ints = (rec.partition, rec.offset, n, refined, dup, quarantined, rec.append_ms)
    if all(type(v) is int for v in ints) and (ts_max is None or type(ts_max) is int):
        strs = (_json_str(rec.topic), _json_str(node), _json_str(outcome), _json_str(reason))
        if None not in strs:
            tail = "}" if ts_max is None else f',"ts_max":{ts_max}}}'
            value = _ACCOUNTING.format(*strs, *ints) + tail
            return OutMessage(topics.accounting, str(rec.partition).encode(), value.encode())
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


# the accounting document with its fields in the order of ``accounting``'s dict, filled in
# by ``str.format``: the bytes ``compact_json`` writes (an int as its repr, a string as
# JSON's escaped form), ~5 µs sooner a record than encoding the dict
_ACCOUNTING = (
    '{{"raw_topic":{0},"raw_partition":{4},"raw_offset":{5},"node":{1},"outcome":{2},'
    '"reason":{3},"input_samples":{6},"refined_samples":{7},"duplicate_samples":{8},'
    '"quarantined_samples":{9},"append_ms":{10}'
)
_STRINGS: dict[str | None, str] = {None: "null"}  # a string → its JSON, as compact_json has it


def _json_str(s: object) -> str | None:
    """``s`` (a string or None) in JSON; None for anything else (the dict is encoded then)."""
    if type(s) is not str and s is not None:
        return None
    out = _STRINGS.get(s)
    if out is None:
        if len(_STRINGS) > 65_536:  # node names come and go: bounded
            _STRINGS.clear()
            _STRINGS[None] = "null"
        out = _STRINGS[s] = compact_json(s).decode()
    return out
