"""Foreign formats a site already publishes, decoded into the native batch.

A topic's format is data (``format:`` in ``deploy/topics.yaml``): producers such as
Telegraf and collectd send no headers. A ``content-type`` header, when present, must agree
with the topic's format (its parameters, ``; charset=utf-8``, ``; version=0.0.4``, are
ignored); on a native topic the header chooses the encoding as before.

================== ===================================== =================================
format             what produces it                      content types a header may say
================== ===================================== =================================
refinery           Refinery's exporters (native)         application/json, Arrow stream
otlp               OTel Collector Kafka exporter          application/x-protobuf, .../json
otlp_proto         ... ``encoding: otlp_proto``           application/x-protobuf
otlp_json          ... ``encoding: otlp_json``            application/json
influx             Telegraf Kafka output (line protocol)  text/plain, ...x-influxdb-line-protocol
prometheus         exposition text, pushed as is          text/plain, application/openmetrics-text
collectd           write_kafka JSON, StoreRates true      application/json
collectd_counters  write_kafka JSON, StoreRates false     application/json
================== ===================================== =================================

:class:`IngestDecoder` ``decode`` raises :class:`~schemas.errors.RejectedInput` and nothing
else for any bytes, like :func:`schemas.codec.decode`; every format ends in the same
:class:`~schemas.wire.Batch` (see :mod:`schemas.ingest.assemble` for the identity each
synthesizes and what it cannot guarantee).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from operator import itemgetter
from typing import cast

from schemas.catalog import Catalog, default_catalog
from schemas.codec import MAX_MESSAGE_BYTES, decode
from schemas.errors import RejectedInput
from schemas.ingest.assemble import Points, Position, assemble
from schemas.ingest.collectd import decode_collectd, decode_collectd_many
from schemas.ingest.influx import decode_influx, decode_influx_many
from schemas.ingest.many import Decoded, assemble_many
from schemas.ingest.mapping import Mapping as SeriesMapping
from schemas.ingest.mapping import load_mapping
from schemas.ingest.otlp import decode_otlp
from schemas.ingest.otlp_json import decode_otlp_json_many
from schemas.ingest.prom import decode_prometheus
from schemas.ingest.unit import Unit
from schemas.reasons import Reason
from schemas.wire import Batch

__all__ = ["Decoded", "Format", "IngestDecoder", "Message", "Position", "Unit", "media_type"]

Message = tuple[bytes | None, str | None, Position]  # value, content-type header, position


class Format(StrEnum):
    REFINERY = "refinery"
    OTLP = "otlp"
    OTLP_PROTO = "otlp_proto"
    OTLP_JSON = "otlp_json"
    INFLUX = "influx"
    PROMETHEUS = "prometheus"
    COLLECTD = "collectd"
    COLLECTD_COUNTERS = "collectd_counters"


PROTOBUF = "application/x-protobuf"
JSON = "application/json"
TEXT = "text/plain"
OPENMETRICS = "application/openmetrics-text"
LINE_PROTOCOL = "application/x-influxdb-line-protocol"

ACCEPTS: dict[Format, frozenset[str]] = {
    Format.OTLP: frozenset({PROTOBUF, JSON}),
    Format.OTLP_PROTO: frozenset({PROTOBUF}),
    Format.OTLP_JSON: frozenset({JSON}),
    Format.INFLUX: frozenset({TEXT, LINE_PROTOCOL}),
    Format.PROMETHEUS: frozenset({TEXT, OPENMETRICS}),
    Format.COLLECTD: frozenset({JSON}),
    Format.COLLECTD_COUNTERS: frozenset({JSON}),
}
FAMILY = {
    Format.OTLP: "otlp",
    Format.OTLP_PROTO: "otlp",
    Format.OTLP_JSON: "otlp",
    Format.INFLUX: "influx",
    Format.PROMETHEUS: "prometheus",
    Format.COLLECTD: "collectd",
    Format.COLLECTD_COUNTERS: "collectd",
}
EXPORTER = {"otlp": "otlp", "influx": "telegraf", "prometheus": "prometheus",
            "collectd": "collectd"}  # fmt: skip


def media_type(content_type: str | None) -> str | None:
    """``text/plain; version=0.0.4`` → ``text/plain``; None stays None."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


def _points(fmt: Format, body: bytes, media: str | None) -> Points:
    if fmt is Format.INFLUX:
        return decode_influx(body)
    if fmt is Format.PROMETHEUS:
        return decode_prometheus(body, openmetrics=media == OPENMETRICS)
    if fmt in (Format.COLLECTD, Format.COLLECTD_COUNTERS):
        return decode_collectd(body, store_rates=fmt is Format.COLLECTD)
    as_json = {Format.OTLP_JSON: True, Format.OTLP_PROTO: False}.get(fmt)
    if fmt is Format.OTLP and media is not None:
        as_json = media == JSON
    return decode_otlp(body, as_json)


class IngestDecoder:
    """Decodes a record by its topic's declared format (topics not listed are native)."""

    def __init__(
        self,
        formats: Mapping[str, Format | str],
        catalog: Catalog | None = None,
        mappings: Callable[[str], SeriesMapping] | None = None,
    ) -> None:
        self.formats = {t: Format(f) for t, f in formats.items()}
        cat = catalog or default_catalog()
        self._load = mappings or (lambda family: load_mapping(family, cat))
        self._mappings: dict[str, SeriesMapping] = {}

    def mapping(self, family: str) -> SeriesMapping:
        m = self._mappings.get(family)
        if m is None:
            m = self._mappings[family] = self._load(family)
        return m

    def decode(
        self, topic: str, body: bytes | None, content_type: str | None, pos: Position
    ) -> Batch:
        """The batch of one record; raises :class:`RejectedInput` and nothing else."""
        fmt = self.formats.get(topic, Format.REFINERY)
        media = media_type(content_type)
        if fmt is Format.REFINERY:
            return decode(body, media)
        body = _checked(topic, fmt, body, content_type)
        family = FAMILY[fmt]
        try:
            points = _points(fmt, body, media)
            return assemble(points, self.mapping(family), EXPORTER[family], pos)
        except RejectedInput:
            raise
        except Exception as e:  # any library error on hostile bytes is an undecodable record
            raise RejectedInput(Reason.UNDECODABLE, f"{type(e).__name__}: {e}"[:300]) from e

    def decode_many(self, topic: str, msgs: list[Message]) -> Decoded:
        """The records ``msgs`` of one foreign-format ``topic`` at once: one
        :class:`~schemas.ingest.many.Unit` per source, each message in one unit or rejected
        alone with its reason, exactly as :meth:`decode` would say of it. Line protocol,
        collectd and OTLP JSON are read in one pass for all; a set that pass cannot read
        is decoded message by message, as are Prometheus text and OTLP protobuf. Raises
        nothing."""
        fmt = self.formats.get(topic, Format.REFINERY)
        values = list(map(itemgetter(0), msgs))
        ok: Sequence[int]
        if _plain(msgs, values):  # no headers, every value within bounds: the common case
            ok = range(len(msgs))
            bodies = cast(list[bytes], values)
            media: set[str | None] = {None}
            rejected: dict[int, RejectedInput] = {}
        else:
            ok, bodies, rejected = _admitted(topic, fmt, msgs)
            media = {media_type(msgs[k][1]) for k in ok}
        got = None
        if len(ok) > 1:
            mine = msgs if len(ok) == len(msgs) else list(map(msgs.__getitem__, ok))
            pos = list(map(itemgetter(2), mine))
            got = self._joined(fmt, bodies, pos, media)
        if got is None:
            got = self._one_by_one(topic, [msgs[k] for k in ok])
        if len(ok) != len(msgs):
            for unit in got.units:
                unit.members = [ok[j] for j in unit.members]
        rejected.update({ok[j]: e for j, e in got.rejected.items()})
        return Decoded(got.units, rejected)

    def _joined(
        self, fmt: Format, bodies: list[bytes], pos: list[Position], media: set[str | None]
    ) -> Decoded | None:
        """The messages read in one pass (None: not this format, or the pass failed)."""
        family = FAMILY.get(fmt)
        boots = None
        try:
            if fmt is Format.INFLUX:
                points, msg, bad = decode_influx_many(bodies)
            elif fmt in (Format.COLLECTD, Format.COLLECTD_COUNTERS):
                points, msg, bad = decode_collectd_many(bodies, fmt is Format.COLLECTD)
            elif fmt in (Format.OTLP, Format.OTLP_JSON) and media <= {None, JSON}:
                points, msg, boots = decode_otlp_json_many(bodies)  # JSON ones only
                bad = {}
            else:
                return None
            assert family is not None
            mapping = self.mapping(family)
            return assemble_many(points, msg, mapping, EXPORTER[family], pos, bad, boots)
        except Exception:  # a value no number, a JSON block Arrow cannot read: one by one
            return None

    def _one_by_one(self, topic: str, msgs: list[Message]) -> Decoded:
        units: list[Unit] = []
        rejected: dict[int, RejectedInput] = {}
        for k, (body, ct, pos) in enumerate(msgs):
            try:
                b = self.decode(topic, body, ct, pos)
            except RejectedInput as e:
                rejected[k] = e
                continue
            env = b.envelope
            units.append(Unit(env.source, b.table, [k], [b.table.num_rows], [env.sent_ns]))
        return Decoded(units, rejected)


def _plain(msgs: list[Message], values: list[bytes | None]) -> bool:
    """Whether no message has a header and every value is within bounds."""
    if not msgs or any(map(itemgetter(1), msgs)):
        return False
    try:
        sizes = list(map(len, cast(list[bytes], values)))
    except TypeError:  # a message without a value
        return False
    return min(sizes) > 0 and max(sizes) <= MAX_MESSAGE_BYTES


def _admitted(
    topic: str, fmt: Format, msgs: list[Message]
) -> tuple[list[int], list[bytes], dict[int, RejectedInput]]:
    """The messages whose header and size allow them (their indices and values), and why
    each other one is rejected."""
    rejected: dict[int, RejectedInput] = {}
    bodies: list[bytes] = []
    ok: list[int] = []
    for k, (body, ct, _) in enumerate(msgs):
        try:
            bodies.append(_checked(topic, fmt, body, ct))
            ok.append(k)
        except RejectedInput as e:
            rejected[k] = e
    return ok, bodies, rejected


def _checked(topic: str, fmt: Format, body: bytes | None, content_type: str | None) -> bytes:
    """``body`` of a record of a foreign-format topic, if its header and size allow it."""
    media = media_type(content_type)
    if media is not None and media not in ACCEPTS[fmt]:
        raise RejectedInput(
            Reason.UNSUPPORTED_CONTENT_TYPE,
            f"topic {topic} carries {fmt.value}; content-type {content_type!r} disagrees",
        )
    if not body:
        raise RejectedInput(Reason.UNDECODABLE, "empty message value")
    if len(body) > MAX_MESSAGE_BYTES:
        raise RejectedInput(Reason.OVERSIZED, f"message of {len(body)} bytes")
    return body
