"""``refinery s3 start|stop|status``: a local S3-compatible store (s3proxy, see :mod:`lab.s3`).

A lab command, registered through the ``refinery.commands`` entry point group like
``refinery broker``. ``start`` prints the endpoint on stdout and the variables to export on
stderr: with them, ``refinery land``, ``lake compact``, ``sql``, ``query`` and ``report`` use
the lake ``s3://<bucket>/refinery`` on it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from lab.s3 import LocalS3
from services.cli_parts import print_json
from services.settings import RefinerySettings


def add_parser(sub: Any) -> None:
    s = sub.add_parser("s3", help="run a local S3-compatible object store (s3proxy) on 127.0.0.1")
    ssub = s.add_subparsers(dest="action", metavar="ACTION")
    ssub.required = True
    for name, fn, hlp in (
        ("start", cmd_s3_start, "resolve the jar, start, wait until it answers"),
        ("stop", cmd_s3_stop, "stop it (SIGTERM, wait); idempotent"),
        ("status", cmd_s3_status, "pid, endpoint, bucket (exit 3 when down)"),
    ):
        sp = ssub.add_parser(name, help=hlp)
        sp.add_argument("--data-dir", help="objects and state (default $REFINERY_HOME/s3)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "start":
            sp.add_argument("--port", type=int, default=0, help="listen port (0: a free one)")
            sp.add_argument("--bucket", default="lake", help="bucket to create")
        sp.set_defaults(handler=fn)


def _local(args: argparse.Namespace, settings: RefinerySettings) -> LocalS3:
    return LocalS3(Path(args.data_dir) if args.data_dir else settings.home / "s3")


def cmd_s3_start(args: argparse.Namespace, settings: RefinerySettings) -> int:
    s3 = _local(args, settings)
    st = s3.start(port=args.port, bucket=args.bucket, progress=not args.json)
    env = st.env()
    if args.json:
        print_json({**s3.status(), "env": env})
        return 0
    print(st.endpoint)
    print(f"s3proxy ready: bucket {st.bucket}, objects in {s3.data_dir}/blobs", file=sys.stderr)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print(f"  export {exports}", file=sys.stderr)
    return 0


def cmd_s3_stop(args: argparse.Namespace, settings: RefinerySettings) -> int:
    n = _local(args, settings).stop()
    print("stopped s3proxy" if n else "no s3proxy running", file=sys.stderr)
    return 0


def cmd_s3_status(args: argparse.Namespace, settings: RefinerySettings) -> int:
    st = _local(args, settings).status()
    if args.json:
        print_json(st)
    elif not st["running"]:
        print(f"not running (data dir {st['data_dir']})")
    else:
        print(f"running: {st['endpoint']} bucket {st['bucket']} (pid {st['pid']})")
    return 0 if st["running"] else 3
