"""``refinery worker``: run the refining Faust worker (several may join one group)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.errors import ConfigError
from schemas.topics import TOPICS

if TYPE_CHECKING:
    pass
from services.heap import keep_heap
from services.settings import RefinerySettings
from services.worker.clock_flags import (
    add_clock_flags,
    number_arg,
    refine_settings,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="run the refining worker (raw → refined, dead letters, accounting, clock alerts)",
        description="Run the Faust refining worker until SIGTERM/Ctrl-C. Several workers with "
        "the same --app-id share the partitions of the input topics.",
    )
    p.add_argument("--app-id", default="refinery-worker", help="consumer group / app id")
    p.add_argument("--topic-prefix", default="", help="prefix of every topic name (tests)")
    p.add_argument(
        "--raw-partitions",
        type=int,
        default=None,
        help="partitions of telemetry.raw (default: read from the cluster)",
    )
    p.add_argument("--web-port", type=int, default=6066, help="/health and /metrics (0: off)")
    p.add_argument(
        "--ingest",
        action="append",
        default=[],
        metavar="TOPIC=FORMAT",
        help="also refine TOPIC, of a foreign FORMAT (e.g. a collectd_counters topic); the "
        "ingest topics of deploy/topics.yaml are refined without it",
    )
    p.add_argument(
        "--web-host", default="127.0.0.1", help="/health's bind address (default 127.0.0.1)"
    )
    p.add_argument("--data-dir", help="worker state directory (default $REFINERY_HOME/worker)")
    add_clock_flags(p)
    p.add_argument(
        "--replication-factor",
        type=int,
        help="replication of the worker's own topics (table changelogs); "
        "default: that of the raw topic",
    )
    p.add_argument(
        "--take-within-ms",
        type=_within_ms,
        default=50.0,
        help="how long a group waits for more records when fewer than its maximum are there "
        "(default 50 ms): longer makes fewer, larger groups (less CPU per record), shorter "
        "answers sooner",
    )
    p.add_argument(
        "--checkpoint-ms",
        type=_checkpoint_ms,
        default=1000.0,
        help="how often the state is written at most (default 1000 ms); the records refined "
        "in between are committed with the next checkpoint, and a crash replays up to this "
        "much more input (0: every group)",
    )
    p.add_argument(
        "--max-deadletter-share",
        type=_share,
        default=0.5,
        help="stop the worker (exit 1, nothing committed past what it refined) when more than "
        "this share of an agent's last --deadletter-window records were dead-lettered: a bad "
        "deploy, not bad input (default 0.5; 1: never)",
    )
    p.add_argument(
        "--deadletter-window",
        type=_records,
        default=1000,
        help="how many of an agent's last records --max-deadletter-share is judged on "
        "(default 1000)",
    )
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(handler=run)
    from services.worker.grow_cli import add_grow

    add_grow(p.add_subparsers(dest="action", title="actions", metavar="{grow}"))


_within_ms = number_arg("milliseconds", "ms", 1.0, 10_000.0)
_checkpoint_ms = number_arg("milliseconds", "ms", 0.0, 10_000.0)
_share = number_arg("a share of records", "of the records", 0.01, 1.0)


def _records(text: str) -> int:
    """An argparse type: a number of records from 1 to 10,000,000, else one line saying so."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of records") from None
    if not 1 <= n <= 10_000_000:
        raise argparse.ArgumentTypeError(f"{text} records: expected 1 to 10000000")
    return n


def _partitions(conf: dict[str, Any], topic: str, default: int) -> int:
    return _shape(conf, topic, (default, 1))[0]


def _ingest_topics(
    conf: dict[str, Any], prefix: str, extra: list[str]
) -> tuple[tuple[str, str], ...]:
    """(topic, format) of the ingest topics declared in deploy/topics.yaml (a foreign
    format) that exist on the cluster with as many partitions as the raw topic: the worker
    refines them with it, its state co-partitioned. ``extra``: ``TOPIC=FORMAT`` more, which
    must exist so (ConfigError otherwise)."""
    from confluent_kafka.admin import AdminClient

    from schemas.ingest import Format
    from services.topics import load_topic_specs

    asked = {}
    for item in extra:
        topic, _, fmt = item.partition("=")
        if not topic or fmt not in {f.value for f in Format} - {"refinery"}:
            names = ", ".join(f.value for f in Format if f.value != "refinery")
            raise ConfigError(f"--ingest {item!r}: expected TOPIC=FORMAT, FORMAT one of {names}")
        asked[prefix + topic] = fmt
    specs = {
        s.name: s.format.value for s in load_topic_specs(prefix=prefix) if s.format != "refinery"
    }
    if not specs and not asked:
        return ()
    md = AdminClient({**conf, "log_level": 3}).list_topics(timeout=15)
    raw = md.topics.get(TOPICS.with_prefix(prefix).raw)
    want = len(raw.partitions) if raw is not None and raw.partitions else None

    def fits(name: str) -> bool:
        return name in md.topics and (want is None or len(md.topics[name].partitions) == want)

    for name in asked:
        if not fits(name):
            raise ConfigError(f"--ingest {name}: no such topic with {want} partitions (as raw)")
    return tuple((n, f) for n, f in {**specs, **asked}.items() if n in asked or fits(n))


def _use_uvloop() -> None:
    """uvloop's transports write large produce requests without asyncio's quadratic buffer
    copying (3.11 keeps unsent bytes in one bytearray and deletes from its front); the
    worker's event loop is its bottleneck, so it runs on uvloop when installed."""
    try:
        import uvloop
    except ImportError:
        return
    import asyncio

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _shape(conf: dict[str, Any], topic: str, default: tuple[int, int]) -> tuple[int, int]:
    """(partitions, replicas of partition 0) of ``topic``, or ``default`` if it is absent."""
    from confluent_kafka.admin import AdminClient

    md = AdminClient({**conf, "log_level": 3}).list_topics(topic, timeout=15)
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        return default
    first = t.partitions.get(0)
    return len(t.partitions), len(first.replicas) if first is not None else default[1]


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.cli_ports import require_free_port
    from services.kafka.group import run_worker
    from services.kafka.log import require_cluster
    from services.telemetry import ServiceTelemetry
    from services.worker.app import WorkerConfig, build_app
    from services.worker.guard import DeadLetterLimit
    from services.worker.preflight import check_partitions

    if args.web_port:  # taken: one line, exit 2, before Faust binds it in a traceback
        require_free_port(args.web_host, args.web_port)
    require_cluster(settings.kafka().librdkafka())  # first contact: one line, exit 1
    _use_uvloop()

    logging.basicConfig(
        level=args.loglevel.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    kafka = settings.kafka()
    pre = args.topic_prefix
    cat = TOPICS.with_prefix(pre)
    ingest = _ingest_topics(kafka.librdkafka(), pre, args.ingest)
    conf = kafka.librdkafka()
    cfg = WorkerConfig(
        app_id=args.app_id,
        topics=cat,
        ingest=ingest,
        raw_partitions=args.raw_partitions or _partitions(conf, cat.raw, 8),
        replication_factor=args.replication_factor or _shape(conf, cat.raw, (8, 1))[1],
        record_partitions=_partitions(conf, cat.events, 4),
        data_dir=Path(args.data_dir) if args.data_dir else settings.home / "worker",
        web_port=args.web_port or None,
        web_host=args.web_host,
        take_within_s=args.take_within_ms / 1000,
        checkpoint_every_s=args.checkpoint_ms / 1000,
        dead_letters=DeadLetterLimit(args.max_deadletter_share, args.deadletter_window),
        refine=refine_settings(args, ingest, pre),
    )
    check_partitions(conf, cfg.app_id, {"raw": cat.raw, "events": cat.events})
    telemetry = ServiceTelemetry("worker", otlp_endpoint=settings.otlp_endpoint)
    keep_heap()
    worker = build_app(kafka, cfg, telemetry)
    try:
        return run_worker(worker.app, loglevel=args.loglevel)
    finally:
        telemetry.shutdown()
