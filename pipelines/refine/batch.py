"""Compose the pure refining steps for one raw batch: dedupe → clock → validate → overlap →
align → counters → enrich → :data:`~schemas.records.REFINED_SCHEMA`.

:func:`refine_batch` is the whole refining contract of one Kafka record; the Faust agent is
a shim that decodes, calls it, and produces the outputs. Accounting invariant, always:
``input == refined + duplicate + quarantined`` (asserted on every call).

State (:class:`RefineState`) is plain dicts of small objects keyed the way the Faust tables
are: transport seqs by source key (``node|exporter|instance|boot_id``), clocks, counters and
watermarks by stream key (``node|exporter|instance``), overlap by node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipelines.refine.clock import ClockEstimate, ClockEstimator, ClockSettings
from pipelines.refine.counters import (
    CounterLayout,
    CounterState,
)
from pipelines.refine.decode import StateDecoder
from pipelines.refine.dedupe import (
    OverlapState,
    Position,
    SeqOutcome,
    SeqWindow,
)
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.validate import (
    LayoutCache,
    RejectedRows,
    SharedLayouts,
    ValidateLimits,
)
from pipelines.refine.wave import DUPLICATE, REFINED, refine_wave
from schemas.catalog import Catalog
from schemas.records import REFINED_SCHEMA, RefinedHeader
from schemas.wire import Batch

__all__ = ["DUPLICATE", "REFINED", "Joined", "RawBatch", "RefineResult", "RefineSettings",
           "RefineState", "refine_batch", "refine_group"]  # fmt: skip


@dataclass(frozen=True)
class RefineSettings:
    limits: ValidateLimits = field(default_factory=ValidateLimits)
    clock: ClockSettings = field(default_factory=ClockSettings)
    clock_alert_ns: int = 1_000_000_000
    lateness_ns: int = 60_000_000_000  # behind the source's watermark by more → late
    seq_window: int = 4096
    # per ingest topic: the most a row waits between its stamp and its append, as declared
    # for its producer (deploy/topics.yaml ``send_delay``; ClockEstimator._declared)
    send_delay_max_ns: Mapping[str, int] = field(default_factory=dict)


@dataclass
class RefineState:
    seqs: dict[str, SeqWindow] = field(default_factory=dict)
    clocks: dict[str, ClockEstimator] = field(default_factory=dict)
    counters: dict[str, CounterState] = field(default_factory=dict)
    overlaps: dict[str, OverlapState] = field(default_factory=dict)
    watermarks: dict[str, int] = field(default_factory=dict)
    decoders: dict[int, StateDecoder] = field(default_factory=dict)  # by id(catalog)
    layouts: dict[str, LayoutCache] = field(default_factory=dict)  # caches, not state
    shared_layouts: SharedLayouts = field(default_factory=SharedLayouts)
    counter_layouts: dict[str, CounterLayout] = field(default_factory=dict)


@dataclass(frozen=True)
class RefineResult:
    dead_letters: list[RejectedRows]  # rows of the input batch, one reason per group
    outcome: str  # refined | duplicate
    seq_outcome: SeqOutcome
    input: int
    refined_count: int
    duplicate: int
    quarantined: int
    clock: ClockEstimate | None
    clock_alert: bool | None  # None: the bound proves neither (the alert stays as it was)
    # the refined rows of the whole wave this batch was refined in, and where its own start:
    # ``refined`` is ``wave_rows.slice(wave_start, refined_count)``. The batches of one node
    # in a wave are adjacent there, so a consumer can publish them as one slice.
    wave_rows: pa.Table | None = None
    wave_start: int = 0
    newest_ns: int | None = None  # the latest aligned ts of ``refined`` (None: no rows)

    @property
    def refined(self) -> pa.Table:
        """This batch's refined rows (REFINED_SCHEMA). Sliced when asked for: a slice of the
        wave's 35 columns costs ~14 µs, and the worker publishes a node's rows of a wave as
        one slice instead (``wave_rows``)."""
        if self.wave_rows is None:
            return REFINED_SCHEMA.empty_table()
        return self.wave_rows.slice(self.wave_start, self.refined_count)

    def header(self, raw_topic: str, batch: Batch, position: Position) -> RefinedHeader:
        return RefinedHeader(**self.header_fields(raw_topic, batch, position))

    def header_fields(self, raw_topic: str, batch: Batch, position: Position) -> dict[str, Any]:
        """The fields of :meth:`header` as a plain dict, for a caller that only serializes
        them (every value is already a checked int or a validated envelope string: building
        and dumping the model per raw record took ~5 µs)."""
        src = batch.envelope.source
        return {
            "raw_topic": raw_topic,
            "raw_partition": position[0],
            "raw_offset": position[1],
            "node": src.node,
            "exporter": src.exporter,
            "instance": src.instance,
            "boot_id": src.boot_id,
            "seq": batch.envelope.seq,
            "input_samples": self.input,
            "refined_samples": self.refined_count,
            "duplicate_samples": self.duplicate,
            "quarantined_samples": self.quarantined,
            "outcome": self.outcome,
        }


@dataclass(frozen=True)
class RawBatch:
    """One decoded samples batch to refine: read from ``topic`` at ``position`` (partition,
    offset), appended by the broker at ``log_append_ns``."""

    batch: Batch
    position: Position
    log_append_ns: int
    # False: ``log_append_ns`` is the producer's CreateTime; no clock is aligned on it
    log_append: bool = True
    # the raw topic (telemetry.raw or an ingest topic: each has positions of its own); None:
    # not told, the rows' raw_topic is NULL (read as telemetry.raw)
    topic: str | None = None
    # the set of records of one source decoded together this batch is one of (None: alone)
    joined: Joined | None = None


@dataclass(frozen=True, eq=False)
class Joined:
    """Consecutive records of one source decoded together (an ingest topic's messages,
    :meth:`schemas.ingest.IngestDecoder.decode_many`): each one's batch is the next slice of
    ``table`` (``members`` batches in all). :func:`refine_group` refines such batches,
    adjacent in its items, as one unit of their wave: one validation layout, overlap check,
    counter pass and enrichment for all, each batch keeping its seq, clock estimate and
    accounting; the results are those of refining them one after the other."""

    table: pa.Table
    members: int


def refine_batch(
    batch: Batch,
    position: Position,
    log_append_ns: int,
    state: RefineState,
    catalog: Catalog,
    topology: TopologyIndex,
    now_ns: int,
    settings: RefineSettings = RefineSettings(),
    topic: str | None = None,
) -> RefineResult:
    """Refine one decoded samples batch read from ``topic`` at ``position`` (partition,
    offset) with broker append time ``log_append_ns``. Updates ``state`` in place; never does
    I/O; raises only on a bug (the accounting assertion). Same as :func:`refine_group` of one
    batch."""
    item = RawBatch(batch, position, log_append_ns, topic=topic)
    return refine_group([item], state, catalog, topology, now_ns, settings)[0]


def refine_group(
    items: list[RawBatch],
    state: RefineState,
    catalog: Catalog,
    topology: TopologyIndex,
    now_ns: int,
    settings: RefineSettings = RefineSettings(),
) -> list[RefineResult]:
    """Refine several batches at once; the results (one per item, in order) and the final
    state are exactly those of calling :func:`refine_batch` on each in turn.

    The batches are cut into *waves*, runs of consecutive batches in which no source stream
    appears twice, but for the batches of one :class:`Joined` set, which share their unit
    of the wave (:mod:`pipelines.refine.wave`). The per-stream steps that are cheap in
    Python (transport seq, clock estimate, watermark) run per batch in order; the row work
    of a wave (validation, alignment, decoding, assembling the refined rows) runs once over
    all its rows, so the number of Arrow calls grows with waves, not with batches."""
    results: list[RefineResult] = []
    wave: list[list[RawBatch]] = []
    streams: set[str] = set()
    for item in items:
        if item.joined is not None and wave and wave[-1][-1].joined is item.joined:
            wave[-1].append(item)  # the next batch of a joined set: its unit
            continue
        stream = item.batch.envelope.source.stream_key()
        if stream in streams:
            results += refine_wave(wave, state, catalog, topology, now_ns, settings)
            wave, streams = [], set()
        wave.append([item])
        streams.add(stream)
    if wave:
        results += refine_wave(wave, state, catalog, topology, now_ns, settings)
    return results
