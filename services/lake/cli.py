"""``refinery land``, ``refinery lake compact``, ``refinery sql`` and ``refinery query``.

:func:`add_parser` registers the commands on the main CLI's sub-parsers (handlers take
``(args, settings)`` and return the exit code). Errors in user SQL print DuckDB's message
on one line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import duckdb

from schemas.errors import RefineryError
from services.cli_parts import one_line, print_json
from services.heap import keep_heap
from services.lake import sqlload
from services.lake.backend import (
    check_lake,
    connect_views,
    has_data,
    open_compactor,
    open_writer,
)
from services.lake.compact import CompactionReport
from services.lake.datasets import DATASETS
from services.lake.iceberg import IcebergSettings
from services.lake.land import LandingService
from services.lake.layout import parse_hour
from services.lake.location import LakeLocation, parse_location
from services.settings import RefinerySettings

if TYPE_CHECKING:
    from services.lake.s3store import S3Settings

# --- land and compact --------------------------------------------------------------------


def _topic_map(specs: Sequence[str] | None) -> dict[str, str]:
    if not specs:
        return {d.topic: d.name for d in DATASETS.values()}
    out = {}
    for spec in specs:
        topic, _, ds = spec.partition("=")
        if not ds:
            by_topic = {d.topic: d.name for d in DATASETS.values()}
            ds = by_topic.get(topic) or (topic if topic in DATASETS else "")
            topic = DATASETS[ds].topic if topic in DATASETS else topic
        if ds not in DATASETS:
            raise ValueError(f"{spec!r}: no dataset for topic (use TOPIC=DATASET)")
        out[topic] = ds
    return out


def _lake(settings: RefinerySettings) -> tuple[LakeLocation, S3Settings | None]:
    """The lake's location and, for object storage, the store's settings (read here from
    the environment, like the Kafka settings); ConfigError for an unsupported scheme."""
    loc = parse_location(settings.lake)
    if loc.is_local:
        return loc, None
    from services.lake.s3store import S3Settings

    return loc, S3Settings()


def _iceberg(fmt: str | None = None) -> IcebergSettings:
    """The lake format settings (REFINERY_LAKE_FORMAT ...), ``fmt`` (a flag) overriding."""
    ice = IcebergSettings()
    return ice if fmt is None else ice.model_copy(update={"lake_format": fmt})


def cmd_land(args: argparse.Namespace, settings: RefinerySettings) -> int:
    conf = {**settings.kafka().librdkafka(), "group.id": args.group}
    ice = _iceberg(args.format)
    topics = _topic_map(args.topics)
    if ice.is_iceberg and len(set(topics.values())) < len(topics):
        raise ValueError("an Iceberg lake lands one topic per dataset (its offsets by partition)")
    max_age = args.max_age if args.max_age is not None else 20.0 if ice.is_iceberg else 2.0
    if args.instance_id:  # static membership: a restarted lander takes over at once
        conf["group.instance.id"] = args.instance_id
    from services.kafka.log import require_cluster

    lake, s3 = _lake(settings)
    check_lake(lake, s3=s3)  # credentials, bucket, endpoint: one line before consuming
    require_cluster(conf)  # first contact: one line naming the address and the cause
    writer = open_writer(lake, s3=s3, iceberg=ice)
    compactor = None if args.no_compact else open_compactor(lake, s3=s3, iceberg=ice)
    svc = LandingService(
        conf,
        writer,
        topics,
        max_rows=args.max_rows,
        max_age_s=max_age,
        compactor=compactor,
        crash_at=args.crash_at,
    )
    keep_heap()
    try:
        stats = svc.run(once_idle_s=args.once_idle)
    except OSError as e:  # disk full, read-only, gone: nothing is committed past what landed
        raise RuntimeError(
            f"land: cannot write the lake at {lake}: {e.strerror or e}; offsets stay "
            "at the last landed file, so a restart once the file system is fixed lands the rest"
        ) from e
    print(json.dumps(stats.__dict__), file=sys.stderr)
    return 0


def cmd_compact(args: argparse.Namespace, settings: RefinerySettings) -> int:
    lake, s3 = _lake(settings)
    check_lake(lake, s3=s3)
    c = open_compactor(lake, s3=s3, iceberg=_iceberg(), grace_s=args.grace, crash_at=args.crash_at)
    datasets = [args.dataset] if args.dataset else list(DATASETS)
    report = CompactionReport()
    for ds in datasets:
        c.recover(ds)
    if args.hour:
        date, hour = parse_hour(args.hour)
        for ds in datasets:
            report.add(c.compact_hour(ds, date, hour))
    elif args.all_closed:
        report.add(c.compact_closed(datasets, close_after_s=args.close_after, wait=True))
    else:
        raise ValueError("give --hour YYYY-MM-DDTHH or --all-closed")
    for line in report.skipped:
        print(f"skipped {line}", file=sys.stderr)
    print(
        json.dumps(
            {
                "written": [str(p) for p in report.written],
                "merged": report.merged,
                "removed": report.removed,
            }
        )
    )
    return 0


# --- sql and query -----------------------------------------------------------------------


def _connect(settings: RefinerySettings) -> duckdb.DuckDBPyConnection:
    lake, s3 = _lake(settings)
    # never create one here: a mistyped path must not answer "0 rows"
    if lake.path is not None and not lake.path.is_dir():
        raise RefineryError(f"no lake at {lake}: no such directory (REFINERY_LAKE)")
    check_lake(lake, s3=s3)
    ice = _iceberg()
    if not ice.is_iceberg and not has_data(lake, s3=s3):
        print(f"refinery: the lake at {lake} holds no data yet", file=sys.stderr)
    # views need every dataset to bind; a read-only lake has its seeds or the error says so
    con: duckdb.DuckDBPyConnection = connect_views(lake, s3=s3, iceberg=ice)
    return con


def cmd_iceberg_sql(args: argparse.Namespace, settings: RefinerySettings) -> int:
    """Print a DuckDB CLI init script over the Iceberg tables' current snapshots."""
    from services.lake.iceberg import SnapshotFiles
    from services.lake.iceberg_sink import IcebergLakeSink

    lake, s3 = _lake(settings)
    ice = _iceberg("iceberg")
    sink = open_writer(lake, s3=s3, iceberg=ice)
    assert isinstance(sink, IcebergLakeSink)
    sink.ensure_seeds()
    files = SnapshotFiles(sink.catalog, ice.iceberg_namespace, sink.seed_path)
    print(sqlload.iceberg_init_sql(lake.url, files))
    return 0


def _emit(cur: duckdb.DuckDBPyConnection, fmt: str) -> None:
    if cur.description is None:
        return
    names = [d[0] for d in cur.description]
    rows = cur.fetchall()
    if fmt == "json":
        print_json([dict(zip(names, r, strict=True)) for r in rows], indent=None)
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(names)
        w.writerows(rows)
    else:
        cells = [names] + [["NULL" if v is None else str(v) for v in r] for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(names))]
        for i, c in enumerate(cells):
            print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
            if i == 0:
                print("  ".join("-" * w for w in widths))


def _fmt(args: argparse.Namespace) -> str:
    return "json" if args.json else "csv" if args.csv else "table"


def cmd_sql(args: argparse.Namespace, settings: RefinerySettings) -> int:
    con = _connect(settings)
    if args.command is not None:
        try:
            _emit(con.execute(args.command), _fmt(args))
        except duckdb.Error as e:
            print(f"refinery: {one_line(e)}", file=sys.stderr)
            return 1
        return 0
    interactive = sys.stdin.isatty()
    buf: list[str] = []
    status = 0
    while True:
        if interactive:
            sys.stderr.write("refinery> " if not buf else "     ...> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        buf.append(line)
        if not line.rstrip().endswith(";"):
            continue
        stmt, buf = "".join(buf), []
        try:
            sqlload.refresh(con)
            _emit(con.execute(stmt), _fmt(args))
        except duckdb.Error as e:
            print(f"refinery: {one_line(e)}", file=sys.stderr)
            status = 1
            if not interactive:
                return 1
    return 0 if interactive else status


def cmd_query(args: argparse.Namespace, settings: RefinerySettings) -> int:
    queries = sqlload.list_queries()
    if args.list or not args.name:
        for q in queries.values():
            sig = ", ".join(f"{p.name}={p.default}" for p in q.params.values())
            print(f"{q.name}({sig})\n    {q.description}")
        return 0
    params: dict[str, str] = {}
    for kv in args.param or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--param {kv!r} is not k=v")
        params[k] = v
    con = _connect(settings)
    try:
        _emit(sqlload.run_query(con, args.name, params), _fmt(args))
    except duckdb.Error as e:
        print(f"refinery: {one_line(e)}", file=sys.stderr)
        return 1
    return 0


# --- registration ------------------------------------------------------------------------


def _formats(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="rows as a JSON array of objects")
    g.add_argument("--csv", action="store_true", help="rows as CSV with a header")


def add_parser(sub: Any) -> None:
    """Register land, lake compact, sql and query on the main CLI's sub-parsers."""
    p = sub.add_parser("land", help="land Kafka topics into the Parquet lake, exactly once")
    p.add_argument("--topics", nargs="+", metavar="TOPIC[=DATASET]", help="default: all")
    p.add_argument("--group", default="refinery-land", help="consumer group")
    p.add_argument("--instance-id", help="static group member id (restart without rebalance)")
    p.add_argument("--once-idle", type=float, metavar="S", help="exit after S s without data")
    p.add_argument("--max-rows", type=int, default=500_000, help="flush a partition at N rows")
    p.add_argument("--max-age", type=float, help="flush a partition after S s (2; iceberg: 20)")
    p.add_argument("--format", choices=["parquet", "iceberg"], help="default: REFINERY_LAKE_FORMAT")
    p.add_argument("--no-compact", action="store_true", help="do not compact closed hours")
    p.add_argument("--crash-at", help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_land)

    lk = sub.add_parser("lake", help="lake maintenance")
    lsub = lk.add_subparsers(dest="lake_cmd", required=True)
    c = lsub.add_parser("compact", help="merge an hour's small files (atomic, crash-safe)")
    c.add_argument("--dataset", choices=sorted(DATASETS))
    c.add_argument("--hour", metavar="YYYY-MM-DDTHH")
    c.add_argument("--all-closed", action="store_true", help="every hour that has ended")
    c.add_argument("--close-after", type=float, default=600.0, help="s after an hour ends")
    c.add_argument("--grace", type=float, default=30.0, help="keep merged inputs S s")
    c.add_argument("--crash-at", help=argparse.SUPPRESS)
    c.set_defaults(handler=cmd_compact)
    i = lsub.add_parser("iceberg-sql", help="a DuckDB CLI init script over the Iceberg tables")
    i.set_defaults(handler=cmd_iceberg_sql)

    s = sub.add_parser("sql", help="DuckDB SQL over the lake with the sql/ views loaded")
    s.add_argument("-c", dest="command", metavar="QUERY", help="run QUERY and exit")
    _formats(s)
    s.set_defaults(handler=cmd_sql)

    q = sub.add_parser("query", help="run a named query from sql/queries")
    q.add_argument("name", nargs="?")
    q.add_argument("--param", action="append", metavar="K=V")
    q.add_argument("--list", action="store_true", help="list the named queries")
    _formats(q)
    q.set_defaults(handler=cmd_query)
