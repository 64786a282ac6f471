"""``refinery demo``: the main job on a fresh machine (see lab.demo.run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from services.settings import RefinerySettings


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole pipeline on a simulated cluster with faults, then what the lake says",
        description="Start a local broker (unless REFINERY_BOOTSTRAP_SERVERS is set), the "
        "worker, detect and the lander; publish a simulated cluster with a PFC storm, a "
        "throttling GPU, an XID, clock skew, duplicates and malformed records; wait until "
        "everything is landed; stop what it started; print the accounting, the alerts with "
        "their causes and the top findings.",
    )
    p.add_argument("--quick", action="store_true", help="8 nodes, 25 s (CI)")
    p.add_argument("--nodes", type=int, help="nodes (default 32; --quick 8)")
    p.add_argument("--duration", type=int, help="simulated seconds (default 60; --quick 25)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--faults", help="fault spec (see `refinery simulate --help`)")
    p.add_argument("--lake", help="lake directory (default $REFINERY_LAKE, ./lake)")
    p.add_argument("--report", help="also write the HTML report here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--workers", type=int, default=1, help="refining workers (default 1)")
    p.add_argument("--detects", type=int, default=1, help="detect replicas (default 1)")
    p.add_argument("--landers", type=int, default=1, help="lake landers (default 1)")
    p.add_argument(
        "--s3",
        action="store_true",
        help="land the lake on a local S3-compatible server (s3proxy, started and stopped)",
    )
    p.add_argument(
        "--kill",
        action="store_true",
        help="kill -9 one detect replica, one lander and one worker while publishing "
        "(each started again)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from lab.demo.run import FAULTS, DemoOptions, dump_json, render, run_demo

    quick = args.quick
    lake = Path(args.lake) if args.lake else settings.lake
    if not args.s3 and lake.exists() and any(lake.iterdir()):
        print(
            f"refinery: error: lake {lake} is not empty; pass --lake DIR or remove it",
            file=sys.stderr,
        )
        return 2
    opts = DemoOptions(
        nodes=args.nodes or (8 if quick else 32),
        cpus=16 if quick else 32,
        duration_s=args.duration or (25 if quick else 60),
        seed=args.seed,
        faults=args.faults or FAULTS,
        lake=lake,
        report=Path(args.report) if args.report else None,
        workers=args.workers,
        detects=args.detects,
        landers=args.landers,
        kill=args.kill,
        s3=args.s3,
    )
    for flag in ("workers", "detects", "landers"):
        if getattr(args, flag) < 1:
            print(f"refinery: error: --{flag} must be at least 1", file=sys.stderr)
            return 2

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    summary = run_demo(opts, settings, say)
    if args.json:
        dump_json(summary)
    else:
        print(render(summary))
    ok = summary["accounting"]["balanced"] and summary["verify"]["ok"]
    if not summary["verify"]["ok"]:
        say("refinery demo: missed: " + "; ".join(summary["verify"]["misses"]))
    return 0 if ok else 1
