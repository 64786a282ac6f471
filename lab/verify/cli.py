"""``refinery verify --truth FILE [--lake DIR]``: compare a lake with a simulator run's truth;
exit 0 when every goal is met, 1 when one is missed, 2 on a bad argument. A missed
bound-tightness goal is printed and listed but exits 0 unless ``--strict-bounds`` is given
(:mod:`lab.verify.verdict`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from schemas.errors import ConfigError
from services.cli_parts import print_json
from services.settings import RefinerySettings


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="compare the lake with a simulator run's truth; non-zero when a goal is missed",
        description="Samples, events and collectives lost and duplicated; the share of "
        "each within their stated clock bound and the error's p50/p99/max; how tight the "
        "bounds are (p50/p99, exchange-based p50/p99, the share wider than 100 ms); alert "
        "precision and incident recall with each false alert and missed incident named; "
        "whether the straggler's cause was named. Exits 1 when a correctness figure misses "
        "its goal; a bound-tightness miss is listed but exits 0 unless --strict-bounds.",
    )
    p.add_argument("--truth", required=True, help="the truth file `refinery simulate` wrote")
    p.add_argument("--lake", help="lake directory (default $REFINERY_LAKE, ./lake)")
    p.add_argument("--rules", help="the rule file detect ran with (default deploy/rules)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--strict-bounds",
        action="store_true",
        help="exit 1 on a missed bound-tightness goal too (a loaded host widens bounds)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from lab.verify.alerts import DEFAULT_RULES
    from lab.verify.verdict import render, verify
    from services.lake.location import parse_location

    truth = Path(args.truth)
    if not truth.is_file():
        raise ConfigError(f"--truth {truth}: no such file")
    lake = Path(args.lake) if args.lake else settings.lake
    if parse_location(lake).is_local and not lake.is_dir():
        raise ConfigError(f"--lake {lake}: no such directory")
    rules = Path(args.rules) if args.rules else DEFAULT_RULES
    import duckdb

    try:
        v = verify(lake, truth, rules, strict_bounds=args.strict_bounds)
    except FileNotFoundError as e:
        raise ConfigError(f"--truth {truth}: incomplete truth ({e.filename or e})") from e
    except duckdb.IOException as e:  # a dataset the lander never wrote (not even its seed)
        first = str(e).splitlines()[0]
        raise ConfigError(f"--lake {lake}: not a lake of every dataset: {first}") from e
    if args.json:
        print_json(v.as_dict())
    else:
        print(render(v))
    return 0 if v.ok else 1
