"""Compose the pure refining steps for one raw batch: dedupe → clock → validate → overlap →
align → counters → enrich → :data:`~schemas.records.REFINED_SCHEMA`.

:func:`refine_batch` is the whole refining contract of one Kafka record; the Faust agent is
a shim that decodes, calls it, and produces the outputs. Accounting invariant, always:
``input == refined + duplicate + quarantined`` (asserted on every call).

Its types (:class:`RefineState`, :class:`RefineResult`, ...) sit below it, in
:mod:`pipelines.refine.types`, for the wave and the worker to import without this module;
they are importable from here too.
"""

from __future__ import annotations

from pipelines.refine.dedupe import Position
from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import (
    DUPLICATE,
    REFINED,
    Joined,
    RawBatch,
    RefineResult,
    RefineSettings,
    RefineState,
)
from pipelines.refine.wave import refine_wave
from schemas.catalog import Catalog
from schemas.wire import Batch

__all__ = ["DUPLICATE", "REFINED", "Joined", "RawBatch", "RefineResult", "RefineSettings",
           "RefineState", "refine_batch", "refine_group"]  # fmt: skip


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
