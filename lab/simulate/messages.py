"""What the simulation hands a publisher: :class:`Message` s grouped into :class:`Tick` s."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa

from schemas.codec import ARROW, ENVELOPE_KEY, encode
from schemas.reasons import Reason
from schemas.wire import PAYLOAD_SCHEMAS, Envelope


class Stream(StrEnum):
    RAW = "raw"
    EVENTS = "events"
    COLLECTIVES = "collectives"


class SendKind(StrEnum):
    BATCH = "batch"
    DUPLICATE = "duplicate"
    MALFORMED = "malformed"
    LATE = "late"


@dataclass(eq=False)
class Message:
    """One Kafka record to publish, with what the truth needs to know about it."""

    stream: Stream
    kind: SendKind
    key: bytes
    due_ns: int  # true time it reaches the broker
    sent_true_ns: int
    envelope: Envelope | None = None
    table: pa.Table | None = None
    content_type: str = ARROW
    body: bytes | None = None
    expected_reason: Reason | None = None
    samples: int = 0
    # source clock - true clock when the rows were stamped: one int, or an int64 Arrow array
    # of each row's where they differ (:func:`.inject.row_offsets`); Arrow and numpy
    # arithmetic take either
    offset_ns: int | pa.Array = 0
    bad: list[Reason] | None = None  # reasons of the last len(bad) rows
    extra: Any = None  # CollectiveTick or list[SimEvent], for the truth
    # a duplicate: the message it copies, whose bytes (its clock block's exchanges included,
    # set when it was sent: it is due first) it sends again
    original: Message | None = None

    @property
    def tag(self) -> str:
        """``node|exporter|instance|boot_id|seq`` (empty for a record without an envelope)."""
        e = self.envelope
        return f"{e.source.key()}|{e.seq}" if e is not None else ""

    def encode(self) -> tuple[str, bytes]:
        """The content type and value bytes to send (cached)."""
        if self.original is not None:
            self.content_type, self.body = self.original.encode()
        if self.body is None:
            assert self.envelope is not None and self.table is not None
            schema = PAYLOAD_SCHEMAS[self.envelope.kind]
            if self.table.schema.equals(schema):
                # the codec's wire format without its select/cast, which costs more than the
                # whole IPC write for tables that already conform (ours always do)
                meta = {ENVELOPE_KEY: self.envelope.model_dump_json(exclude_none=True).encode()}
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, schema.with_metadata(meta)) as w:
                    w.write_table(self.table)
                self.content_type, self.body = ARROW, sink.getvalue().to_pybytes()
            else:
                self.content_type, self.body = encode(self.envelope, self.table, ARROW)
        return self.content_type, self.body


@dataclass
class Tick:
    index: int
    t_ns: int
    messages: list[Message] = field(default_factory=list)
