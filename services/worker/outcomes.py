"""The outputs step, the last of the refining chain: what each record turns into.

The chain (:mod:`services.worker.refiner` wires it) is decode → refine → waves → outputs:

- :class:`~services.worker.decoding.DecodeStep` decodes a record, or hands it here rejected
  (:meth:`OutputsStep.reject`) or replayed (:meth:`OutputsStep.replay`);
- :class:`~services.worker.refining.RefineStep` refines it, or hands it here as a duplicate
  (:meth:`OutputsStep.duplicate`), aligned (:meth:`OutputsStep.aligned`) or failed
  (:meth:`OutputsStep.failed`);
- :class:`~services.worker.waves.WaveStep` writes the refined messages of a samples group and
  hands each record here with its own (:meth:`OutputsStep.samples`).

Each of those methods puts the record's :class:`~services.worker.refiner_outputs.Outcome`
(its messages: refined or aligned rows, dead letters, accounting, alerts) in its slot of the
:class:`~services.worker.refiner_outputs.Group`; :meth:`OutputsStep.join` hands the group's
outcomes back, in record order, to whoever submitted the group. It changes no state: what
refining remembers is changed by the steps before it.

Every dead letter the worker sends is built by :func:`dead_letter`: a record rejected whole
(:func:`rejected_record`, and :func:`failed_record` for one whose refining raised) or the
rejected rows of a refined one (:func:`sample_dead_letters`); every record has one
:func:`accounting` message, whatever became of it.
"""

from __future__ import annotations

import base64
import logging

import pyarrow as pa

from pipelines.refine.clock import ClockEstimate
from pipelines.refine.types import RefineResult
from schemas.codec import ARROW, content_type_of, ipc_stream
from schemas.errors import RejectedInput
from schemas.ingest.assemble import RejectedSamples
from schemas.reasons import Reason
from schemas.records import DeadLetter, compact_json
from schemas.topics import Topics
from schemas.wire import Batch, PayloadKind
from services.kafka.outputs import OutMessage
from services.worker.refiner_outputs import (
    ZSTD,
    Group,
    Outcome,
    OutputLimits,
    OutputTooLarge,
    RawRecord,
    detail_of,
    ipc_with,
)

log = logging.getLogger(__name__)


class OutputsStep:
    """Builds each record's outcome into its group slot (see the module). Raises
    :class:`~services.worker.refiner_outputs.OutputTooLarge` from :meth:`aligned` for rows
    over the aligned topic's limit (the refine step dead-letters the record); nothing else."""

    def __init__(self, topics: Topics, limits: OutputLimits) -> None:
        self.topics = topics
        self.limits = limits

    def reject(
        self, group: Group, i: int, rec: RawRecord, ct: str | None, e: RejectedInput
    ) -> None:
        """Record ``i`` was rejected whole: its dead letter and accounting."""
        group.outs[i] = rejected_record(self.topics, rec, ct, e, group.now_ns)

    def replay(self, group: Group, i: int, batch: Batch) -> None:
        """Record ``i`` was processed at this very position before a restart: nothing again."""
        src = batch.envelope.source
        n = batch.table.num_rows
        group.outs[i] = Outcome([], "replay", n, 0, 0, 0, {}, src.stream_key(), None, None)

    def failed(self, group: Group, i: int, rec: RawRecord, batch: Batch, e: Exception) -> None:
        """Refining record ``i`` raised (its state was put back): dead-lettered whole."""
        group.outs[i] = failed_record(self.topics, rec, batch, e, group.now_ns)

    def duplicate(self, group: Group, i: int, rec: RawRecord, batch: Batch) -> None:
        """Events or collectives record ``i`` repeats a seq its source sent: accounted only."""
        src, n = batch.envelope.source, batch.table.num_rows
        acc = accounting(self.topics, rec, "duplicate", n, 0, n, 0, src.node)
        group.outs[i] = Outcome([acc], "duplicate", n, 0, n, 0, {}, src.stream_key(), None, None)

    def aligned(
        self,
        group: Group,
        i: int,
        rec: RawRecord,
        batch: Batch,
        table: pa.Table,
        est: ClockEstimate,
    ) -> None:
        """Events or collectives record ``i`` aligned (``table``, by the estimate ``est``): one
        message to its aligned topic, compressed when over the limit; raises
        :class:`OutputTooLarge` when it still is."""
        src = batch.envelope.source
        n = batch.table.num_rows
        topic = (
            self.topics.events_aligned
            if batch.envelope.kind is PayloadKind.EVENTS
            else self.topics.collectives_aligned
        )
        key = rec.key or src.node.encode()
        value = ipc_stream(table)
        limit = self.limits.max_aligned_bytes
        if len(value) > limit:
            value = ipc_with(table, ZSTD)
        if len(value) > limit:
            raise OutputTooLarge(
                f"{table.num_rows} aligned rows are {len(value)} bytes with zstd > {limit}"
            )
        msgs = [OutMessage(topic, key, value, [("content-type", ARROW.encode())])]
        msgs.append(accounting(self.topics, rec, "refined", n, n, 0, 0, src.node))
        group.outs[i] = Outcome(
            msgs, "refined", n, n, 0, 0, {}, src.stream_key(), est.offset_ns, None, est
        )

    def samples(
        self,
        group: Group,
        i: int,
        rec: RawRecord,
        batch: Batch,
        r: RefineResult,
        refined: list[OutMessage],
        alerts: list[OutMessage],
    ) -> None:
        """Samples record ``i`` refined (``r``): the ``refined`` messages whose last record it
        is (the wave step's), its rows' dead letters, its accounting and its clock ``alerts``."""
        src = batch.envelope.source
        msgs, reasons = sample_dead_letters(self.topics, rec, src.node, r, group.now_ns)
        msgs.append(
            accounting(
                self.topics,
                rec,
                r.outcome,
                r.input,
                r.refined_count,
                r.duplicate,
                r.quarantined,
                src.node,
                ts_max=r.newest_ns,
            )
        )
        msgs += alerts
        fresh = None
        if r.newest_ns is not None:
            fresh = rec.append_ms * 1_000_000 - r.newest_ns
        group.outs[i] = Outcome(
            [*refined, *msgs],
            r.outcome,
            r.input,
            r.refined_count,
            r.duplicate,
            r.quarantined,
            reasons,
            src.stream_key(),
            r.clock.offset_ns if r.clock else None,
            fresh,
            r.clock,
        )

    def join(self, group: Group) -> list[Outcome]:
        """The group's outcomes, in record order (every record has one)."""
        return [o for o in group.outs if o is not None]


def rejected_record(
    topics: Topics, rec: RawRecord, ct: str | None, e: RejectedInput, now_ns: int
) -> Outcome:
    """A record rejected whole: its dead letter (the original value in it) and accounting.
    A foreign record that decoded before it was rejected (no host identity: an ingest
    :class:`~schemas.ingest.assemble.RejectedSamples`) accounts for its samples, quarantined."""
    node = rec.key.decode("utf-8", "replace")[:128] if rec.key else None
    n = e.samples if isinstance(e, RejectedSamples) else 0
    return dead_lettered(topics, rec, e.reason, e.detail, key=rec.key or b"", node=node,
                         ct=ct, samples=n, stream=None, now_ns=now_ns)  # fmt: skip


def failed_record(
    topics: Topics, rec: RawRecord, batch: Batch, e: Exception, now_ns: int
) -> Outcome:
    """The outcome of a record whose refining raised (:mod:`services.worker.refining`):
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
    topics: Topics,
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
    topics: Topics,
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
    topics: Topics, rec: RawRecord, node: str, r: RefineResult, now_ns: int
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
    topics: Topics,
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
