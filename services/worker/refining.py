"""The refine step of the refining chain: decoded records in, refined records out, each
attempt at refining guarded.

:class:`RefineStep` holds a group's samples records (:meth:`~RefineStep.submit`) to refine
them together (:func:`pipelines.refine.refine_group`) and hands them to the wave step
(:class:`services.worker.waves.WaveStep`); an events or collectives record first refines the
samples held before it (records share their sources' seq windows and clocks: the order is
kept), then is aligned alone (:func:`pipelines.refine.aligned.align_records`) and handed to
the outputs step (:class:`services.worker.outcomes.OutputsStep`). It is the step that changes
what refining remembers (:class:`~services.worker.refiner_state.RefinerState`): seq windows,
clocks, counters, overlaps, clock alerts, and which streams and nodes changed.

An attempt that raises for anything but an infrastructure failure
(:func:`services.worker.guard.recoverable`) has its state put back
(:meth:`RefinerState.snapshot <services.worker.refiner_state.RefinerState.snapshot>`,
``restore``) and its records are refined one at a time; each that raises again is handed to
the outputs step as failed (dead-lettered whole), its state put back too. The steps after it
run inside the attempt: an output over its topic's limit fails its record the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipelines.refine.aligned import align_records
from pipelines.refine.batch import refine_group
from pipelines.refine.clock import ClockEstimator
from pipelines.refine.dedupe import SeqWindow
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import RawBatch, RefineSettings
from schemas.catalog import Catalog
from schemas.wire import Batch, PayloadKind
from services.kafka.outputs import OutMessage
from services.worker.guard import recoverable
from services.worker.outcomes import OutputsStep
from services.worker.refiner_outputs import Group, Held, Outcome, RawRecord, detail_of
from services.worker.refiner_state import RefinerState
from services.worker.waves import Item, WaveStep

log = logging.getLogger(__name__)


class RefineStep:
    """Refines the records it is given, in order (see the module). Not thread-safe."""

    def __init__(
        self,
        catalog: Catalog,
        topology: Callable[[], TopologyIndex],
        settings: RefineSettings,
        state: RefinerState,
        waves: WaveStep,
        outputs: OutputsStep,
    ) -> None:
        self.catalog = catalog
        self._topology = topology
        self.settings = settings
        self.state = state
        self.waves = waves
        self.outputs = outputs
        self._create_time_topics: set[str] = set()

    def submit(self, group: Group, i: int, rec: RawRecord, batch: Batch) -> None:
        """Record ``i`` of ``group``, decoded: a samples record is held to be refined with the
        others (:meth:`hold`); any other is refined now, after those held before it."""
        if batch.envelope.kind is PayloadKind.SAMPLES:
            group.held.append((i, rec, batch))
            return
        if group.held:
            self._refine_held(group)
        self._guarded(group, [(i, rec, batch)])

    def hold(self, group: Group, i: int, rec: RawRecord, batch: Batch) -> None:
        """Hold record ``i`` (of an ingest topic's joined set) to be refined with the others."""
        group.held.append((i, rec, batch))

    def join(self, group: Group) -> list[Outcome]:
        """The group's records are all submitted: refine those held; its outcomes in order."""
        if group.held:
            self._refine_held(group)
        return self.outputs.join(group)

    def _refine_held(self, group: Group) -> None:
        items, group.held = group.held, []
        self._guarded(group, items)

    def _guarded(self, group: Group, items: list[Held]) -> None:
        """Refine ``items`` (samples records, or one events or collectives record); if that
        raises, put their state back and refine them one at a time, each that raises again
        handed on as failed (see the module)."""
        snap = self.state.snapshot([b for _, _, b in items])
        try:
            self._attempt(group, items)
            return
        except Exception as e:
            if not recoverable(e):
                raise
            self.state.restore(snap)
            if len(items) > 1:
                log.warning("refining %d records raised %s; refining them one by one",
                            len(items), detail_of(e))  # fmt: skip
            else:
                self.outputs.failed(group, *items[0], e)
                return
        for item in items:
            snap = self.state.snapshot([item[2]])
            try:
                self._attempt(group, [item])
            except Exception as e:
                if not recoverable(e):
                    raise
                self.state.restore(snap)
                self.outputs.failed(group, *item, e)

    def _attempt(self, group: Group, items: list[Held]) -> None:
        if items[0][2].envelope.kind is not PayloadKind.SAMPLES:
            self._align(group, *items[0])
            return
        joined = len(items) > 1  # a joined set refines as one unit only with its members
        raws = [RawBatch(b, (r.partition, r.offset), r.append_ms * 1_000_000, self._log_append(r),
                         r.topic, group.sets.get(i) if joined else None)
                for i, r, b in items]  # fmt: skip
        results = refine_group(
            raws, self.state.refine, self.catalog, self._topology(), group.now_ns, self.settings
        )
        refined: list[Item] = []
        alerts: list[list[OutMessage]] = []
        for (i, rec, batch), res in zip(items, results, strict=True):
            src = batch.envelope.source
            stream = src.stream_key()
            self.state.mark(stream, src.node)
            alerts.append(self.state.alerts.observe(stream, src.node, res, group.now_ns, rec))
            refined.append((i, rec, batch, res))
        self.waves.submit(group, refined, alerts)

    def _align(self, group: Group, i: int, rec: RawRecord, batch: Batch) -> None:
        """An events or collectives record: dropped as a duplicate by its source's seq window,
        or its rows aligned by its stream's clock."""
        src = batch.envelope.source
        stream = src.stream_key()
        position = (rec.partition, rec.offset)
        st = self.state.refine
        window = st.seqs.get(src.key())
        if window is None:
            window = st.seqs[src.key()] = SeqWindow(window=self.settings.seq_window)
        self.state.mark(stream)
        if window.observe(batch.envelope.seq, position).is_duplicate:
            self.outputs.duplicate(group, i, rec, batch)
            return
        clock = st.clocks.get(stream)
        if clock is None:
            clock = st.clocks[stream] = ClockEstimator(self.settings.clock)
        arrival = rec.append_ms * 1_000_000 if self._log_append(rec) else None
        est = clock.observe(batch.envelope.sent_ns, arrival, batch.envelope.clock, rec.partition)
        table = align_records(batch, est, position, rec.topic)
        self.outputs.aligned(group, i, rec, batch, table, est)

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
