"""``refinery export nccl`` (follow NCCL Inspector output) and ``refinery import nccl-tests``.

Both publish COLLECTIVES_SCHEMA batches to ``telemetry.collectives`` keyed by job, or print
JSON Lines with ``--stdout``. An imported file's batch identity is derived from its content
(``boot_id`` = a hash of the bytes, ``seq`` 0), so importing the same log twice is a transport
duplicate the refiner drops, not a second copy.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from schemas.durations import parse_duration_s
from schemas.topics import TOPICS
from schemas.wire import PayloadKind, SourceId
from services.cli_parts import command_group, print_json
from services.exporters.firmware_cli import BatchSink, local_identity, safe_name
from services.settings import RefinerySettings


def _inspector_job(directory: Path) -> str:
    name = directory.resolve().name
    prefix = "nccl-inspector-"
    return name[len(prefix) :] if name.startswith(prefix) else "unknown"


def cmd_export_nccl(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.exporters.nccl_inspector import InspectorDirSource

    directory = Path(args.inspector_dir)
    job = args.job or _inspector_job(directory)
    src = InspectorDirSource(directory, job)
    interval = parse_duration_s(args.interval, positive=True, name="--interval")
    node, boot = local_identity()
    sink = BatchSink(
        settings,
        SourceId(node=node, exporter="nccl-inspector", instance=safe_name(job), boot_id=boot),
        stdout=args.stdout,
        interval_ns=int(interval * 1e9),
    )
    errors = 0
    try:
        while True:
            t0 = time.monotonic()
            poll = src.poll()
            sink.send(PayloadKind.COLLECTIVES, TOPICS.collectives, poll.table, key=job)
            for e in poll.errors:
                errors += 1
                print(f"export nccl: {e}", file=sys.stderr)
            if poll.bad_lines:
                print(f"export nccl: {poll.bad_lines} line(s) not JSON, skipped", file=sys.stderr)
            if args.once:
                break
            sink.wait(max(0.0, interval - (time.monotonic() - t0)))
    finally:
        left = sink.close()
    return 1 if left or errors else 0


def cmd_import_nccl_tests(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.exporters.nccl_tests import import_nccl_tests

    node, _ = local_identity()
    summaries: list[dict[str, Any]] = []
    left = 0
    for name in args.files:
        path = Path(name)
        job = args.job or path.stem
        result = import_nccl_tests(path, job=job, op=args.op)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        sink = BatchSink(
            settings,
            SourceId(node=node, exporter="nccl-tests", instance=safe_name(path.stem),
                     boot_id=f"sha-{digest}"),
            stdout=args.stdout,
            interval_ns=None,
        )  # fmt: skip
        sink.send(PayloadKind.COLLECTIVES, TOPICS.collectives, result.table, key=job)
        left += sink.close()
        busbw = [v for v in result.table.column("busbw_gbps").to_pylist() if v is not None]
        summaries.append(
            {
                "file": name,
                "job": job,
                "op": result.op,
                "nranks": result.nranks,
                "rows": result.table.num_rows,
                "avg_busbw_gbps": result.avg_busbw_gbps,
                "max_busbw_gbps": max(busbw, default=None),
                "skipped_lines": len(result.skipped_lines),
            }
        )
    if args.json:
        print_json(summaries, file=sys.stdout if not args.stdout else sys.stderr)
    else:
        for s in summaries:
            print(
                f"{s['file']}: {s['op']} x {s['nranks']} ranks, {s['rows']} rows, "
                f"avg busbw {s['avg_busbw_gbps']} GB/s, max {s['max_busbw_gbps']} GB/s",
                file=sys.stderr,
            )
    return 1 if left else 0


def add_parser(subparsers: Any) -> None:
    """Register ``export nccl`` and ``import nccl-tests``."""
    export = command_group(subparsers, "export", "run an exporter (publishes to Kafka)")
    e = export.add_parser("nccl", help="follow an NCCL Inspector dump directory")
    e.add_argument("--inspector-dir", required=True, metavar="DIR")
    e.add_argument("--job", metavar="J", help="job id (default: from nccl-inspector-<job>)")
    e.add_argument("--once", action="store_true", help="read what is there, then exit")
    e.add_argument("--stdout", action="store_true", help="print JSON Lines instead of publishing")
    e.add_argument("--interval", default="5s", help="poll interval (default 5s)")
    e.set_defaults(handler=cmd_export_nccl)

    imp = command_group(subparsers, "import", "import a saved capture (publishes to Kafka)")
    i = imp.add_parser("nccl-tests", help=f"nccl-tests stdout logs → {TOPICS.collectives}")
    i.add_argument("files", nargs="+", metavar="FILE")
    i.add_argument("--job", metavar="J", help="job id (default: the file name)")
    i.add_argument("--op", help="collective, when neither the log nor its name says")
    i.add_argument("--stdout", action="store_true", help="print rows as JSON Lines")
    i.add_argument("--json", action="store_true", help="per-file summary as JSON")
    i.set_defaults(handler=cmd_import_nccl_tests)
