"""``refinery export firmware``: ethtool PFC/ECN counters, Redfish BMC sensors/SEL/clock and
kernel-log XIDs, to ``telemetry.raw`` (samples) and ``telemetry.events`` (events).

``export firmware [--ethtool IFACE …] [--redfish URL --redfish-user U --redfish-password-file F
--redfish-ca FILE | --insecure] [--kmsg FILE|/dev/kmsg] [--dmesg FILE] [--once] [--stdout]
[--interval 1s]``. With ``--stdout`` rows are printed as JSON Lines (``{"kind": …, row}``)
instead of published. Source failures are counted in the service's own telemetry (OpenTelemetry,
exported over OTLP when configured) and reported on stderr with their count and last error;
the loop goes on. Batches the producers' buffer bounds drop while the cluster is unreachable
(the oldest) are counted there too (``refinery.exporter.dropped_batches`` and ``_samples``, per
topic) and logged by the producer. Also holds the small helpers the NCCL CLI shares
(durations, identity, batch sink).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.catalog import default_catalog
from schemas.durations import parse_duration_s
from schemas.errors import ConfigError
from schemas.topics import TOPICS
from schemas.wire import ClockBlock, Envelope, PayloadKind, SourceId
from services.cli_parts import command_group
from services.exporters.refused import Refusals
from services.kafka.producer import initial_seq
from services.settings import RefinerySettings
from services.telemetry import ServiceTelemetry


def safe_name(text: str) -> str:
    """A string made to fit the envelope's name pattern (``[A-Za-z0-9][A-Za-z0-9._:@+-]*``)."""
    s = re.sub(r"[^A-Za-z0-9._:@+-]", "_", text)[:128]
    return s if s and s[0].isalnum() else ("x" + s)[:128]


def local_identity() -> tuple[str, str]:
    """(node name, boot id) of this machine; called from CLI handlers only."""
    node = safe_name(socket.gethostname().split(".")[0] or "localhost")
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = f"t{time.time_ns()}"
    return node, safe_name(boot)


class BatchSink:
    """Publish tables as wire batches (lazily building the Kafka producer), or print them."""

    def __init__(
        self, settings: RefinerySettings, source: SourceId, *, stdout: bool, interval_ns: int | None
    ) -> None:
        self.source = source
        self.stdout = stdout
        self.interval_ns = interval_ns
        self._settings = settings
        self._producers: dict[str, Any] = {}
        self.seq = initial_seq()
        self.refused = Refusals("export", settings.kafka().bootstrap_servers)
        if not stdout:  # first contact: one line and exit 1 when the cluster cannot be used
            from services.kafka.log import require_cluster

            require_cluster(settings.kafka().librdkafka())

    def send(
        self,
        kind: PayloadKind,
        topic: str,
        table: pa.Table,
        clock: ClockBlock | None = None,
        key: str | None = None,
    ) -> None:
        if table.num_rows == 0:
            return
        if self.stdout:
            for row in table.to_pylist():
                sys.stdout.write(json.dumps({"kind": kind.value, **row}) + "\n")
            sys.stdout.flush()
            return
        if topic not in self._producers:
            from services.kafka.producer import BatchProducer

            producer = BatchProducer(
                self._settings.kafka(), topic=topic, on_delivery=self.refused.for_topic(topic)
            )
            # a batch with no rows first: its exchange bounds the clock of the first with rows
            producer.greet(self._envelope(kind, clock), key=key)
            self._producers[topic] = producer
        if self._producers[topic].refused is not None:
            self.refused.count += 1  # said once already; every batch for it is refused too
            return
        self._producers[topic].send(self._envelope(kind, clock), table, key=key)

    def _envelope(self, kind: PayloadKind, clock: ClockBlock | None) -> Envelope:
        """The next batch header (``seq`` increases by one per call), stamped now."""
        env = Envelope(
            kind=kind,
            source=self.source,
            seq=self.seq,
            sent_ns=time.time_ns(),
            interval_ns=self.interval_ns,
            clock=clock,
        )
        self.seq += 1
        return env

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``, serving delivery reports as they arrive: their exchanges with
        the broker then bound the clock tightly (pipelines.refine.clock_bounds)."""
        producers = list(self._producers.values())
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not producers:
                time.sleep(left)
                return
            producers[0].poll(left if len(producers) == 1 else min(left, 0.005))
            for p in producers[1:]:
                p.poll(0)

    def dropped(self) -> dict[str, tuple[int, int]]:
        """Topic → (batches, samples) its producer's buffer bounds dropped so far (the oldest,
        while the cluster was unreachable)."""
        return {
            t: (p.stats.dropped_overflow, p.stats.dropped_samples)
            for t, p in self._producers.items()
        }

    def close(self) -> int:
        """Flush every producer; returns how many batches stayed unacknowledged or were
        refused by the cluster."""
        return sum(int(p.close()) for p in self._producers.values()) + self.refused.count


def _sources(args: argparse.Namespace) -> list[Any]:
    from services.exporters.ethtool import EthtoolSource
    from services.exporters.firmware import KernelLogSource
    from services.exporters.kmsg import boot_time_ns, load_gpu_map

    sources: list[Any] = []
    catalog = default_catalog()
    for iface in args.ethtool or []:
        sources.append(EthtoolSource(iface, catalog))
    if args.redfish:
        from services.exporters.redfish import RedfishSource
        from services.exporters.redfish_client import RedfishClient

        password = None
        if args.redfish_password_file:
            password = Path(args.redfish_password_file).read_text().strip()
        client = RedfishClient(
            args.redfish,
            args.redfish_user,
            password,
            ca_file=args.redfish_ca,
            insecure=args.insecure,
        )
        sources.append(RedfishSource(client))
    gpus = load_gpu_map(Path(args.gpu_map).read_text()) if args.gpu_map else {}
    try:
        boot_ns: int | None = boot_time_ns(Path("/proc/stat").read_text())
    except (OSError, ValueError):
        boot_ns = None
    if args.kmsg:
        sources.append(
            KernelLogSource(
                Path(args.kmsg), raw_kmsg=True, boot_ns=boot_ns, gpu_by_pci=gpus,
                from_start=args.once,
            )
        )  # fmt: skip
    if args.dmesg:
        sources.append(
            KernelLogSource(Path(args.dmesg), raw_kmsg=False, boot_ns=boot_ns, gpu_by_pci=gpus)
        )
    if not sources:
        raise ConfigError("export firmware: give at least one of --ethtool, --redfish, --kmsg")
    return sources


def cmd_export_firmware(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.exporters.firmware import FirmwareExporter

    interval = parse_duration_s(args.interval, positive=True, name="--interval")
    if args.redfish and not (args.redfish_ca or args.insecure or args.redfish.startswith("http:")):
        print("export firmware: verifying the BMC with the system CA store", file=sys.stderr)
    exporter = FirmwareExporter(_sources(args))
    node, boot = local_identity()
    sink = BatchSink(
        settings,
        SourceId(node=node, exporter="firmware", instance="0", boot_id=boot),
        stdout=args.stdout,
        interval_ns=int(interval * 1e9),
    )
    reported: dict[str, int] = {}
    polls: dict[str, int] = {}
    counted: dict[str, tuple[int, int]] = {}
    telemetry = ServiceTelemetry("firmware-exporter", otlp_endpoint=settings.otlp_endpoint)
    try:
        while True:
            t0 = time.monotonic()
            poll = exporter.poll()
            for table in poll.samples:
                sink.send(PayloadKind.SAMPLES, TOPICS.raw, table, poll.clock)
            for table in poll.events:
                sink.send(PayloadKind.EVENTS, TOPICS.events, table, poll.clock)
            for h in exporter.health.values():
                # the service's own telemetry: polls and failures per source
                telemetry.count(
                    "refinery.exporter.polls", h.polls - polls.get(h.name, 0), {"source": h.name}
                )
                polls[h.name] = h.polls
                if h.errors != reported.get(h.name, 0):
                    telemetry.count(
                        "refinery.exporter.source_errors",
                        h.errors - reported.get(h.name, 0),
                        {"source": h.name},
                    )
                    reported[h.name] = h.errors
                    print(f"{h.name}: {h.errors} error(s), last: {h.last_error}", file=sys.stderr)
            _count_drops(telemetry, sink, counted)
            if args.once:
                break
            sink.wait(max(0.0, interval - (time.monotonic() - t0)))
    finally:
        left = sink.close()
        telemetry.shutdown()
    failed = all(h.errors for h in exporter.health.values())
    return 1 if left or failed else 0


def _count_drops(
    telemetry: ServiceTelemetry, sink: BatchSink, counted: dict[str, tuple[int, int]]
) -> None:
    """The service's own telemetry: batches and samples the producers' bounds dropped, per
    topic (the producer also logs them)."""
    for topic, (batches, samples) in sink.dropped().items():
        before = counted.get(topic, (0, 0))
        if (batches, samples) != before:
            attrs = {"topic": topic}
            telemetry.count("refinery.exporter.dropped_batches", batches - before[0], attrs)
            telemetry.count("refinery.exporter.dropped_samples", samples - before[1], attrs)
            counted[topic] = (batches, samples)


def add_parser(subparsers: Any) -> None:
    """Register ``export firmware``."""
    export = command_group(subparsers, "export", "run an exporter (publishes to Kafka)")
    p = export.add_parser("firmware", help="ethtool PFC/ECN, Redfish BMC, kernel-log XIDs")
    p.add_argument("--ethtool", action="append", metavar="IFACE", help="ethtool -S IFACE")
    p.add_argument("--redfish", metavar="URL", help="BMC base URL, e.g. https://bmc1")
    p.add_argument("--redfish-user", metavar="U")
    p.add_argument("--redfish-password-file", metavar="F")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--redfish-ca", metavar="FILE", help="CA bundle for the BMC certificate")
    tls.add_argument("--insecure", action="store_true", help="do not verify the BMC certificate")
    p.add_argument("--kmsg", metavar="FILE", help="raw kmsg records, or /dev/kmsg")
    p.add_argument("--dmesg", metavar="FILE", help="a dmesg -T log file to follow")
    p.add_argument("--gpu-map", metavar="FILE", help="nvidia-smi index,pci.bus_id CSV or JSON")
    p.add_argument("--once", action="store_true", help="one poll, then exit")
    p.add_argument("--stdout", action="store_true", help="print JSON Lines instead of publishing")
    p.add_argument("--interval", default="1s", help="poll interval (default 1s)")
    p.set_defaults(handler=cmd_export_firmware)
