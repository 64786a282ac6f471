"""``refinery export scrape``: scrape Prometheus endpoints (dcgm-exporter, node_exporter) and
publish native batches with full identity, so scraped data gets every guarantee of a native
source.

    refinery export scrape --target URL [--target URL ...] [--interval 1s] [--node NAME]
                           [--once] [--stdout] [--all] [--topic telemetry.raw] [--json]

Each target is a source: ``node`` (the exposition's ``Hostname`` label, else ``--node``,
else the target's host, this host's name for a loopback target), exporter ``scrape``,
instance ``host:port`` of the target, ``boot_id`` new for each run of the scraper (its
``seq`` starts again at 0), ``seq`` per batch, ``sent_ns`` when handed to Kafka, and the
producer's send/ack exchanges in the clock block (a target's first batch has no rows: it
earns the exchange that bounds the clock of the first one with rows). Samples are stamped
with the scrape's midpoint unless the exposition has timestamps. Names map to the catalog through
``schemas/catalog/ingest/prometheus.yaml``; series the catalog lacks are not published
(``--all`` publishes them too, for the refiner to dead-letter by name) and are reported
once on stderr, so an operator can extend the mapping.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc

from schemas.catalog import default_catalog
from schemas.codec import ARROW, JSON, encode
from schemas.durations import parse_duration_s
from schemas.errors import ConfigError, RejectedInput
from schemas.ingest.assemble import Position, assemble
from schemas.ingest.mapping import default_mapping
from schemas.ingest.prom import decode_prometheus
from schemas.topics import TOPICS
from schemas.wire import Envelope, SourceId
from services.cli_parts import command_group
from services.settings import RefinerySettings

ACCEPT = "text/plain;version=0.0.4;q=0.9,application/openmetrics-text;version=1.0.0;q=0.5"
EXPORTER = "scrape"


@dataclass
class Target:
    """One endpoint and the identity of its batches."""

    url: str
    node_hint: str
    instance: str
    boot_id: str = field(default_factory=lambda: f"scrape-{uuid.uuid4().hex[:16]}")
    seq: int = 0
    unmapped: set[str] = field(default_factory=set)
    greeted: bool = False  # its first batch, with no rows, was sent (BatchProducer.greet)


def target_of(url: str, node: str | None) -> Target:
    """A :class:`Target` for ``url``; :class:`ConfigError` for a URL that is not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"--target {url!r}: expected an http(s) URL like http://host:9400/metrics"
        )
    host = parts.hostname
    local = host in ("localhost", "127.0.0.1", "::1")
    hint = node or (socket.gethostname().split(".")[0] if local else host.split(".")[0])
    return Target(url, hint, f"{host}:{parts.port or 80}")


def fetch(url: str, timeout: float) -> tuple[bytes, str | None]:
    """The exposition at ``url`` and its content type; OSError on any failure."""
    req = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read(), resp.headers.get("Content-Type")


def scrape_batch(
    target: Target, body: bytes, content_type: str | None, at_ns: int, keep_unmapped: bool
) -> tuple[Envelope, pa.Table]:
    """The native batch of one scrape of ``target`` (its next seq). Raises RejectedInput for
    an exposition that cannot be read."""
    openmetrics = (content_type or "").startswith("application/openmetrics-text")
    points = decode_prometheus(body, openmetrics=openmetrics)
    batch = assemble(
        points,
        default_mapping("prometheus"),
        EXPORTER,
        Position(0, 0, at_ns, target.node_hint.encode()),
    )
    table = batch.table
    if not keep_unmapped:
        known = pc.is_in(table["metric"], pa.array(default_catalog().names()))
        if not pc.all(known).as_py():
            target.unmapped.update(pc.unique(table.filter(pc.invert(known))["metric"]).to_pylist())
            table = table.filter(known)
    source = SourceId(node=batch.envelope.source.node, exporter=EXPORTER,
                      instance=target.instance, boot_id=target.boot_id)  # fmt: skip
    env = Envelope(source=source, seq=target.seq, sent_ns=time.time_ns())
    target.seq += 1
    return env, table


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``export scrape`` in the ``export`` group."""
    group = command_group(subparsers, "export", "run an exporter on this node")
    p = group.add_parser(
        "scrape", help="scrape Prometheus endpoints (dcgm-exporter, node_exporter)"
    )
    p.add_argument("--target", action="append", required=True, help="URL; repeat for several")
    p.add_argument("--interval", default="1s", help="scrape interval (default 1s)")
    p.add_argument("--node", help="node name when the exposition has no Hostname label")
    p.add_argument("--once", action="store_true", help="scrape once and exit")
    p.add_argument("--stdout", action="store_true", help="print JSON batches instead of publishing")
    p.add_argument("--all", action="store_true", help="publish series the catalog lacks too")
    p.add_argument("--json", action="store_true", help="publish in the JSON encoding, not Arrow")
    p.add_argument("--topic", default=TOPICS.raw, help=f"Kafka topic (default {TOPICS.raw})")
    p.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout, seconds (5)")
    p.set_defaults(handler=cmd_export_scrape)


def _scrape_once(targets: list[Target], args: argparse.Namespace, producer: Any) -> None:
    for t in targets:
        stamp = time.time_ns if producer is None else producer.stamp
        start = stamp()
        try:
            body, ctype = fetch(t.url, args.timeout)
            mid = (start + stamp()) // 2
            env, table = scrape_batch(t, body, ctype, mid, args.all)
        except (OSError, urllib.error.URLError, RejectedInput) as e:
            print(f"refinery export scrape: {t.url}: {e}", file=sys.stderr)
            continue
        if producer is None:
            sys.stdout.write(encode(env, table, JSON)[1].decode() + "\n")
            sys.stdout.flush()
        else:
            if not t.greeted:
                # a batch with no rows first: its exchange bounds the clock of the first
                # with rows; that one takes the next seq and is stamped when sent
                producer.greet(env, key=env.source.node)
                t.greeted = True
                if producer.refused is not None:
                    print(f"refinery export scrape: {t.url}: Kafka refused its first batch: "
                          f"{producer.refused.str()}", file=sys.stderr)  # fmt: skip
                    continue
                env = env.model_copy(update={"seq": t.seq, "sent_ns": time.time_ns()})
                t.seq += 1
            producer.send(env, table, key=env.source.node)


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_export_scrape(args: argparse.Namespace, settings: RefinerySettings) -> int:
    """Scrape every ``--interval`` until interrupted (or once); returns the exit code."""
    interval_s = parse_duration_s(args.interval, positive=True, name="--interval")
    targets = [target_of(u, args.node) for u in args.target]
    producer: Any = None
    if not args.stdout:
        from services.kafka.log import require_cluster
        from services.kafka.producer import BatchProducer

        require_cluster(settings.kafka().librdkafka())
        producer = BatchProducer(
            settings.kafka(), topic=args.topic, content_type=JSON if args.json else ARROW
        )
    signal.signal(signal.SIGTERM, _stop)  # a supervisor's stop flushes like Ctrl-C
    next_at = time.monotonic()
    reported = 0
    try:
        while True:
            _scrape_once(targets, args, producer)
            unmapped = sorted({m for t in targets for m in t.unmapped})
            if len(unmapped) > reported:
                shown = ", ".join(unmapped[:8]) + (" ..." if len(unmapped) > 8 else "")
                print(f"refinery export scrape: {len(unmapped)} series names not in the "
                      f"catalog, not published: {shown}", file=sys.stderr)  # fmt: skip
                reported = len(unmapped)
            if args.once:
                break
            next_at += interval_s
            delay = max(0.0, next_at - time.monotonic())
            if delay == 0.0:
                next_at = time.monotonic()
            if producer is not None:
                producer.poll(delay)
            else:
                time.sleep(delay)
    except KeyboardInterrupt:
        pass
    finally:
        if producer is not None:
            producer.close()
    return 0
