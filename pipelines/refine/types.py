"""The types of refining, at the bottom of :mod:`pipelines.refine`: what a batch to refine
is (:class:`RawBatch`, :class:`Joined`), what refining is told (:class:`RefineSettings`), keeps
(:class:`RefineState`) and gives back (:class:`RefineResult`). The orchestrator
(:mod:`pipelines.refine.batch`), the wave (:mod:`pipelines.refine.wave`) and the worker import
them from here; this module imports neither.

State (:class:`RefineState`) is plain dicts of small objects keyed the way the Faust tables
are: transport seqs by source key (``node|exporter|instance|boot_id``), clocks, counters and
watermarks by stream key (``node|exporter|instance``), overlap by node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipelines.refine.clock import ClockEstimate, ClockEstimator, ClockSettings, DeclaredTiming
from pipelines.refine.counters import CounterLayout, CounterState
from pipelines.refine.decode import StateDecoder
from pipelines.refine.dedupe import OverlapState, Position, SeqOutcome, SeqWindow
from pipelines.refine.validate import LayoutCache, RejectedRows, SharedLayouts, ValidateLimits
from schemas.records import REFINED_SCHEMA, RefinedHeader
from schemas.wire import Batch

__all__ = ["DUPLICATE", "REFINED", "Joined", "RawBatch", "RefineResult", "RefineSettings",
           "RefineState"]  # fmt: skip

REFINED = "refined"
DUPLICATE = "duplicate"


@dataclass(frozen=True)
class RefineSettings:
    limits: ValidateLimits = field(default_factory=ValidateLimits)
    clock: ClockSettings = field(default_factory=ClockSettings)
    clock_alert_ns: int = 1_000_000_000
    lateness_ns: int = 60_000_000_000  # behind the source's watermark by more → late
    seq_window: int = 4096
    # per ingest topic: what it declares of its producer's timing (deploy/topics.yaml
    # ``send_delay``, ``clock_error``; ClockEstimator._declared)
    declared: Mapping[str, DeclaredTiming] = field(default_factory=dict)


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
