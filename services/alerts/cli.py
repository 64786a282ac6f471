"""``refinery alerts tail|forward``: consumers of ``telemetry.alerts``.

Registered through ``add_parser(subparsers)`` (listed in ``services.cli.COMMAND_MODULES``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from schemas.records import Severity
from schemas.topics import TOPICS
from services.settings import RefinerySettings

from .tail import TailOptions, tail_alerts
from .webhook import WebhookForwarder, WebhookSettings


def cmd_alerts_tail(args: argparse.Namespace, settings: RefinerySettings) -> int:
    opts = TailOptions(
        topic=args.topic,
        follow=args.follow,
        as_json=args.json,
        severity=Severity(args.severity) if args.severity else None,
        job=args.job,
        from_beginning=args.from_beginning,
        last=args.last,
    )
    tail_alerts(settings.kafka().librdkafka(), opts, sys.stdout, sys.stderr)
    return 0


def cmd_alerts_forward(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.kafka.log import require_cluster

    require_cluster(settings.kafka().librdkafka())  # first contact: one line, exit 1
    ws = WebhookSettings(
        url=args.webhook,
        topic=args.topic,
        group=args.group,
        max_attempts=args.max_attempts,
    )
    fwd = WebhookForwarder(settings.kafka().librdkafka(), ws)
    try:
        fwd.run()  # until interrupted; TransientError (no commit) exits 1
    finally:
        fwd.close()
        print(f"forwarded {fwd.stats.forwarded} alert record(s)", file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``alerts tail`` and ``alerts forward`` to the ``refinery`` parser."""
    a = subparsers.add_parser("alerts", help=f"consume {TOPICS.alerts} (tail, webhook forward)")
    asub = a.add_subparsers(dest="action", metavar="ACTION", parser_class=type(a))
    asub.required = True
    t = asub.add_parser("tail", help="print alert records; exits at the end unless --follow")
    t.add_argument("--topic", default=TOPICS.alerts)
    t.add_argument("--follow", "-f", action="store_true", help="keep waiting for new alerts")
    t.add_argument("--json", action="store_true", help="one JSON record per line")
    t.add_argument("--severity", choices=[s.value for s in Severity], help="at least this")
    t.add_argument("--job", help="only alerts of this job")
    t.add_argument("--from-beginning", action="store_true", help="every retained record")
    t.add_argument("--last", type=int, default=10, help="records per partition (default 10)")
    t.set_defaults(handler=cmd_alerts_tail)
    f = asub.add_parser("forward", help="POST each alert record to a webhook, at least once")
    f.add_argument("--webhook", required=True, metavar="URL")
    f.add_argument("--topic", default=TOPICS.alerts)
    f.add_argument("--group", default="refinery-alerts-webhook", help="consumer group")
    f.add_argument(
        "--max-attempts", type=int, default=None, help="give up (exit 1, no commit) after N"
    )
    f.set_defaults(handler=cmd_alerts_forward)
