"""``refinery export node``: scrape this node and publish batches to ``telemetry.raw``.

    refinery export node [--interval 1s] [--once] [--stdout] [--procfs DIR] [--sysfs DIR] [--json]

- ``--stdout`` prints each batch in the JSON wire encoding, one per line, and needs no Kafka.
- Without ``--stdout`` batches go to Kafka through :class:`services.kafka.producer.BatchProducer`
  (Arrow IPC, or JSON with ``--json``), keyed by node.
- ``--once`` scrapes once and exits; otherwise it scrapes every ``--interval`` until
  interrupted, on a fixed schedule (a slow scrape does not shift the next ones).
- Publishing to Kafka, the exporter also records the node's netdev ↔ RDMA device ↔ port
  links (and LLDP neighbours where ``lldpctl`` answers) as ``netdev`` entities on the compacted
  ``topology.nodes`` topic (:mod:`services.exporters.netdev`; the exporter may not write the
  fabric's ``topology``, the worker reads both): at start, and again when they change
  (checked every ``--facts-every`` scrapes). ``--no-topology`` turns this off. A failed
  publish is reported in one line and retried at the next check; samples keep flowing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from schemas.catalog import default_catalog
from schemas.codec import ARROW, JSON, encode
from schemas.durations import parse_duration_s
from schemas.errors import ConfigError, RefineryError
from schemas.topics import TOPICS
from services.cli_parts import command_group
from services.exporters.netdev import NetdevFacts, boot_time_ns
from services.exporters.node import NodeCollector, node_source
from services.exporters.refused import Refusals
from services.settings import RefinerySettings


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``export node`` (creating the ``export`` group if no other module has)."""
    group = command_group(subparsers, "export", "run an exporter on this node")
    p = group.add_parser("node", help="procfs, sysfs (IB/RoCE, net, PCIe, thermal), NVML, chrony")
    p.add_argument("--interval", default="1s", help="scrape interval (default 1s)")
    p.add_argument("--once", action="store_true", help="scrape once and exit")
    p.add_argument("--stdout", action="store_true", help="print JSON batches instead of publishing")
    p.add_argument("--procfs", default="/proc", help="procfs root (default /proc)")
    p.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    p.add_argument("--json", action="store_true", help="publish in the JSON encoding, not Arrow")
    p.add_argument("--node", help="node name (default: the hostname)")
    p.add_argument("--topic", default=TOPICS.raw, help=f"Kafka topic (default {TOPICS.raw})")
    p.add_argument("--no-gpu", action="store_true", help="do not open NVML")
    p.add_argument("--no-clock", action="store_true", help="do not run chronyc")
    p.add_argument(
        "--no-topology", action="store_true", help="do not publish the netdev ↔ RDMA facts"
    )
    p.add_argument(
        "--topology-topic",
        default=TOPICS.topology_nodes,
        help=f"topic of the netdev facts (default {TOPICS.topology_nodes})",
    )
    p.add_argument(
        "--facts-every", type=int, default=60, help="check the facts every N scrapes (60)"
    )
    p.set_defaults(handler=cmd_export_node)


def cmd_export_node(args: argparse.Namespace, settings: RefinerySettings) -> int:
    """Run the exporter; returns the exit code. May block for as long as it runs."""
    interval_s = parse_duration_s(args.interval, positive=True, name="--interval")
    procfs, sysfs = Path(args.procfs), Path(args.sysfs)
    if not procfs.is_dir():
        raise ConfigError(f"--procfs {procfs}: not a directory")
    collector = NodeCollector(
        procfs, sysfs, catalog=default_catalog(), gpus=not args.no_gpu, clock=not args.no_clock
    )
    source = node_source(procfs, node=args.node)
    if collector.gpu_reason and not args.no_gpu:
        print(f"refinery export node: no GPU metrics: {collector.gpu_reason}", file=sys.stderr)
    producer: Any = None
    refused = Refusals("export node", settings.kafka().bootstrap_servers)
    if not args.stdout:
        from services.kafka.log import require_cluster
        from services.kafka.producer import BatchProducer

        require_cluster(settings.kafka().librdkafka())
        producer = BatchProducer(
            settings.kafka(),
            topic=args.topic,
            content_type=JSON if args.json else ARROW,
            on_delivery=refused.for_topic(args.topic),
        )
    interval_ns = int(interval_s * 1e9)
    next_at = time.monotonic()
    facts = None
    if producer is not None and not args.no_topology:
        facts = NetdevFacts(sysfs, source.node, valid_from=boot_time_ns(procfs))
    scrapes = 0
    if producer is not None:
        # a batch with no rows first: its exchange bounds the clock of the first with rows
        hello = collector.envelope(source, sent_ns=time.time_ns(), interval_ns=interval_ns)
        producer.greet(hello, key=source.node)
        if producer.refused is not None:  # said once (Refusals); every batch would be too
            collector.close()
            producer.close(5.0)
            return 1
    try:
        while True:
            if facts is not None and scrapes % max(1, args.facts_every) == 0:
                _publish_facts(facts, settings, args.topology_topic)
            scrapes += 1
            table = collector.scrape(producer.stamp() if producer is not None else None)
            env = collector.envelope(source, sent_ns=time.time_ns(), interval_ns=interval_ns)
            if producer is None:
                _, body = encode(env, table, JSON)
                sys.stdout.write(body.decode() + "\n")
                sys.stdout.flush()
            else:
                producer.send(env, table, key=source.node)
            if args.once:
                break
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind: skip missed slots rather than burst
                next_at = time.monotonic()
                delay = 0.0
            if producer is not None:
                producer.poll(delay)
            else:
                time.sleep(delay)
    except KeyboardInterrupt:
        pass
    finally:
        collector.close()
        left = producer.close() if producer is not None else 0
    return 1 if refused.count or left else 0


def _publish_facts(facts: NetdevFacts, settings: RefinerySettings, topic: str) -> None:
    """Publish the node's netdev entities when they changed; one stderr line on failure."""
    from services.topology.cli import publish

    entities = facts.changed()
    if entities is None:
        return
    if not entities:  # no RDMA interface and no LLDP neighbour: nothing to record
        facts.mark_published(entities)
        return
    records = ((e.id, e.model_dump_json()) for e in entities)
    try:
        publish(settings.kafka(), topic, records, timeout=30.0)
    except RefineryError as e:
        print(f"refinery export node: netdev facts not published: {e}", file=sys.stderr)
        return
    facts.mark_published(entities)
