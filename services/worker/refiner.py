"""The refining chain of the worker, independent of Faust: raw Kafka records in, the messages
to publish out, state changes recorded for the next checkpoint.

:class:`Refiner` only wires the chain, arroyo's way (a small step interface, each step
submitting to the next); a record goes forward through it and never comes back here:

1. :class:`~services.worker.decoding.DecodeStep` decodes it (either wire encoding, or an
   ingest topic's format); a record rejected or replayed goes straight to the outputs step;
2. :class:`~services.worker.refining.RefineStep` refines it, guarded (samples through
   :func:`pipelines.refine.refine_group`, events and collectives through
   :func:`pipelines.refine.aligned.align_records`); the one step that changes the state;
3. :class:`~services.worker.waves.WaveStep` writes the refined messages of a group's samples
   records (one per run of a node's rows of a wave, its ``lineage`` header naming each record);
4. :class:`~services.worker.outcomes.OutputsStep` builds each record's
   :class:`~services.worker.refiner_outputs.Outcome`: refined, aligned, dead-letter,
   accounting and alert messages.

The group runner (:mod:`services.worker.groups`) takes the outcomes on to the dead-letter
limit, the output producer and the checkpoint (:mod:`services.worker.checkpoint`), which
commits last. Every input record produces exactly one accounting message (outcome
``refined``, ``duplicate``, ``replay`` or ``deadletter``) so the invariant
``input = refined + deduplicated + quarantined`` can be checked per raw partition.

State is one object, :class:`~services.worker.refiner_state.RefinerState`: loaded lazily per
stream and node through the ``load_stream``/``load_node`` callables (the Faust tables),
written back by the checkpoint from :meth:`Refiner.dirty_blobs`, and put back as it was when
an attempt at refining raises (:mod:`services.worker.refining`).
"""

from __future__ import annotations

from collections.abc import Callable

from pipelines.refine.enrich import TopologyIndex
from pipelines.refine.types import RefineSettings
from schemas.catalog import Catalog
from schemas.ingest import IngestDecoder
from schemas.topics import Topics
from services.worker.decoding import DecodeStep
from services.worker.outcomes import OutputsStep
from services.worker.refiner_outputs import Outcome, OutputLimits, RawRecord
from services.worker.refiner_state import RefinerState
from services.worker.refining import RefineStep
from services.worker.waves import WaveStep

__all__ = ["Outcome", "OutputLimits", "RawRecord", "Refiner"]


class Refiner:
    """The refining chain of one agent, wired (see the module). Not thread-safe; one per
    agent. ``topics``: the catalog its outputs go to; ``ingest``: the decoder of the topics
    of foreign formats (None: native only); ``limits``: the largest outputs (default
    :class:`OutputLimits`)."""

    def __init__(
        self,
        catalog: Catalog,
        topics: Topics,
        topology: Callable[[], TopologyIndex],
        load_stream: Callable[[str], bytes | None],
        load_node: Callable[[str], bytes | None],
        settings: RefineSettings | None = None,
        ingest: IngestDecoder | None = None,
        limits: OutputLimits | None = None,
    ) -> None:
        self.catalog = catalog
        self.topics = topics
        self.limits = limits or OutputLimits()
        self.settings = settings or RefineSettings(seq_window=512)
        # everything it remembers, in one object (the checkpoints write it to the tables)
        self.state = RefinerState(topics.alerts, self.settings.clock, load_stream, load_node)
        outputs = OutputsStep(topics, self.limits)
        waves = WaveStep(topics, outputs, self.limits)
        refine = RefineStep(catalog, topology, self.settings, self.state, waves, outputs)
        self.decode = DecodeStep(ingest, self.state, refine, outputs)  # the chain's first step

    def forget(self) -> None:
        """Drop in-memory state (partitions were revoked); it reloads from the tables."""
        self.state.forget()

    def dirty_blobs(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(stream key → blob, node → blob) changed since the last call."""
        return self.state.dirty_blobs()

    def process(self, rec: RawRecord, now_ns: int) -> Outcome:
        """Everything one raw record turns into. Raises only on a bug."""
        return self.decode.submit([rec], now_ns)[0]

    def process_group(self, recs: list[RawRecord], now_ns: int) -> list[Outcome]:
        """What each record turns into, in order: the same outcomes and state as
        :meth:`process` on each in turn, with the samples records refined together
        (:func:`pipelines.refine.refine_group`). The refined rows of one node's batches of a
        wave go out as one refined message (one IPC stream to write, and to read for every
        consumer, instead of one per raw record), listed in the outcome of the last of them;
        its ``lineage`` header names each record. Raises only on a bug."""
        return self.decode.submit(recs, now_ns)
