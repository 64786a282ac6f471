"""``refinery worker grow``: raise telemetry.raw's partitions with the worker group's state
(:mod:`services.worker.grow`; docs/operations.md, "Scaling")."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from schemas.errors import ConfigError
from schemas.topics import TOPICS
from services.settings import RefinerySettings
from services.worker.growth_plan import PARTITIONERS, RAW_TABLES


def add_grow(sub: Any) -> None:
    from services.worker.clock_flags import add_clock_flags

    p = sub.add_parser(
        "grow",
        help="raise telemetry.raw's partitions keeping the group's state (workers stopped)",
        description="With every worker of --app-id stopped: raise telemetry.raw (and the "
        "ingest topics refined with it) and the worker's state topics to --partitions, wait "
        "until the producers send to the new partitions, refine what the group left on the "
        "old ones, move each source's state (dedupe window, counters, clock) to its node's "
        "new partition and commit. Run it again after a failure: it resumes. Give it the "
        "worker's clock flags.",
    )
    p.add_argument("--partitions", type=int, required=True, help="the new partition count")
    p.add_argument("--app-id", default="refinery-worker", help="consumer group / app id")
    p.add_argument("--topic-prefix", default="", help="prefix of every topic name (tests)")
    p.add_argument(
        "--partitioner",
        choices=PARTITIONERS,
        default="consistent_random",
        help="the raw topic's producers' partitioner: consistent_random (CRC-32, librdkafka's "
        "default, Refinery's exporters) or murmur2_random (the Java client, aiokafka)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=330.0,
        help="the longest wait for producers to send to the new partitions (default 330 s: "
        "librdkafka refreshes a topic's metadata every 300 s)",
    )
    p.add_argument(
        "--quiet-s",
        type=float,
        default=15.0,
        help="moved when no record went to a partition its key left for this long (and every "
        "moving node was seen on its new one); longer than the sources' interval",
    )
    p.add_argument("--ingest", action="append", default=[], metavar="TOPIC=FORMAT",
                   help="an ingest topic given to the workers with --ingest")  # fmt: skip
    add_clock_flags(p)
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(handler=run)


def _ingest(
    conf: dict[str, Any], app_id: str, prefix: str, extra: list[str]
) -> tuple[tuple[str, str], ...]:
    """(topic, format) of the ingest topics whose partitions follow the state: declared in
    deploy/topics.yaml or given as ``TOPIC=FORMAT``, with the state's partition count (that of
    the raw topic when there is no state yet)."""
    from confluent_kafka.admin import AdminClient

    from services.topics import load_topic_specs

    md = AdminClient({**conf, "log_level": 3}).list_topics(timeout=15)
    state = md.topics.get(f"{app_id}-{RAW_TABLES[0]}-changelog")
    ref = state if state is not None else md.topics.get(TOPICS.with_prefix(prefix).raw)
    want = len(ref.partitions) if ref is not None else None
    formats = {s.name: s.format.value for s in load_topic_specs(prefix=prefix)
               if s.format != "refinery"}  # fmt: skip
    for item in extra:
        topic, _, fmt = item.partition("=")
        if not topic or not fmt:
            raise ConfigError(f"--ingest {item!r}: expected TOPIC=FORMAT")
        formats[prefix + topic] = fmt
    return tuple((t, f) for t, f in sorted(formats.items())
                 if t in md.topics and len(md.topics[t].partitions) == want)  # fmt: skip


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.kafka.log import require_cluster
    from services.worker.clock_flags import refine_settings
    from services.worker.grow import GrowConfig, grow

    logging.basicConfig(level=args.loglevel.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    kafka = settings.kafka()
    conf = kafka.librdkafka()
    require_cluster(conf)
    if args.partitions < 1:
        raise ConfigError(f"--partitions {args.partitions}: expected at least 1")
    pre = args.topic_prefix
    cat = TOPICS.with_prefix(pre)
    ingest = _ingest(conf, args.app_id, pre, args.ingest)
    cfg = GrowConfig(
        app_id=args.app_id,
        topics=cat,
        ingest=ingest,
        partitions=args.partitions,
        refine=refine_settings(args, ingest, pre),
        partitioner=args.partitioner,
        settle_s=args.settle_s,
        quiet_s=args.quiet_s,
    )
    rep = grow(kafka, cfg, lambda line: print(f"grow: {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rep.__dict__, sort_keys=True))
    return 0
