"""refinery: streaming telemetry refinery for GPU/CPU clusters (Kafka in, Parquet out).

Conventions (kcat / duckdb / kubectl style): ``--help`` on every command; results on stdout,
progress and errors on stderr; ``--json`` for machine-readable output; exit codes 0 success,
1 runtime failure, 2 usage or configuration error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import ValidationError

from schemas.errors import BrokerError, ConfigError, RefineryError
from services.cli_parts import one_line, print_json
from services.heap import RETURNS_ARROW_PAGES, keep_arrow_pages
from services.settings import RefinerySettings, load_settings

# The product's modules that contribute sub-commands through ``add_parser(subparsers)``.
COMMAND_MODULES: tuple[str, ...] = (
    "services.exporters.node_cli",
    "services.exporters.firmware_cli",
    "services.exporters.nccl_cli",
    "services.exporters.scrape",
    "services.catalog_cli",
    "services.topology.cli",
    "services.worker.cli",
    "services.lake.cli",
    "services.alerts.cli",
    "services.detect.cli",
    "services.security.cli",
    "services.report.cli",
)
# More command modules, each offering ``add_parser(subparsers)``, named by installed packages:
# the lab's (broker, simulate, demo, bench, verify) in a development install.
COMMAND_GROUP = "refinery.commands"

Handler = Callable[[argparse.Namespace, RefinerySettings], int]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- topics ------------------------------------------------------------------------------


def cmd_topics_apply(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.topics import DEFAULT_SPEC, apply_topics, load_topic_specs

    specs = load_topic_specs(Path(args.spec) if args.spec else DEFAULT_SPEC, prefix=args.prefix)
    changes = apply_topics(settings.kafka().librdkafka(), specs)
    if args.json:
        print_json([c.__dict__ for c in changes])
    else:
        for c in changes:
            print(c)
        if not changes:
            print(f"no changes: {len(specs)} topics match the spec", file=sys.stderr)
    return 1 if any(c.action == "refused" for c in changes) else 0


def cmd_topics_list(args: argparse.Namespace, settings: RefinerySettings) -> int:
    from services.topics import DEFAULT_SPEC, load_topic_specs

    specs = load_topic_specs(Path(args.spec) if args.spec else DEFAULT_SPEC)
    if args.json:
        print_json([s.model_dump() for s in specs])
    else:
        for s in specs:
            print(f"{s.name:<24} {s.partitions:>3}p  key={s.key:<12} {s.what}")
    return 0


# --- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="refinery", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("topics", help="topic specs as data (deploy/topics.yaml)")
    tsub = t.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    tsub.required = True
    ta = tsub.add_parser("apply", help="make the cluster match the spec; prints changes")
    ta.add_argument("--spec", help="topic spec file (default deploy/topics.yaml)")
    ta.add_argument("--prefix", default="", help="prefix every topic name")
    ta.add_argument("--json", action="store_true")
    ta.set_defaults(handler=cmd_topics_apply)
    tl = tsub.add_parser("list", help="the topics of the spec")
    tl.add_argument("--spec")
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(handler=cmd_topics_list)

    for mod in command_modules():
        mod.add_parser(sub)
    return p


def command_modules(offered: Iterable[EntryPoint] | None = None) -> list[ModuleType]:
    """The modules of COMMAND_MODULES, then those of the entry points ``offered`` (default:
    the installed COMMAND_GROUP), by name. An entry point whose own module is not installed
    is skipped: pyproject.toml names the lab's modules, which the product image leaves out.
    Any other import error (a module that is there but fails to import, or imports something
    missing) propagates."""
    if offered is None:
        offered = entry_points(group=COMMAND_GROUP)
    mods = [importlib.import_module(name) for name in COMMAND_MODULES]
    for ep in sorted(offered, key=lambda ep: ep.name):
        try:
            mods.append(importlib.import_module(ep.module))
        except ModuleNotFoundError as e:
            if e.name is None or not (ep.module == e.name or ep.module.startswith(e.name + ".")):
                raise  # not the entry point's module (nor a package of it) that is missing
    return mods


def _kafka_failure(e: BaseException) -> str | None:
    """One line for a Kafka client's failure to use the cluster (confluent-kafka's
    KafkaException, aiokafka's errors), naming the address; None for anything else."""
    from services.kafka.log import describe

    mod = type(e).__module__
    if type(e).__name__ == "KafkaException" or mod.startswith(("aiokafka", "kafka.")):
        try:
            bootstrap = load_settings().kafka().bootstrap_servers
        except ValidationError:
            bootstrap = "the configured address"
        return describe(e, bootstrap)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    command = next(iter(sys.argv[1:] if argv is None else argv), None)
    if command not in RETURNS_ARROW_PAGES:
        keep_arrow_pages()  # before build_parser: its command modules load pyarrow
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        handler: Handler = args.handler
        return handler(args, settings)
    except ValidationError as e:
        print(f"refinery: error: {one_line(e)}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        print(f"refinery: error: {e}", file=sys.stderr)
        return 2
    except BrokerError as e:
        print(f"refinery: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a stage of a long-running command failed: say which
        print(f"refinery: {e}", file=sys.stderr)
        return 1
    except RefineryError as e:
        print(f"refinery: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `refinery ... | head` closed our stdout: not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("refinery: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a state or data path that cannot be created, read or written
        where = f": {e.filename}" if e.filename else ""
        print(f"refinery: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except Exception as e:
        line = _kafka_failure(e)
        if line is None:
            raise  # a bug: its traceback is what a report needs
        print(f"refinery: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
