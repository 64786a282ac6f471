"""``refinery detect``: rules, episodes, stragglers and rollups over refined data."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from services.settings import RefinerySettings


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "detect",
        help="derived streams: alerts, episodes with causes, rollups",
        description="Consume telemetry.refined and the aligned events/collectives, evaluate the "
        "rules, publish telemetry.alerts, telemetry.episodes and telemetry.rollups. Run one "
        "per cluster. Stops on SIGTERM/Ctrl-C (exit 0).",
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
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from schemas.catalog import default_catalog
    from services.detect.detector import DEFAULT_RULES, Detector
    from services.detect.service import DetectService, DetectTopics
    from services.telemetry import ServiceTelemetry

    logging.basicConfig(level=args.loglevel.upper(), stream=sys.stderr)
    topics = DetectTopics.with_prefix(args.topic_prefix)
    rules = Path(args.rules) if args.rules else DEFAULT_RULES
    detector = Detector(default_catalog(), rules, raw_topic=args.topic_prefix + "telemetry.raw")
    telemetry = ServiceTelemetry("detect", otlp_endpoint=settings.otlp_endpoint)
    stopping = {"now": False}

    def stop(*_: Any) -> None:
        stopping["now"] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service = DetectService(
        settings.kafka().librdkafka(),
        topics,
        detector,
        telemetry,
        group=args.group,
        lookback_s=args.lookback,
    )
    try:
        rc = service.run(lambda: stopping["now"], idle_exit_s=args.idle_exit)
        print(f"detect: {service.stats}", file=sys.stderr)
        return rc
    finally:
        telemetry.shutdown()
