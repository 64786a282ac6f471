"""``refinery detect``: rules, episodes, stragglers and rollups over refined data."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.topics import TOPICS
from services.heap import keep_heap
from services.settings import RefinerySettings

if TYPE_CHECKING:
    from schemas.topics import Topics
    from services.detect.detector import Detector
    from services.telemetry import ServiceTelemetry


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "detect",
        help="derived streams: alerts, episodes with causes, rollups",
        description="Consume telemetry.refined and the aligned events/collectives, evaluate the "
        "rules, publish telemetry.alerts, telemetry.episodes and telemetry.rollups. Replicas "
        "with one --group share the partitions; a job's stragglers are judged by the owner of "
        "its collectives on every replica's progress. Stops on SIGTERM/Ctrl-C (exit 0).",
    )
    p.add_argument("--rules", help="rule file (default deploy/rules/default.yaml)")
    p.add_argument("--topic-prefix", default="", help="prefix of every topic name (tests)")
    p.add_argument("--group", default="refinery-detect")
    p.add_argument(
        "--lookback",
        type=float,
        default=600.0,
        help="seconds replayed without publishing on start (state warm-up)",
    )
    p.add_argument(
        "--idle-exit",
        type=float,
        default=None,
        help="exit after this many seconds without input (batch runs, tests)",
    )
    p.add_argument(
        "--web-port",
        type=int,
        default=0,
        help="/health and /metrics on WEB_HOST:PORT (default 0: off)",
    )
    p.add_argument(
        "--web-host", default="127.0.0.1", help="/health's bind address (default 127.0.0.1)"
    )
    p.add_argument("--data-dir", help="state directory (default $REFINERY_HOME/detect)")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from schemas.catalog import default_catalog
    from services.cli_ports import require_free_port
    from services.detect.detector import DEFAULT_RULES, Detector
    from services.kafka.log import require_cluster
    from services.telemetry import ServiceTelemetry

    if args.web_port:  # taken: one line, exit 2, before Faust binds it in a traceback
        require_free_port(args.web_host, args.web_port)
    require_cluster(settings.kafka().librdkafka())  # first contact: one line, exit 1
    logging.basicConfig(
        level=args.loglevel.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    topics = TOPICS.with_prefix(args.topic_prefix)
    rules = Path(args.rules) if args.rules else DEFAULT_RULES
    # a bad rule file stops here, before any engine starts (one line, exit 2)
    detector = Detector(default_catalog(), rules, raw_topic=topics.raw)
    telemetry = ServiceTelemetry("detect", otlp_endpoint=settings.otlp_endpoint)
    keep_heap()
    try:
        return _run_faust(args, settings, topics, detector, telemetry)
    finally:
        telemetry.shutdown()


def _run_faust(
    args: argparse.Namespace,
    settings: RefinerySettings,
    topics: Topics,
    detector: Detector,
    telemetry: ServiceTelemetry,
) -> int:
    from services.detect.agent import DetectConfig, build_detect_app
    from services.kafka.group import run_worker

    cfg = DetectConfig(
        group=args.group,
        lookback_s=args.lookback,
        idle_exit_s=args.idle_exit,
        web_port=args.web_port or None,
        web_host=args.web_host,
        data_dir=Path(args.data_dir) if args.data_dir else settings.home / "detect",
    )
    built = build_detect_app(settings.kafka(), topics, detector, telemetry, cfg)
    rc = run_worker(built.app, loglevel=args.loglevel)
    print(f"detect: {built.core.stats}", file=sys.stderr)
    return rc
