"""``refinery acls apply|list``: least privilege as data (``deploy/acls.yaml``).

``apply`` runs as a super user (``admin``: source ``<broker data>/security/clients/admin.env``)
and prints one line per change (``add``/``remove``); a second run prints nothing and says
"no changes" on stderr. ``--json`` prints the changes as a JSON list.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from services.cli_parts import print_json
from services.settings import RefinerySettings


def cmd_apply(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.security.acls import DEFAULT_SPEC, apply_acls, load_acl_spec

    spec = load_acl_spec(Path(args.spec) if args.spec else DEFAULT_SPEC)
    changes = apply_acls(settings.kafka().librdkafka(), spec)
    if args.json:
        print_json([c.as_dict() for c in changes])
    else:
        for c in changes:
            print(c)
    if not changes:
        print(f"no changes: {len(spec)} ACLs match the spec", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.security.acls import DEFAULT_SPEC, load_acl_spec

    spec = load_acl_spec(Path(args.spec) if args.spec else DEFAULT_SPEC)
    if args.json:
        print_json([a.__dict__ for a in spec])
    else:
        for a in spec:
            print(a)
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``acls`` on an argparse sub-parser collection."""
    p = subparsers.add_parser("acls", help="ACLs as data (deploy/acls.yaml), least privilege")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    a = sub.add_parser("apply", help="make the cluster's ACLs match the spec; prints changes")
    a.add_argument("--spec", help="ACL spec file (default deploy/acls.yaml)")
    a.add_argument("--json", action="store_true", help="changes as JSON")
    a.set_defaults(handler=cmd_apply)
    ls = sub.add_parser("list", help="the ACLs the spec grants")
    ls.add_argument("--spec")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_list)
