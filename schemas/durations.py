"""Durations as people write them, read one way everywhere: the exporters' ``--interval``,
detect's rule files, the lab's commands.

``500ms``, ``1s``, ``2m``, ``1h``, ``250us``, ``10ns``; a bare number (``30``, ``1.5``, or an
int or float from a YAML file) is seconds. Blanks around the number and the unit are allowed;
a sign is not.

>>> parse_duration_ns("500ms"), parse_duration_ns(2), parse_duration_s("1.5m")
(500000000, 2000000000, 90.0)
>>> parse_duration_ns("0", positive=True)
Traceback (most recent call last):
    ...
schemas.errors.ConfigError: '0': expected a positive duration like 1s or 500ms
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator

from schemas.errors import ConfigError

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ns|us|ms|s|m|h)?\s*")
_UNIT_NS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def parse_duration_ns(value: str | float, *, positive: bool = False, name: str = "") -> int:
    """``value`` in nanoseconds (rounded to the nearest). Raises :class:`ConfigError`, one
    line naming the value (after ``name``, e.g. the flag, when given), when it is not a
    duration, is negative, or is 0 where ``positive``."""
    said = f"{name} {value!r}" if name else repr(value)
    if isinstance(value, bool):  # a YAML ``yes``: not a number of seconds
        raise ConfigError(f"{said}: expected a duration like 30s, 5m or 500ms")
    if isinstance(value, int | float):
        if not value >= 0:  # negative or NaN
            raise ConfigError(f"{said}: a duration cannot be negative")
        seconds = float(value)
        unit = 10**9
    else:
        m = _DURATION.fullmatch(str(value))
        if m is None:
            raise ConfigError(f"{said}: expected a duration like 30s, 5m or 500ms")
        seconds, unit = float(m.group(1)), _UNIT_NS[m.group(2) or "s"]
    if not math.isfinite(seconds):
        raise ConfigError(f"{said}: too long a duration")
    ns = value * unit if isinstance(value, int) else round(seconds * unit)
    if positive and ns <= 0:
        raise ConfigError(f"{said}: expected a positive duration like 1s or 500ms")
    return ns


def parse_duration_s(value: str | float, *, positive: bool = False, name: str = "") -> float:
    """``value`` in seconds; see :func:`parse_duration_ns`."""
    return parse_duration_ns(value, positive=positive, name=name) / 1e9


def _validated_ns(value: Any) -> int:
    try:
        return parse_duration_ns(value)
    except ConfigError as e:  # pydantic reports a ValueError as a validation error
        raise ValueError(str(e)) from None


# A pydantic field of a duration in nanoseconds, written as above (a rule file's ``for: 5m``,
# a topic spec's ``send_delay: 200ms``).
DurationNs = Annotated[int, BeforeValidator(_validated_ns)]
