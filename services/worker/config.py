"""What the refining worker is configured with: the topic catalog it reads and writes, the
ingest topics it refines with raw, and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipelines.refine.types import RefineSettings
from schemas.topics import TOPICS, Topics
from services.worker.guard import DeadLetterLimit
from services.worker.refiner_outputs import OutputLimits


@dataclass(frozen=True)
class WorkerConfig:
    app_id: str = "refinery-worker"
    topics: Topics = TOPICS  # the catalog, with the deployment's prefix (schemas.topics)
    # ingest topics of foreign formats, (topic, format) (schemas.ingest): refined with raw
    ingest: tuple[tuple[str, str], ...] = ()
    limits: OutputLimits = field(default_factory=OutputLimits)  # the largest outputs
    raw_partitions: int = 8
    record_partitions: int = 4  # events and collectives (co-partitioned)
    replication_factor: int = 1
    data_dir: Path = Path(".refinery/worker")
    web_port: int | None = 6066
    web_host: str = "127.0.0.1"  # /health's bind address (a pod's IP where probes call it)
    # A group's outputs are acknowledged and its state checkpointed once: a large group
    # under backlog writes each stream's state once for several of its batches. It yields
    # to the event loop between chunks (heartbeats run in the consumer's own thread).
    take_max: int = 600
    take_within_s: float = 0.05
    # The state of a stream is megabytes a second under backlog (every series' counter
    # state, rewritten for each group): written at most this often, the groups between two
    # checkpoints are acked together with the later one, and a crash replays up to this
    # much more input. 0: every group (the offsets commit every broker_commit_interval, 1 s).
    checkpoint_every_s: float = 1.0
    refine_chunk: int = 300  # records refined in one call (one vectorized pass per wave)
    stall_after_s: float = 30.0
    gc_settle_every_s: float = 600.0  # full garbage collections on this schedule (GcPacer)
    refine: RefineSettings = field(default_factory=lambda: RefineSettings(seq_window=512))
    # more of an agent's last records dead-lettered than this stops the worker (a bad deploy)
    dead_letters: DeadLetterLimit = field(default_factory=DeadLetterLimit)

    def inputs(self) -> set[str]:
        """The topics whose records the worker refines or aligns."""
        t = self.topics
        return {t.raw, t.events, t.collectives} | {name for name, _ in self.ingest}
