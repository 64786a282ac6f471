"""Step 4 of ``refinery worker grow`` (:mod:`services.worker.grow`): refine the records the
group left on the old partitions, as the worker would, before the state moves.

The worker's own parts: the :class:`~services.worker.refiner.Refiner` (its state loaded from
the changelogs as read), the topology feed for the joins, the librdkafka output producer.
Records are refined in chunks as they are read, a source's records from before the raise
first: those that came to an old partition because it became their source's home
(:func:`~services.worker.growth_plan.phase_of` 1) wait until every other is refined. Not
thread-safe; one per run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from schemas.catalog import default_catalog
from schemas.ingest import IngestDecoder
from services.kafka.feed import TopologyFeed
from services.kafka.outputs import Delivery, OutMessage, OutputProducer
from services.settings import KafkaSettings
from services.worker.growth_plan import phase_of
from services.worker.records import confluent_record
from services.worker.refiner import RawRecord, Refiner

if TYPE_CHECKING:
    from pipelines.refine.types import RefineSettings
    from schemas.topics import Topics
    from services.worker.growth_plan import Partitioner

CHUNK = 300  # records refined in one call, as the worker's refine_chunk


class TailConfig(Protocol):
    """What the tail refiner reads of :class:`services.worker.grow.GrowConfig`."""

    @property
    def app_id(self) -> str: ...
    @property
    def ingest(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def topics(self) -> Topics: ...
    @property
    def refine(self) -> RefineSettings: ...
    @property
    def partitioner(self) -> Partitioner: ...


class TailRefiner:
    """Refines records handed to :meth:`add`; :meth:`finish` refines the held ones and waits
    for every output's acknowledgement (raising :class:`~services.kafka.outputs.OutputError`
    if one is refused); :meth:`close` stops its feed and producer."""

    def __init__(
        self,
        kafka: KafkaSettings,
        cfg: TailConfig,
        load_stream: Callable[[str], bytes | None],
        load_node: Callable[[str], bytes | None],
        n_old: int,
    ) -> None:
        from services.worker.app import TopologyView

        cat = default_catalog()
        self.n_old, self.partitioner = n_old, cfg.partitioner
        self.feed = TopologyFeed(kafka.librdkafka(), cfg.topics.topology, cfg.topics.jobs)
        self.feed.start()
        self.feed.wait_caught_up(60)
        view = TopologyView(self.feed)
        ingest = IngestDecoder(dict(cfg.ingest), cat) if cfg.ingest else None
        self.refiner = Refiner(
            cat, cfg.topics, view.index, load_stream, load_node, cfg.refine, ingest
        )
        self.outputs = OutputProducer(kafka, f"{cfg.app_id}-grow")
        self._now: list[RawRecord] = []
        self._later: list[RawRecord] = []
        self._sent: list[Delivery] = []
        self.records = 0
        self.outcomes: Counter[str] = Counter()

    async def add(self, message: Any) -> None:
        """A confluent-kafka message of an old partition, in its partition's order."""
        rec = confluent_record(message)
        if phase_of(rec.partition, rec.key, self.n_old, self.partitioner):
            self._later.append(rec)
            return
        self._now.append(rec)
        if len(self._now) >= CHUNK:
            await self._refine(self._now)
            self._now = []

    async def finish(self) -> None:
        await self._refine(self._now)
        self._now = []
        for lo in range(0, len(self._later), CHUNK):
            await self._refine(self._later[lo : lo + CHUNK])
        self._later = []
        await self.outputs.wait(self._sent)

    async def _refine(self, recs: list[RawRecord]) -> None:
        if not recs:
            return
        if self.feed.error is not None:
            raise RuntimeError(f"topology feed failed: {self.feed.error}")
        pending: list[OutMessage] = []
        for out in self.refiner.process_group(recs, time.time_ns()):
            self.outcomes[out.outcome] += 1
            pending += out.messages
        self.records += len(recs)
        self._sent.append(await self.outputs.enqueue(pending))

    def close(self) -> None:
        self.feed.stop()
        self.outputs.close()
