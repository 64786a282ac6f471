"""``refinery broker start|stop|status``: a local Apache Kafka (see :mod:`lab.broker`).

A lab command: registered through the ``refinery.commands`` entry point group, so the product
CLI offers it where the lab is installed and never imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from lab.broker import LocalKafka
from services.cli_parts import print_json
from services.settings import RefinerySettings


def add_parser(sub: Any) -> None:
    b = sub.add_parser("broker", help="run a local Apache Kafka (KRaft) on 127.0.0.1")
    bsub = b.add_subparsers(dest="action", metavar="ACTION")  # the parent's parser class
    bsub.required = True
    for name, fn, hlp in (
        ("start", cmd_broker_start, "resolve jars, format storage, start, wait until ready"),
        ("stop", cmd_broker_stop, "graceful stop (SIGTERM, wait); idempotent"),
        ("status", cmd_broker_status, "pid, ports, nodes, readiness (exit 3 when down)"),
    ):
        sp = bsub.add_parser(name, help=hlp)
        sp.add_argument("--data-dir", help="broker state (default $REFINERY_HOME/broker)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "start":
            sp.add_argument("--nodes", type=int, choices=(1, 3), default=1)
            sp.add_argument(
                "--port",
                type=int,
                default=9092,
                help="first port; nodes use consecutive pairs (0: free ports)",
            )
            sp.add_argument(
                "--secure",
                action="store_true",
                help="TLS, SCRAM-SHA-512 and mutual-TLS clients, ACLs enforced",
            )
        sp.set_defaults(handler=fn)


def _local_kafka(args: argparse.Namespace, settings: RefinerySettings) -> LocalKafka:
    data_dir = Path(args.data_dir) if args.data_dir else settings.home / "broker"
    return LocalKafka(data_dir, version=settings.kafka_version)


def cmd_broker_start(args: argparse.Namespace, settings: RefinerySettings) -> int:
    k = _local_kafka(args, settings)
    t0 = time.monotonic()
    state = k.start(
        nodes=args.nodes, base_port=args.port, progress=not args.json, secure=args.secure
    )
    took = time.monotonic() - t0
    if args.json:
        print_json({**k.status(), "start_seconds": round(took, 2)})
    else:
        print(
            f"broker ready in {took:.1f}s: {len(state.nodes)} node(s), data in {k.data_dir}",
            file=sys.stderr,
        )
        print(state.bootstrap)
        print(f"  export REFINERY_BOOTSTRAP_SERVERS={state.bootstrap}", file=sys.stderr)
        if state.secure:  # a path, never a password
            env = k.security().client_env("admin")
            print(f"  SASL_SSL; admin credentials: set -a; . {env}; set +a", file=sys.stderr)
    return 0


def cmd_broker_stop(args: argparse.Namespace, settings: RefinerySettings) -> int:
    n = _local_kafka(args, settings).stop()
    print(f"stopped {n} broker process(es)" if n else "no broker running", file=sys.stderr)
    return 0


def cmd_broker_status(args: argparse.Namespace, settings: RefinerySettings) -> int:
    st = _local_kafka(args, settings).status()
    if args.json:
        print_json(st)
    elif not st["running"]:
        print(f"not running (data dir {st['data_dir']})")
    else:
        print(
            f"{'ready' if st['ready'] else 'starting'}: {st['bootstrap_servers']} "
            f"({st['nodes_alive']}/{st['nodes']} nodes alive)"
        )
    return 0 if st["running"] else 3
