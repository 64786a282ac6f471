"""The raw wire contract: one Kafka message carries one batch from one source on one node.

A batch is an :class:`Envelope` (who sent it, in what order, when, how well its clock is
synced) plus a columnar payload. Three payload kinds share the envelope, one per topic:

=============  =====================  =========================================
payload kind   topic                  Arrow schema
=============  =====================  =========================================
``samples``    telemetry.raw          :data:`SAMPLES_SCHEMA`
``events``     telemetry.events       :data:`EVENTS_SCHEMA`
``collectives`` telemetry.collectives :data:`COLLECTIVES_SCHEMA`
=============  =====================  =========================================

Encodings (header ``content-type``) are in :mod:`schemas.codec`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, TypeVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})

# Bounds on strings in the envelope; samples have their own in pipelines.refine.validate.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class PayloadKind(StrEnum):
    SAMPLES = "samples"
    EVENTS = "events"
    COLLECTIVES = "collectives"


class SyncState(StrEnum):
    SYNCED = "synced"
    UNSYNCED = "unsynced"
    UNKNOWN = "unknown"


class ClockBlock(BaseModel):
    """The source's own view of its clock (chrony ``tracking`` or a PTP servo), and its
    producer's recent exchanges with the broker.

    Additive: fields added to it in later versions are ignored by this one (a block that
    names a field it does not know is not rejected), so exporters may be upgraded after the
    workers without their batches being dead-lettered."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    source: str = Field(max_length=32, description="chrony, ptp4l, phc2sys, bmc, none")
    offset_ns: int | None = Field(
        default=None, description="local clock minus reference, as the daemon reports it"
    )
    error_bound_ns: int | None = Field(default=None, ge=0)
    state: SyncState = SyncState.UNKNOWN
    stratum: int | None = Field(default=None, ge=0, le=16)
    reference: str | None = Field(default=None, max_length=128)
    exchanges: list[tuple[Int64, Int64, Int64, Int64]] | None = Field(
        default=None,
        max_length=8,
        description=(
            "recent acknowledged records of the source's producer on a LogAppendTime topic: "
            "[send ns (source clock, before produce), broker append time ms (the partition "
            "leader's clock, from the delivery report), ack ns (source clock, when the "
            "report arrived), partition]; they bound the offset source - broker to "
            "[send - append - 1 ms, ack - append] (see docs/clock.md)"
        ),
    )
    stamps_ns: tuple[Int64, Int64] | None = Field(
        default=None,
        description=(
            "the lowest and highest setting of the source's wall clock (wall - raw "
            "monotonic) the batch's rows were stamped on, less the setting at its send "
            "(ns, <= 0 and >= 0): its exchanges are carried widened by as much, and the "
            "bound from the batch's own append time is widened alike (docs/clock.md)"
        ),
    )


class SourceId(BaseModel):
    """A source's identity; ``seq`` is monotonic within one ``boot_id`` of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(pattern=NAME_PATTERN)
    exporter: str = Field(pattern=NAME_PATTERN)
    instance: str = Field(pattern=NAME_PATTERN)
    boot_id: str = Field(pattern=NAME_PATTERN)

    def key(self) -> str:
        """A stable string key for tables keyed by source."""
        return f"{self.node}|{self.exporter}|{self.instance}|{self.boot_id}"

    def stream_key(self) -> str:
        """Key of the source across boots (counters reset when ``boot_id`` changes)."""
        return f"{self.node}|{self.exporter}|{self.instance}"


class Envelope(BaseModel):
    """Batch header. ``sent_ns`` is the source's clock when the batch was handed to Kafka."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: PayloadKind = PayloadKind.SAMPLES
    source: SourceId
    seq: int = Field(ge=0)
    sent_ns: int = Field(ge=0)
    interval_ns: int | None = Field(default=None, ge=0, description="scrape interval, if periodic")
    clock: ClockBlock | None = None


# --- payload schemas ------------------------------------------------------------------------

SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("ts_ns", pa.int64(), nullable=False),  # source clock, ns since the epoch
        pa.field("metric", pa.string(), nullable=False),  # catalog name or alias
        pa.field("device", pa.string(), nullable=False),  # gpu3, mlx5_0/1, mlx5_0/1/prio3, cpu12
        pa.field("value", pa.float64()),  # the reading (gauges) or raw as float (counters)
        pa.field("raw", pa.uint64()),  # counters: the raw cumulative reading, exact
        pa.field("text", pa.string()),  # a non-numeric reading as read ("N/A (no PMA)")
    ]
)

EVENTS_SCHEMA = pa.schema(
    [
        pa.field("ts_ns", pa.int64(), nullable=False),
        pa.field("event", pa.string(), nullable=False),  # xid, link_down, link_up, throttle, sel
        pa.field("device", pa.string(), nullable=False),
        pa.field("code", pa.int64()),  # XID number, SEL code, new bitmask value
        pa.field("severity", pa.string()),
        pa.field("message", pa.string()),  # the original line or text
        pa.field("attrs", pa.string()),  # JSON object of extra fields (pid, pci bus id, ...)
    ]
)

COLLECTIVES_SCHEMA = pa.schema(
    [
        pa.field("ts_ns", pa.int64(), nullable=False),  # this rank's start (arrival)
        pa.field("end_ns", pa.int64()),
        pa.field("job", pa.string(), nullable=False),
        pa.field("comm", pa.string(), nullable=False),  # communicator id / hash
        pa.field("op", pa.string(), nullable=False),  # AllReduce, AllGather, ...
        pa.field("op_seq", pa.int64(), nullable=False),  # instance number within comm
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("nranks", pa.int32(), nullable=False),
        pa.field("device", pa.string(), nullable=False),  # gpuN on this node
        pa.field("bytes", pa.int64()),
        pa.field("dtype", pa.string()),
        pa.field("algbw_gbps", pa.float64()),  # GB/s as nccl-tests prints it
        pa.field("busbw_gbps", pa.float64()),
    ]
)

PAYLOAD_SCHEMAS: dict[PayloadKind, pa.Schema] = {
    PayloadKind.SAMPLES: SAMPLES_SCHEMA,
    PayloadKind.EVENTS: EVENTS_SCHEMA,
    PayloadKind.COLLECTIVES: COLLECTIVES_SCHEMA,
}


class Batch(BaseModel):
    """A decoded batch: envelope plus an Arrow table conforming to its payload schema."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    envelope: Envelope
    table: pa.Table


_Model = TypeVar("_Model", bound=BaseModel)


def constructed_like(template: _Model, changes: dict[str, object]) -> _Model:
    """What ``type(template).model_construct`` makes of the template's fields with
    ``changes`` (each a field it was constructed with): its state copied, not built anew.
    ``model_construct`` walks every field of the model per call (~4 µs an envelope or batch,
    two per one-metric message); this takes a dict copy."""
    out = object.__new__(type(template))
    state = dict(template.__dict__)
    state.update(changes)
    object.__setattr__(out, "__dict__", state)
    object.__setattr__(out, "__pydantic_fields_set__", set(template.__pydantic_fields_set__))
    object.__setattr__(out, "__pydantic_extra__", template.__pydantic_extra__)
    object.__setattr__(out, "__pydantic_private__", template.__pydantic_private__)
    return out
