"""Records Refinery produces or keeps: refined samples (with lineage), dead letters,
topology entities and job placements (versioned), alerts and episodes.

Topic → record type, one each:

=====================  ============================================================
telemetry.refined      Arrow IPC of :data:`REFINED_SCHEMA`, header ``lineage``: a JSON list of
                       :class:`RefinedHeader`, one per raw record whose rows it holds
telemetry.deadletter   JSON :class:`DeadLetter`
topology               JSON :class:`TopologyEntity` (key: entity id, compacted)
jobs                   JSON :class:`JobPlacement` (key: job id, compacted)
telemetry.alerts       JSON :class:`Alert`
telemetry.episodes     JSON :class:`Episode`
telemetry.rollups      Arrow IPC of :data:`ROLLUP_SCHEMA`
=====================  ============================================================
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from schemas.reasons import Reason

# --- refined samples ------------------------------------------------------------------------

REFINED_SCHEMA = pa.schema(
    [
        # identity
        pa.field("node", pa.string(), nullable=False),
        pa.field("device", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),  # canonical catalog name
        pa.field("unit", pa.string(), nullable=False),
        # time
        pa.field("ts", pa.int64(), nullable=False),  # aligned, ns since epoch (common clock)
        pa.field("ts_source", pa.int64(), nullable=False),  # as the source stamped it
        pa.field("clock_offset_ns", pa.int64(), nullable=False),  # applied: ts = ts_source - off
        pa.field("clock_error_ns", pa.int64(), nullable=False),  # bound on |ts - true|
        # what the bound rests on: "exchange" (the producer's exchanges with the broker: holds
        # by construction), "assumed" (a minimum one-way delay is assumed), "create_time" (the
        # record had no broker append time: not aligned on it); docs/clock.md
        pa.field("clock_basis", pa.string()),
        # value
        pa.field("value", pa.float64()),  # gauge in unit; counter: cumulative in unit
        pa.field("raw", pa.uint64()),  # counters: raw reading as received
        pa.field("delta", pa.float64()),  # counters: increase since previous sample, in unit
        pa.field("rate", pa.float64()),  # counters: delta per second of the source's own clock
        pa.field("null_reason", pa.string()),  # why value/delta is NULL (NullReason)
        pa.field("reset", pa.bool_(), nullable=False),  # counter reset assumed here
        pa.field("late", pa.bool_(), nullable=False),  # arrived after its window was closed
        pa.field("decoded", pa.string()),  # bitmask/enum: names, comma-separated
        # enrichment
        pa.field("rack", pa.string()),
        pa.field("pod", pa.string()),
        pa.field("leaf", pa.string()),
        pa.field("leaf_port", pa.string()),
        pa.field("spine", pa.string()),
        pa.field("rail", pa.int32()),
        pa.field("nic", pa.string()),  # NIC affine to this GPU (or the NIC itself)
        pa.field("gpu", pa.string()),  # GPU affine to this NIC (or the GPU itself)
        pa.field("numa", pa.int32()),
        pa.field("nvlink_domain", pa.string()),
        pa.field("job", pa.string()),
        pa.field("rank", pa.int32()),
        pa.field("enrich_reason", pa.string()),  # why a join is missing (EnrichReason)
        # lineage
        pa.field("exporter", pa.string(), nullable=False),
        pa.field("instance", pa.string(), nullable=False),
        pa.field("boot_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("raw_partition", pa.int32(), nullable=False),
        pa.field("raw_offset", pa.int64(), nullable=False),
        # the topic of that partition and offset: telemetry.raw or an ingest topic, each with
        # positions of its own. NULL in rows written before it was carried: telemetry.raw
        pa.field("raw_topic", pa.string()),
    ]
)


class EnrichReason(StrEnum):
    NO_TOPOLOGY_FOR_NODE = "no_topology_for_node"
    NO_TOPOLOGY_AT_TIME = "no_topology_at_time"
    NO_DEVICE_MAPPING = "no_device_mapping"  # node known, device not (e.g. cpu12 has no rail)
    NOT_A_FABRIC_DEVICE = "not_a_fabric_device"  # cpu, memory: no rail by nature
    NO_JOB = "no_job"  # device idle at that time


class RefinedHeader(BaseModel):
    """Where the rows of one raw record in a refined message came from. A refined message
    holds the rows of one node's raw records refined together (one or several, in raw order)
    and its ``lineage`` header lists one of these per record (:func:`refined_lineage`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    raw_topic: str
    raw_partition: int
    raw_offset: int
    node: str
    exporter: str
    instance: str
    boot_id: str
    seq: int
    input_samples: int = Field(ge=0)
    refined_samples: int = Field(ge=0)
    duplicate_samples: int = Field(ge=0)
    quarantined_samples: int = Field(ge=0)
    outcome: str  # refined | duplicate


# one encoder for compact JSON: ``json.dumps`` with separators builds a new one per call
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def compact_json(doc: Any) -> bytes:
    """``json.dumps(doc, separators=(",", ":")).encode()``, the same bytes, ~4 µs sooner."""
    return _COMPACT.encode(doc).encode()


def lineage_header(entries: list[dict[str, Any]]) -> bytes:
    """The ``lineage`` header value of a refined message: its records' :class:`RefinedHeader`
    fields, in order."""
    return compact_json(entries)


def refined_lineage(headers: Any) -> list[dict[str, Any]]:
    """The :class:`RefinedHeader` fields of each raw record in a refined message, from its
    Kafka headers (a list of pairs or a dict); ``[]`` without a ``lineage`` header. A single
    object (one record per message, as earlier workers wrote) reads as a list of one."""
    items = headers.items() if isinstance(headers, dict) else headers or []
    for k, v in items:
        if k == "lineage" and v is not None:
            doc = json.loads(v)
            return doc if isinstance(doc, list) else [doc]
    return []


# --- dead letters ---------------------------------------------------------------------------


class DeadLetter(BaseModel):
    """A rejected record or the rejected samples of a batch, with the bytes to replay it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: Reason
    detail: str = Field(max_length=1024)
    topic: str
    partition: int
    offset: int
    node: str | None = None
    content_type: str | None = None
    scope: str = Field(description="record (whole message) or samples (some rows of it)")
    samples: int = Field(ge=0, description="input samples this dead letter accounts for")
    rows: list[int] = Field(default_factory=list, description="row indices when scope=samples")
    original_b64: str | None = Field(default=None, description="the message value, base64")
    ts_ns: int = Field(description="when the refiner rejected it (common clock)")


# --- topology and jobs ----------------------------------------------------------------------


class EntityKind(StrEnum):
    NODE = "node"  # host: rack, pod
    SWITCH = "switch"  # leaf or spine
    LINK = "link"  # host adapter port ↔ switch port, or switch ↔ switch
    NIC = "nic"  # host adapter: node, rail, numa, gpu affinity
    GPU = "gpu"  # node, numa, nvlink domain, nic affinity
    NETDEV = "netdev"  # network interface (eth2) → its RDMA device (nic) and port (attrs)


class TopologyEntity(BaseModel):
    """One versioned topology fact. ``id`` is stable across versions (compaction key);
    ``valid_from``/``valid_to`` bound when it held (ns, common clock; None = open)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(max_length=256)
    kind: EntityKind
    valid_from: int = 0
    valid_to: int | None = None
    node: str | None = None
    device: str | None = None  # gpu3, mlx5_0, mlx5_0/1
    rack: str | None = None
    pod: str | None = None
    switch: str | None = None  # for links: the switch end
    switch_port: str | None = None
    peer: str | None = None  # for switch links: the other switch
    role: str | None = None  # leaf | spine for switches
    rail: int | None = None
    numa: int | None = None
    nvlink_domain: str | None = None
    gpu: str | None = None  # NIC → affine GPU
    nic: str | None = None  # GPU → affine NIC
    guid: str | None = None
    attrs: dict[str, Any] = Field(default_factory=dict)
    source: str = Field(default="file", description="ibnetdiscover, nccl-topo, slurm, file, sim")


class RankPlacement(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0)
    node: str
    gpu: str


class JobPlacement(BaseModel):
    """A job and where its ranks ran. ``end_ns`` None while running."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: str = Field(max_length=128)
    start_ns: int
    end_ns: int | None = None
    user: str | None = None
    name: str | None = None
    nodes: list[str]
    ranks: list[RankPlacement] = Field(default_factory=list)


# --- derived streams ------------------------------------------------------------------------


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AlertState(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class Lineage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    partition: int
    offset_first: int
    offset_last: int


class Alert(BaseModel):
    """One lifecycle record of an alert. ``id`` is stable across its firing and resolved
    records and across replays, so consumers deduplicate on ``(id, state)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    rule: str
    state: AlertState
    severity: Severity
    entity: str  # node/device, switch/port, job, or source
    node: str | None = None
    device: str | None = None
    job: str | None = None
    starts_ns: int
    ends_ns: int | None = None
    summary: str
    cause: str | None = None  # cross-layer: the likely cause, or "none found"
    evidence: dict[str, Any] = Field(default_factory=dict)
    lineage: list[Lineage] = Field(default_factory=list)
    emitted_ns: int


class Episode(BaseModel):
    """A congestion or throttling episode on one port/priority or GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kind: str  # congestion | throttling
    state: AlertState
    entity: str
    start_ns: int
    end_ns: int | None = None
    peak: dict[str, float] = Field(default_factory=dict)
    ports: list[str] = Field(default_factory=list)
    nics: list[str] = Field(default_factory=list)
    nodes: list[str] = Field(default_factory=list)
    jobs: list[str] = Field(default_factory=list)
    cause_hint: str | None = None
    emitted_ns: int


ROLLUP_SCHEMA = pa.schema(
    [
        pa.field("window_s", pa.int32(), nullable=False),
        pa.field("window_start", pa.int64(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("device", pa.string(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("min", pa.float64()),
        pa.field("max", pa.float64()),
        pa.field("mean", pa.float64()),
        pa.field("last", pa.float64()),
        pa.field("count", pa.int64(), nullable=False),
    ]
)
