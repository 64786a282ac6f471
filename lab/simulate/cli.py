"""``refinery simulate``: publish a simulated cluster with faults into Kafka, with ground truth.

Example::

    refinery simulate --nodes 32 --duration 60 --seed 7 --faults all --truth run/truth.parquet

Progress goes to stderr every few seconds; ``--stdout-summary`` prints the final counts (and
``--json`` prints them as JSON). Exit codes: 0 all acknowledged, 1 some records unacknowledged,
2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from schemas.durations import parse_duration_ns
from schemas.errors import ConfigError
from services.settings import KafkaSettings, RefinerySettings


def add_parser(subparsers: Any) -> None:
    """Register ``simulate`` on an argparse sub-parser collection."""
    p = subparsers.add_parser(
        "simulate", help="publish a simulated GPU cluster with faults; writes ground truth"
    )
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nics-per-node", type=int, default=8)
    p.add_argument("--cpus-per-node", type=int, default=128)
    p.add_argument("--interval", default="1s", help="scrape interval (default 1s)")
    p.add_argument("--substeps", type=int, default=10, help="gpu/nic samples per interval")
    p.add_argument(
        "--duration", type=float, default=None, help="simulated seconds (default: forever)"
    )
    p.add_argument(
        "--speed", type=float, default=1.0, help="true time / wall time; 0 or inf: flat out"
    )
    p.add_argument(
        "--spread",
        action="store_true",
        help="each node's exporters at a phase of their own in the interval "
        "(default: all publish at once, in lockstep)",
    )
    p.add_argument("--seed", type=int, required=True)
    p.add_argument(
        "--faults", default="none", help='"all", "none" or a list, see lab.simulate.faults'
    )
    p.add_argument("--truth", default=None, help="truth Parquet file (siblings FILE.*.parquet)")
    p.add_argument("--topic-prefix", default="", help="prefix for every topic name")
    p.add_argument("--bootstrap", default=None, help="override REFINERY_BOOTSTRAP_SERVERS")
    p.add_argument("--stdout-summary", action="store_true", help="print the final counts")
    p.add_argument("--json", action="store_true", help="final counts as JSON on stdout")
    p.set_defaults(handler=cmd_simulate)


def cmd_simulate(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from lab.simulate.cluster import Cluster
    from lab.simulate.engine import Simulation
    from lab.simulate.faults import parse_faults
    from lab.simulate.publish import Topics, publish
    from lab.simulate.truth import load_truth

    interval = parse_duration_ns(args.interval, positive=True, name="--interval")
    if args.nodes < 1 or args.substeps < 1:
        raise ConfigError("--nodes and --substeps must be positive")
    spec = parse_faults(args.faults)
    cluster = Cluster.build(
        args.nodes, args.gpus_per_node, args.nics_per_node, args.seed, cpus=args.cpus_per_node
    )
    duration = None if args.duration is None else int(args.duration * 1e9)
    sim = Simulation(
        cluster,
        spec,
        seed=args.seed,
        interval_ns=interval,
        duration_ns=duration,
        substeps=args.substeps,
        spread=args.spread,
    )
    kafka = settings.kafka()
    if args.bootstrap:
        kafka = KafkaSettings(**{**kafka.model_dump(), "bootstrap_servers": args.bootstrap})
    from services.kafka.log import require_cluster

    require_cluster(kafka.librdkafka())  # first contact: one line, exit 1
    pre = args.topic_prefix
    topics = Topics(
        *(
            pre + t
            for t in (
                "telemetry.raw",
                "telemetry.events",
                "telemetry.collectives",
                "topology",
                "jobs",
            )
        )
    )
    speed = math.inf if args.speed <= 0 else args.speed
    rep = publish(sim, kafka, topics, args.truth, speed)
    out: dict[str, Any] = rep.as_dict()
    if args.truth:
        out["truth"] = {"path": args.truth, **load_truth(args.truth).summary()}
    if args.json:
        json.dump(out, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    elif args.stdout_summary:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0 if rep.unacked == 0 else 1
