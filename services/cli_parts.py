"""What the command modules share: a sub-command group several modules add to, results as
JSON on stdout, and an error as one line (the conventions of :mod:`services.cli`).

>>> print_json({"b": 1, "a": [2]}, indent=None)
{"b": 1, "a": [2]}
>>> one_line(ValueError("no such table:\\n  LINE 1: SELECT"))
'no such table: LINE 1: SELECT'
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from pydantic import ValidationError


def command_group(sub: Any, name: str, help_text: str) -> Any:
    """The sub-command group ``name`` (e.g. ``export``), created on first use, so that several
    modules can each add their commands under it."""
    parser = sub.choices.get(name) or sub.add_parser(name, help=help_text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    group = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    group.required = True
    return group


def print_json(obj: object, *, indent: int | None = 2, file: TextIO | None = None) -> None:
    """``obj`` as JSON and a newline on ``file`` (stdout); what JSON cannot hold (paths,
    times) as its ``str``."""
    out = file or sys.stdout
    json.dump(obj, out, indent=indent, default=str)
    out.write("\n")


def one_line(e: BaseException) -> str:
    """An error on one line: a validation error's every complaint, a settings field named by
    its environment variable; anything else's message with its line breaks flattened."""
    if not isinstance(e, ValidationError):
        return " ".join(str(e).split())
    env = e.title.endswith("Settings")
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        name = f"REFINERY_{loc.upper()}" if env else loc or e.title
        parts.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
