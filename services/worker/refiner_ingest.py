"""The records of a group that come from ingest topics, decoded together.

The refiner hands every record of a foreign-format topic in its group to
:meth:`schemas.ingest.IngestDecoder.decode_many`, one call per topic partition: one-metric
messages (Telegraf's and collectd's shape) then cost one pass for all instead of a table
each. Each record gets its own batch (a slice of its source's table, ``seq`` its offset) or
its own rejection; the batches of one source share a :class:`~pipelines.refine.types.Joined`
set, which :func:`pipelines.refine.refine_group` refines as one unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.refine.types import Joined
from schemas.codec import content_type_of
from schemas.errors import RejectedInput
from schemas.ingest import Format, IngestDecoder, Message, Position
from schemas.reasons import Reason
from schemas.wire import Batch
from services.kafka.internals import refused_detail
from services.worker.refiner_outputs import RawRecord


@dataclass(frozen=True)
class Decoded:
    """A record's batch and the set it was decoded with (its first member leads it)."""

    batch: Batch
    joined: Joined
    first: int  # the index of the set's first record in the group
    members: list[int]  # the set's records, in order (read only from the first)


def decode_ingest(
    ingest: IngestDecoder | None, recs: list[RawRecord]
) -> dict[int, Decoded | RejectedInput]:
    """What each record of an ingest topic in ``recs`` decodes to, by its index; records
    of native topics are not in it."""
    if ingest is None:
        return {}
    by_tp: dict[tuple[str, int], list[int]] = {}
    out: dict[int, Decoded | RejectedInput] = {}
    for i, rec in enumerate(recs):
        if ingest.formats.get(rec.topic, Format.REFINERY) is Format.REFINERY:
            continue
        refused = refused_detail(rec.headers)
        if refused is not None:
            out[i] = RejectedInput(Reason.OVERSIZED, refused)
        else:
            by_tp.setdefault((rec.topic, rec.partition), []).append(i)
    for (topic, _), idx in by_tp.items():
        msgs: list[Message] = []
        for i in idx:
            r = recs[i]
            pos = Position(r.partition, r.offset, r.append_ms * 1_000_000, r.key)
            msgs.append((r.value, content_type_of(r.headers), pos))
        got = ingest.decode_many(topic, msgs)
        for k, e in got.rejected.items():
            out[idx[k]] = e
        positions = [m[2] for m in msgs]
        for unit in got.units:
            members = [idx[k] for k in unit.members]
            joined = Joined(unit.table, len(members))
            batches = unit.batches(positions)
            for i, b in zip(members, batches, strict=True):
                out[i] = Decoded(b, joined, members[0], members)
    return out
