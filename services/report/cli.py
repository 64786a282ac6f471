"""``refinery report [--lake DIR] [--job J] [--from T --to T] --out report.html``.

Writes one HTML file that opens offline (inline CSS, SVG and a tooltip script; no URL) with
five panels: fabric congestion by rail and switch port, a job's NCCL stragglers beside the
congestion on their path, GPU SM clocks and throttle reasons, clock offsets per source, and
data quality. ``T`` is an ISO 8601 time (``2026-01-01T00:10:00``, UTC unless it carries an
offset). Exit codes: 0 written; 1 no lake or an empty lake (one line on stderr, nothing
written) or a DuckDB error; 2 a bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from schemas.errors import RefineryError
from services.lake import sqlload
from services.lake.backend import open_writer
from services.lake.location import parse_location
from services.lake.store import StoreAccessError
from services.report import data
from services.report.render import render_report
from services.settings import RefinerySettings


class EmptyLakeError(RefineryError):
    """The lake directory is missing or holds no data to report on."""


def parse_time(text: str) -> int:
    """An ISO 8601 time as epoch ns (UTC unless it carries an offset); ValueError if not."""
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO 8601 time (e.g. 2026-01-01T00:10:00)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


def build_report(
    lake: Path,
    *,
    start_ns: int | None = None,
    end_ns: int | None = None,
    job: str | None = None,
    skew_ms: float = 5.0,
) -> str:
    """The report page for ``lake``. Raises EmptyLakeError when ``lake`` is not a directory
    or holds no rows; ValueError for an empty window; duckdb.Error propagates. Creates the
    zero-row seed files a lake needs for its views to bind when it can (as ``refinery sql``)."""
    if parse_location(lake).is_local and not lake.is_dir():
        raise EmptyLakeError(f"no lake at {lake}")
    with contextlib.suppress(OSError, StoreAccessError):
        open_writer(lake).ensure_seeds()
    con = sqlload.connect(lake)
    try:
        if data.lake_rows(con) == 0:
            raise EmptyLakeError(f"lake {lake} holds no data: nothing to report")
        scope = data.resolve_scope(con, start_ns, end_ns, job)
        return render_report(con, scope, lake=str(lake), skew_ms=skew_ms)
    finally:
        con.close()


def cmd_report(args: argparse.Namespace, settings: RefinerySettings) -> int:
    """Handler of ``refinery report``: write ``args.out``, print its path on stdout."""
    lake = Path(args.lake) if args.lake else settings.lake
    start = parse_time(args.start) if args.start else None
    end = parse_time(args.end) if args.end else None
    t0 = time.monotonic()
    try:
        page = build_report(lake, start_ns=start, end_ns=end, job=args.job, skew_ms=args.skew_ms)
    except EmptyLakeError as e:
        print(f"refinery: {e}", file=sys.stderr)
        return 1
    except duckdb.Error as e:
        print(f"refinery: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    took = time.monotonic() - t0
    print(f"report: {len(page) / 1024:.0f} KiB in {took:.1f} s", file=sys.stderr)
    print(out)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``report`` on the main CLI's sub-parsers."""
    p = sub.add_parser("report", help="one self-contained HTML report (figures) of the lake")
    p.add_argument("--lake", help="lake root (default $REFINERY_LAKE)")
    p.add_argument("--job", help="only this job (GPU, fabric and clock panels: its nodes)")
    p.add_argument("--from", dest="start", metavar="T", help="window start, ISO 8601 (UTC)")
    p.add_argument("--to", dest="end", metavar="T", help="window end, exclusive")
    p.add_argument(
        "--skew-ms", type=float, default=5.0, help="arrival skew above which a rank straggles"
    )
    p.add_argument("--out", required=True, help="HTML file to write")
    p.set_defaults(handler=cmd_report)
