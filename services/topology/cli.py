"""``refinery topology import`` and ``refinery jobs publish``.

``topology import (--ibnetdiscover F | --nccl-topo F --node N… | --slurm F | --file F)
[--node-map F] [--valid-from T] [--stdout] [--json]`` reads one topology source and publishes
each entity to the compacted ``topology`` topic (key: entity id, value: the entity's JSON).
With ``--stdout`` nothing is published: the entities are printed as JSON Lines, or with
``--json`` as one Refinery topology document that ``--file`` reads back. Problems (a partial
import) are printed one per line on stderr and make the exit code 1; the rest is still
published.

``jobs publish FILE [--stdout]`` does the same for job placements (topic ``jobs``, key: job id).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from schemas.errors import TransientError
from schemas.topics import TOPICS
from services.cli_parts import command_group, print_json
from services.settings import KafkaSettings, RefinerySettings
from services.topology.topofile import TopologyImport, dump_document, parse_time_ns


def publish(
    kafka: KafkaSettings, topic: str, records: Iterable[tuple[str, str]], timeout: float = 30.0
) -> int:
    """Produce ``(key, json value)`` records and wait for every acknowledgement; returns how
    many were acknowledged. Raises TransientError if some were not (nothing is lost silently:
    the caller reruns the import, which is idempotent on a compacted topic)."""
    from confluent_kafka import Producer

    from services.kafka.log import require_cluster

    conf = kafka.librdkafka()
    require_cluster(conf, min(timeout, 15.0))
    producer = Producer({**conf, "enable.idempotence": True, "acks": "all"})
    acked: list[int] = [0]
    errors: list[str] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            acked[0] += 1
        else:
            errors.append(err.str())

    sent = 0
    for key, value in records:
        while True:
            try:
                producer.produce(
                    topic, key=key.encode(), value=value.encode(), on_delivery=on_delivery
                )
                break
            except BufferError:
                producer.poll(0.5)
        sent += 1
        producer.poll(0)
    left = producer.flush(timeout)
    if left or errors or acked[0] != sent:
        first = errors[0] if errors else f"{left} not acknowledged within {timeout:g}s"
        raise TransientError(
            f"{topic}: {acked[0]}/{sent} records acknowledged by Kafka at "
            f"{kafka.bootstrap_servers} ({first})"
        )
    return acked[0]


def _emit(
    args: argparse.Namespace,
    settings: RefinerySettings,
    topic: str,
    items: list[tuple[str, BaseModel]],
    document: dict[str, Any] | None,
) -> None:
    if args.stdout:
        if args.json and document is not None:
            print_json(document)
        else:
            for _, model in items:
                sys.stdout.write(model.model_dump_json() + "\n")
        return
    n = publish(settings.kafka(), topic, ((k, m.model_dump_json()) for k, m in items))
    if args.json:
        print_json({"topic": topic, "published": n}, indent=None)
    else:
        print(f"published {n} record(s) to {topic}", file=sys.stderr)


def _run_import(args: argparse.Namespace) -> TopologyImport:
    vf = parse_time_ns(args.valid_from) if args.valid_from is not None else 0
    if args.ibnetdiscover:
        from services.topology.ibnetdiscover import import_ibnetdiscover, load_node_map

        nm = load_node_map(Path(args.node_map)) if args.node_map else None
        return import_ibnetdiscover(Path(args.ibnetdiscover), nm, vf)
    if args.nccl_topo:
        from services.topology.nccl_topo import import_nccl_topo

        names = args.nic_names.split(",") if args.nic_names else None
        return import_nccl_topo(Path(args.nccl_topo), args.node or [], vf, names)
    if args.slurm:
        from services.topology.slurm import import_topology_conf

        return import_topology_conf(Path(args.slurm), vf)
    from services.topology.topofile import parse_topofile

    valid_from = vf if args.valid_from is not None else None
    return TopologyImport(parse_topofile(Path(args.file), valid_from))


def cmd_topology_import(args: argparse.Namespace, settings: RefinerySettings) -> int:
    result = _run_import(args)
    for p in result.problems:
        print(f"topology import: {p}", file=sys.stderr)
    items: list[tuple[str, BaseModel]] = [(e.id, e) for e in result.entities]
    _emit(args, settings, TOPICS.topology, items, dump_document(result.entities))
    return 1 if result.problems else 0


def cmd_jobs_publish(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.topology.jobs import load_jobs

    jobs, problems = load_jobs(Path(args.file))
    for p in problems:
        print(f"jobs publish: {p}", file=sys.stderr)
    doc = {"jobs": [j.model_dump(mode="json") for j in jobs]}
    _emit(args, settings, TOPICS.jobs, [(j.job, j) for j in jobs], doc)
    return 1 if problems else 0


def add_parser(subparsers: Any) -> None:
    """Register ``topology import`` and ``jobs publish`` under the top-level sub-commands."""
    topo = command_group(subparsers, "topology", "topology facts → the compacted topology topic")
    imp = topo.add_parser("import", help="import a fabric/node/scheduler topology source")
    src = imp.add_mutually_exclusive_group(required=True)
    src.add_argument("--ibnetdiscover", metavar="FILE", help="ibnetdiscover output")
    src.add_argument("--nccl-topo", metavar="FILE", help="NCCL topology XML (NCCL_TOPO_FILE)")
    src.add_argument("--slurm", metavar="FILE", help="Slurm topology.conf (tree or block)")
    src.add_argument("--file", metavar="FILE", help="Refinery topology file (YAML/JSON)")
    imp.add_argument("--node-map", metavar="FILE", help="GUID/description → node[/device]")
    imp.add_argument(
        "--node", action="append", metavar="NAME", help="host(s) a --nccl-topo file describes"
    )
    imp.add_argument("--nic-names", metavar="A,B,…", help="--nccl-topo NIC names, bus-id order")
    imp.add_argument("--valid-from", metavar="T", help="ISO-8601 time or ns (default 0)")
    imp.add_argument("--stdout", action="store_true", help="print instead of publishing")
    imp.add_argument("--json", action="store_true", help="machine-readable output")
    imp.set_defaults(handler=cmd_topology_import)

    jobs = command_group(subparsers, "jobs", "job placement → the compacted jobs topic")
    pub = jobs.add_parser("publish", help="publish job placements (YAML/JSON or scontrol text)")
    pub.add_argument("file", metavar="FILE")
    pub.add_argument("--stdout", action="store_true", help="print instead of publishing")
    pub.add_argument("--json", action="store_true", help="machine-readable output")
    pub.set_defaults(handler=cmd_jobs_publish)
