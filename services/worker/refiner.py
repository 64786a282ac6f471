"""The refining step of the worker, independent of Faust: one raw Kafka record in, the
messages to publish out, state changes recorded for the next checkpoint.

:class:`Refiner` decodes a record (either wire encoding), routes samples through
:func:`pipelines.refine.refine_group` and events/collectives through
:func:`pipelines.refine.aligned.align_records`, and returns :class:`OutMessage` values for the
refined, aligned, dead-letter, accounting and alert topics. Every input record produces
exactly one accounting message (outcome ``refined``, ``duplicate``, ``replay`` or
``deadletter``) so the invariant ``input = refined + deduplicated + quarantined`` can be
checked per raw partition.

State is one object, :class:`~services.worker.refiner_state.RefinerState`: loaded lazily
per stream and node through the ``load_stream``/``load_node`` callables (the Faust tables),
written back by the caller at checkpoints from :meth:`Refiner.dirty_blobs`, and put back as
it was when an attempt at refining raises (see :mod:`services.worker.guard`).

A record whose (source, seq) was already processed *at the same Kafka position* is a replay
after a crash: its outputs were published before the state that remembers it was
checkpointed (the worker flushes outputs first), so it is skipped — outcome ``replay`` — and
nothing is published twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipelines.refine.aligned import align_records
from pipelines.refine.batch import refine_group
from pipelines.refine.clock import ClockEstimator
from pipelines.refine.dedupe import SeqWindow
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import Joined, RawBatch, RefineResult, RefineSettings
from schemas.catalog import Catalog
from schemas.codec import ARROW, content_type_of, decode, ipc_stream
from schemas.errors import RejectedInput
from schemas.ingest import IngestDecoder, Position
from schemas.reasons import Reason
from schemas.wire import Batch, PayloadKind
from services.kafka.internals import refused_detail
from services.kafka.outputs import OutMessage
from services.worker.guard import recoverable
from services.worker.refiner_ingest import Decoded, decode_ingest
from services.worker.refiner_outputs import (
    Outcome,
    OutputTooLarge,
    OutputTopics,
    RawRecord,
    accounting,
    detail_of,
    failed,
    rejected_record,
    sample_dead_letters,
)
from services.worker.refiner_state import RefinerState
from services.worker.waves import ZSTD, ipc_with, wave_messages

log = logging.getLogger(__name__)

__all__ = ["Outcome", "OutputTopics", "RawRecord", "Refiner"]


class Refiner:
    """Stateful record processor. Not thread-safe; one per worker process."""

    def __init__(
        self,
        catalog: Catalog,
        topics: OutputTopics,
        topology: Callable[[], TopologyIndex],
        load_stream: Callable[[str], bytes | None],
        load_node: Callable[[str], bytes | None],
        settings: RefineSettings | None = None,
        ingest: IngestDecoder | None = None,
    ) -> None:
        self.catalog = catalog
        self.ingest = ingest  # topics of foreign formats (schemas.ingest); None: native only
        self.topics = topics
        self._topology = topology
        self.settings = settings or RefineSettings(seq_window=512)
        # everything it remembers, in one object (the checkpoints write it to the tables)
        self.state = RefinerState(topics.alerts, self.settings.clock, load_stream, load_node)
        self._create_time_topics: set[str] = set()
        self._sets: dict[int, Joined] = {}  # record index -> its joined set, while refining

    # -- state ------------------------------------------------------------------------------

    def forget(self) -> None:
        """Drop in-memory state (partitions were revoked); it reloads from the tables."""
        self.state.forget()

    def dirty_blobs(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(stream key → blob, node → blob) changed since the last call."""
        return self.state.dirty_blobs()

    # -- processing -------------------------------------------------------------------------

    def process(self, rec: RawRecord, now_ns: int) -> Outcome:
        """Everything one raw record turns into. Raises only on a bug."""
        return self.process_group([rec], now_ns)[0]

    def process_group(self, recs: list[RawRecord], now_ns: int) -> list[Outcome]:
        """What each record turns into, in order: the same outcomes and state as
        :meth:`process` on each in turn, with the samples batches refined together
        (:func:`pipelines.refine.refine_group`). The refined rows of one node's batches of a
        wave go out as one refined message (one IPC stream to write, and to read for every
        consumer, instead of one per raw record), listed in the outcome of the last of them;
        its ``lineage`` header names each record. Raises only on a bug."""
        outs: list[Outcome | None] = [None] * len(recs)
        pending: list[tuple[int, RawRecord, Batch]] = []
        ingest = decode_ingest(self.ingest, recs)
        self._sets = {i: d.joined for i, d in ingest.items() if isinstance(d, Decoded)}

        def flush() -> None:
            if pending:
                self._guarded(pending, outs, now_ns)
                pending.clear()

        for i, rec in enumerate(recs):
            got = ingest.get(i)
            if isinstance(got, Decoded):  # a joined set waits whole at its first record
                for m in got.members if got.first == i else []:
                    member = ingest[m]
                    assert isinstance(member, Decoded)
                    outs[m] = self._replay(recs[m], member.batch)
                    if outs[m] is None:
                        pending.append((m, recs[m], member.batch))
                continue
            ct = content_type_of(rec.headers)
            try:
                if isinstance(got, RejectedInput):
                    raise got
                batch = self._decode(rec, ct)
            except RejectedInput as e:
                outs[i] = rejected_record(self.topics, rec, ct, e, now_ns)
                continue
            except Exception as e:  # a decoder's bug: this record's failure, no one else's
                if not recoverable(e):
                    raise
                bad = RejectedInput(Reason.UNDECODABLE, detail_of(e))
                outs[i] = rejected_record(self.topics, rec, ct, bad, now_ns)
                continue
            outs[i] = self._replay(rec, batch)
            if outs[i] is not None:
                continue
            if batch.envelope.kind is PayloadKind.SAMPLES:
                pending.append((i, rec, batch))
            else:
                flush()  # records share the sources' seq windows and clocks: keep the order
                self._guarded([(i, rec, batch)], outs, now_ns)
        flush()
        self._sets = {}
        return [o for o in outs if o is not None]

    def _replay(self, rec: RawRecord, batch: Batch) -> Outcome | None:
        """The outcome of a record whose (source, seq) was processed at this very Kafka
        position (a replay after a crash), else None; loads the source's state."""
        self.state.load(batch)
        src = batch.envelope.source
        window = self.state.refine.seqs.get(src.key())
        if window is not None and window.positions.get(batch.envelope.seq) == (
            rec.partition,
            rec.offset,
        ):
            n = batch.table.num_rows
            return Outcome([], "replay", n, 0, 0, 0, {}, src.stream_key(), None, None)
        return None

    def _guarded(
        self, items: list[tuple[int, RawRecord, Batch]], outs: list[Outcome | None], now_ns: int
    ) -> None:
        """Refine ``items`` (samples batches, or one events or collectives record) into
        ``outs``; if that raises, put their state back and refine them one at a time, each
        that raises again dead-lettered whole (see :mod:`services.worker.guard`)."""
        snap = self.state.snapshot([b for _, _, b in items])
        try:
            self._refine_items(items, outs, now_ns)
            return
        except Exception as e:
            if not recoverable(e):
                raise
            self.state.restore(snap)
            if len(items) > 1:
                log.warning("refining %d records raised %s; refining them one by one",
                            len(items), detail_of(e))  # fmt: skip
            else:
                outs[items[0][0]] = failed(self.topics, *items[0][1:], e, now_ns)
                return
        for item in items:
            snap = self.state.snapshot([item[2]])
            try:
                self._refine_items([item], outs, now_ns)
            except Exception as e:
                if not recoverable(e):
                    raise
                self.state.restore(snap)
                outs[item[0]] = failed(self.topics, *item[1:], e, now_ns)

    def _refine_items(
        self, items: list[tuple[int, RawRecord, Batch]], outs: list[Outcome | None], now_ns: int
    ) -> None:
        if items[0][2].envelope.kind is not PayloadKind.SAMPLES:
            i, rec, batch = items[0]
            outs[i] = self._records(rec, batch, now_ns)
            return
        pending = items
        items_ = [RawBatch(b, (r.partition, r.offset), r.append_ms * 1_000_000,
                           self._log_append(r), r.topic, self._sets.get(i) if len(items) > 1
                           else None) for i, r, b in pending]  # fmt: skip
        results = refine_group(
            items_, self.state.refine, self.catalog, self._topology(), now_ns, self.settings
        )
        refined: list[tuple[int, RawRecord, Batch, RefineResult]] = []
        for (i, r, b), res in zip(pending, results, strict=True):
            outs[i] = self._samples(r, b, res, now_ns)
            if res.refined_count:
                refined.append((i, r, b, res))
        for part, msg in wave_messages(self.topics, refined):
            last = outs[max(i for i, _, _, _ in part)]
            assert last is not None
            last.messages.insert(0, msg)

    def _decode(self, rec: RawRecord, ct: str | None) -> Batch:
        """The record's batch: by its topic's declared format when it is an ingest topic.
        A record whose compressed batch would inflate past the consumer's bound was never
        inflated (:mod:`services.kafka.internals`): rejected as oversized."""
        refused = refused_detail(rec.headers)
        if refused is not None:
            raise RejectedInput(Reason.OVERSIZED, refused)
        if self.ingest is None:
            return decode(rec.value, ct)
        at = Position(rec.partition, rec.offset, rec.append_ms * 1_000_000, rec.key)
        return self.ingest.decode(rec.topic, rec.value, ct, at)

    def _samples(self, rec: RawRecord, batch: Batch, r: RefineResult, now_ns: int) -> Outcome:
        src = batch.envelope.source
        stream = src.stream_key()
        self.state.mark(stream, src.node)
        msgs, reasons = sample_dead_letters(self.topics, rec, src.node, r, now_ns)
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
        msgs += self.state.alerts.observe(stream, src.node, r, now_ns, rec)
        fresh = None
        if r.newest_ns is not None:
            fresh = rec.append_ms * 1_000_000 - r.newest_ns
        return Outcome(
            msgs,
            r.outcome,
            r.input,
            r.refined_count,
            r.duplicate,
            r.quarantined,
            reasons,
            stream,
            r.clock.offset_ns if r.clock else None,
            fresh,
            r.clock,
        )

    def _records(self, rec: RawRecord, batch: Batch, now_ns: int) -> Outcome:
        src = batch.envelope.source
        stream = src.stream_key()
        position = (rec.partition, rec.offset)
        n = batch.table.num_rows
        st = self.state.refine
        window = st.seqs.get(src.key())
        if window is None:
            window = st.seqs[src.key()] = SeqWindow(window=self.settings.seq_window)
        self.state.mark(stream)
        if window.observe(batch.envelope.seq, position).is_duplicate:
            acc = accounting(self.topics, rec, "duplicate", n, 0, n, 0, src.node)
            return Outcome([acc], "duplicate", n, 0, n, 0, {}, stream, None, None)
        clock = st.clocks.get(stream)
        if clock is None:
            clock = st.clocks[stream] = ClockEstimator(self.settings.clock)
        arrival = rec.append_ms * 1_000_000 if self._log_append(rec) else None
        est = clock.observe(batch.envelope.sent_ns, arrival, batch.envelope.clock, rec.partition)
        table = align_records(batch, est, position, rec.topic)
        topic = (
            self.topics.events
            if batch.envelope.kind is PayloadKind.EVENTS
            else self.topics.collectives
        )
        key = rec.key or src.node.encode()
        value = ipc_stream(table)
        limit = self.topics.max_aligned_bytes
        if len(value) > limit:
            value = ipc_with(table, ZSTD)
        if len(value) > limit:
            raise OutputTooLarge(
                f"{table.num_rows} aligned rows are {len(value)} bytes with zstd > {limit}"
            )
        msgs = [OutMessage(topic, key, value, [("content-type", ARROW.encode())])]
        msgs.append(accounting(self.topics, rec, "refined", n, n, 0, 0, src.node))
        return Outcome(msgs, "refined", n, n, 0, 0, {}, stream, est.offset_ns, None, est)

    def _log_append(self, rec: RawRecord) -> bool:
        """Whether ``rec`` carries the broker's append time; says once per topic when not."""
        if not rec.log_append and rec.topic not in self._create_time_topics:
            self._create_time_topics.add(rec.topic)
            log.warning(
                "%s has CreateTime stamps, not LogAppendTime: its records are not aligned on "
                "them (rows flagged clock_basis=create_time unless their source sends "
                "exchanges); set message.timestamp.type=LogAppendTime on the topic",
                rec.topic,
            )
        return rec.log_append
