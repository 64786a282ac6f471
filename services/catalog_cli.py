"""``refinery catalog unmapped --topic T``: what a topic carries that the catalog lacks.

    refinery catalog unmapped --topic telemetry.ingest.influx [--format F] [--records N]

Reads the topic from its beginning (at most ``--records`` records, or until it has been idle
for ``--idle`` seconds), decodes each record as the worker would (the topic's format from
``deploy/topics.yaml``, or ``--format``) and prints each metric name the catalog and the
ingest mapping do not map, with its sample count and a device, most frequent first: the
names the refiner dead-letters as ``unknown_metric``: every one of them, however many.
Extend ``schemas/catalog/ingest/`` to map them. Records rejected whole are counted by why
(e.g. a producer without a host identity, with what it must set). Counters sent as floats
above 2**53 (not exact) are listed too, per metric. Exit 0 when it could read the topic
(whatever it found), 1 otherwise.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections import Counter
from typing import Any

from schemas.catalog import default_catalog
from schemas.codec import content_type_of
from schemas.errors import ConfigError, RejectedInput
from schemas.ingest import Format, IngestDecoder, Position
from schemas.ingest.assemble import INEXACT
from services.settings import RefinerySettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``catalog unmapped``."""
    parser = subparsers.add_parser("catalog", help="the metric catalog and its ingest mapping")
    group = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    group.required = True
    p = group.add_parser("unmapped", help="metric names a topic carries that the catalog lacks")
    p.add_argument("--topic", required=True, help="topic to read (an ingest topic or raw)")
    p.add_argument("--format", choices=[f.value for f in Format], help="override the spec's")
    p.add_argument("--records", type=int, default=10_000, help="records to read at most")
    p.add_argument("--idle", type=float, default=3.0, help="stop after this long idle, s")
    p.set_defaults(handler=cmd_catalog_unmapped)


def _format_of(topic: str, override: str | None) -> Format:
    if override:
        return Format(override)
    from services.topics import load_topic_specs

    for spec in load_topic_specs():
        if topic == spec.name or topic.endswith("." + spec.name):
            return spec.format
    return Format.REFINERY


def unmapped_names(
    records: Any, fmt: Format, topic: str, why: Counter[str] | None = None
) -> tuple[Counter[str], dict[str, str], int]:
    """(samples per unmapped name, a device of each, records undecodable) of ``records``:
    (value, headers, partition, offset, key) tuples. Every unmapped name is counted, none
    left out. ``why``, when given, counts the records rejected by reason and detail."""
    decoder = IngestDecoder({topic: fmt})
    catalog = default_catalog()
    counts: Counter[str] = Counter()
    devices: dict[str, str] = {}
    bad = 0
    for value, headers, partition, offset, key in records:
        try:
            batch = decoder.decode(topic, value, content_type_of(headers),
                                   Position(partition, offset, time.time_ns(), key))  # fmt: skip
        except RejectedInput as e:
            bad += 1
            if why is not None:
                why[f"{e.reason.value}: {e.detail}"[:400]] += 1
            continue
        for metric, device in zip(batch.table["metric"].to_pylist(),
                                  batch.table["device"].to_pylist(), strict=True):  # fmt: skip
            if metric not in catalog:
                counts[metric] += 1
                devices.setdefault(metric, device)
    return counts, devices, bad


def _read(settings: RefinerySettings, topic: str, limit: int, idle: float) -> list[Any]:
    from confluent_kafka import Consumer, TopicPartition

    from services.kafka.log import require_cluster

    conf = settings.kafka().librdkafka()
    require_cluster(conf)
    c = Consumer({**conf, "group.id": f"refinery-catalog-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})  # fmt: skip
    try:
        md = c.list_topics(topic, timeout=15).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            raise ConfigError(f"--topic {topic}: no such topic on the cluster")
        c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
        out: list[Any] = []
        last = time.monotonic()
        while len(out) < limit and time.monotonic() - last < idle:
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    out.append((m.value(), m.headers(), m.partition(), m.offset(), m.key()))
                    last = time.monotonic()
        return out[:limit]
    finally:
        c.close()


def cmd_catalog_unmapped(args: argparse.Namespace, settings: RefinerySettings) -> int:
    if args.records <= 0:
        raise ConfigError(f"--records {args.records}: expected a positive count")
    fmt = _format_of(args.topic, args.format)
    records = _read(settings, args.topic, args.records, args.idle)
    why: Counter[str] = Counter()
    counts, devices, bad = unmapped_names(records, fmt, args.topic, why)
    print(f"{args.topic} ({fmt.value}): {len(records)} records read, {bad} undecodable, "
          f"{len(counts)} names not in the catalog")  # fmt: skip
    for name, n in counts.most_common():
        print(f"{n:>10}  {name}  (e.g. device {devices[name]})")
    for detail, n in why.most_common():
        print(f"{n:>10}  records rejected: {detail}")
    for name, n in sorted(INEXACT.inexact.items()):
        print(f"{n:>10}  {name}  counter sent as a float above 2^53: not exact")
    return 0
