"""Alert rules as data: the models of a rule file and its loader.

A rule file is YAML with a ``rules`` list; each rule has a unique ``name`` and a ``kind``:

==================  ===============================================================
kind                fires when
==================  ===============================================================
``threshold``       a metric's ``value`` or ``rate`` is above ``above`` (or below
                    ``below``) for ``for`` seconds; resolves past ``resolve``
``event``           an event occurs (``xid``, ``link_down``, ``throttle``, ``sel``...);
                    one alert per occurrence; resolves on ``resolve_on`` (e.g.
                    ``link_up``) or ``resolve_after`` a quiet time
``bitmask``         a bitmask metric (``gpu.clock_event_reasons``) gains any of ``bits``;
                    resolves when none of them is set
``clock``           a source's clock offset exceeds ``above`` (or is flagged)
``silent``          a source sent nothing for ``intervals`` scrape intervals
``frozen``          a source repeated identical values on every series ``intervals`` times
``deadletter_rate`` dead letters per second over ``window`` exceed ``above``
``freshness``       refined data is older than ``above`` when it reaches the detector
==================  ===============================================================

Durations are numbers of seconds or strings ``"500ms"``, ``"30s"``, ``"5m"``, ``"1h"``.
``summary`` is a :meth:`str.format` template over the keys listed in :data:`SUMMARY_KEYS`.

A mistake is reported at load as ONE line naming the rule and the field::

    rules default.yaml: rule gpu_temp_high: above: Input should be a valid number
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.catalog import Catalog, Kind
from schemas.durations import DurationNs
from schemas.errors import ConfigError
from schemas.records import Severity

WHERE_COLUMNS = frozenset(
    {"node", "device", "rack", "pod", "leaf", "leaf_port", "spine", "rail", "nic", "gpu"}
    | {"numa", "nvlink_domain", "job", "rank", "exporter"}
)
EVENT_KINDS = frozenset({"xid", "link_down", "link_up", "throttle", "sel"})

_COMMON = {"rule", "severity", "entity", "node", "device", "job"}
_ENRICH = {"rack", "pod", "leaf", "leaf_port", "spine", "rail", "nic", "gpu", "rank"}
SUMMARY_KEYS: dict[str, frozenset[str]] = {
    "threshold": frozenset(
        _COMMON | _ENRICH | {"metric", "value", "unit", "threshold", "resolve", "for_s"}
    ),
    "event": frozenset(_COMMON | {"event", "code", "meaning", "message"}),
    "bitmask": frozenset(_COMMON | _ENRICH | {"metric", "value", "reasons"}),
    "clock": frozenset(_COMMON | {"source", "offset_ms", "error_ms", "threshold_ms"}),
    "silent": frozenset(_COMMON | {"source", "intervals", "silent_s"}),
    "frozen": frozenset(_COMMON | {"source", "intervals"}),
    "deadletter_rate": frozenset(_COMMON | {"rate", "threshold", "window_s"}),
    "freshness": frozenset(_COMMON | {"lag_s", "threshold_s"}),
}


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
    severity: Severity = Severity.WARNING
    summary: str = "{rule} on {entity}"
    description: str | None = None


class ThresholdRule(_Rule):
    kind: Literal["threshold"]
    metric: str
    field: Literal["value", "rate", "delta", "auto"] = "auto"  # auto: rate (counters) or value
    above: float | None = None
    below: float | None = None
    resolve: float | None = None  # default: the firing threshold (no hysteresis band)
    for_ns: DurationNs = Field(default=0, alias="for")
    where: dict[str, str | int | list[str | int]] = Field(default_factory=dict)
    device_regex: str | None = None


class EventRule(_Rule):
    kind: Literal["event"]
    event: str = ""
    metric: str | None = None  # sample-borne events (gpu.xid): onsets of a new nonzero value
    codes: list[int] = Field(default_factory=list)  # only these codes (empty: all)
    resolve_on: str | None = None
    resolve_after_ns: DurationNs = Field(default=300_000_000_000, alias="resolve_after")
    severity_from_table: bool = True  # xid: take severity from the XID table


class BitmaskRule(_Rule):
    kind: Literal["bitmask"]
    metric: str = "gpu.clock_event_reasons"
    bits: list[str] = Field(min_length=1)
    for_ns: DurationNs = Field(default=0, alias="for")
    where: dict[str, str | int | list[str | int]] = Field(default_factory=dict)


class ClockRule(_Rule):
    kind: Literal["clock"]
    above_ns: DurationNs = Field(default=1_000_000_000, alias="above")
    resolve_ns: DurationNs | None = Field(default=None, alias="resolve")
    flagged: bool = True  # also fire when the refiner flags the source


class SilentRule(_Rule):
    kind: Literal["silent"]
    intervals: int = Field(default=3, ge=1)
    interval_ns: DurationNs | None = Field(default=None, alias="interval")  # None: learned


class FrozenRule(_Rule):
    kind: Literal["frozen"]
    intervals: int = Field(default=3, ge=1)


class DeadletterRule(_Rule):
    kind: Literal["deadletter_rate"]
    above: float = Field(gt=0)
    resolve: float | None = None
    window_ns: DurationNs = Field(default=60_000_000_000, alias="window")


class FreshnessRule(_Rule):
    kind: Literal["freshness"]
    above_ns: DurationNs = Field(alias="above")
    resolve_ns: DurationNs | None = Field(default=None, alias="resolve")
    for_ns: DurationNs = Field(default=0, alias="for")


Rule = (
    ThresholdRule
    | EventRule
    | BitmaskRule
    | ClockRule
    | SilentRule
    | FrozenRule
    | DeadletterRule
    | FreshnessRule
)
_BY_KIND: dict[str, type[BaseModel]] = {
    "threshold": ThresholdRule,
    "event": EventRule,
    "bitmask": BitmaskRule,
    "clock": ClockRule,
    "silent": SilentRule,
    "frozen": FrozenRule,
    "deadletter_rate": DeadletterRule,
    "freshness": FreshnessRule,
}


def _fail(src: str, rule: str, field: str, msg: str) -> ConfigError:
    return ConfigError(f"rules {src}: rule {rule}: {field}: {msg}".splitlines()[0])


def _check_summary(src: str, rule: _Rule, kind: str) -> None:
    allowed = SUMMARY_KEYS[kind]
    try:
        for _, key, _, _ in string.Formatter().parse(rule.summary):
            if key is None:
                continue
            base = re.split(r"[.\[]", key, maxsplit=1)[0]
            if base not in allowed:
                raise _fail(
                    src, rule.name, "summary", f"unknown key {{{base}}}; use {sorted(allowed)}"
                )
    except ValueError as e:
        raise _fail(src, rule.name, "summary", str(e)) from e


def _check_semantics(src: str, r: Any, catalog: Catalog | None) -> None:
    if isinstance(r, ThresholdRule):
        if (r.above is None) == (r.below is None):
            raise _fail(src, r.name, "above", "set exactly one of above or below")
        fire = r.above if r.above is not None else r.below
        if r.resolve is not None and fire is not None:
            bad = r.resolve > fire if r.above is not None else r.resolve < fire
            if bad:
                side = "above" if r.above is not None else "below"
                raise _fail(src, r.name, "resolve", f"must be on the far side of {side}")
        for col in r.where:
            if col not in WHERE_COLUMNS:
                raise _fail(src, r.name, f"where.{col}", f"not one of {sorted(WHERE_COLUMNS)}")
        if r.device_regex is not None:
            try:
                re.compile(r.device_regex)
            except re.error as e:
                raise _fail(src, r.name, "device_regex", str(e)) from e
    if isinstance(r, BitmaskRule):
        for col in r.where:
            if col not in WHERE_COLUMNS:
                raise _fail(src, r.name, f"where.{col}", f"not one of {sorted(WHERE_COLUMNS)}")
    if isinstance(r, EventRule):
        if not r.event and not r.metric:
            raise _fail(src, r.name, "event", "set event (xid, link_down, ...) or metric")
        if r.event and r.event not in EVENT_KINDS:
            raise _fail(src, r.name, "event", f"not one of {sorted(EVENT_KINDS)}")
        if r.resolve_on is not None and r.resolve_on not in EVENT_KINDS:
            raise _fail(src, r.name, "resolve_on", f"not one of {sorted(EVENT_KINDS)}")
    if (
        isinstance(r, ClockRule | FreshnessRule)
        and r.resolve_ns is not None
        and r.resolve_ns > r.above_ns
    ):
        raise _fail(src, r.name, "resolve", "must not exceed above")
    if isinstance(r, DeadletterRule) and r.resolve is not None and r.resolve > r.above:
        raise _fail(src, r.name, "resolve", "must not exceed above")
    metric = getattr(r, "metric", None)
    if catalog is not None and metric is not None:
        if metric not in catalog:
            raise _fail(src, r.name, "metric", f"unknown metric {metric!r}")
        m = catalog[metric]
        if isinstance(r, BitmaskRule):
            if m.kind is not Kind.BITMASK:
                raise _fail(src, r.name, "metric", f"{metric} is not a bitmask")
            names = set(m.bits.values())
            for b in r.bits:
                if b not in names:
                    raise _fail(src, r.name, "bits", f"{b!r} is not a bit of {metric}")


def parse_rules(doc: Any, src: str = "<rules>", catalog: Catalog | None = None) -> list[Rule]:
    """Validate a parsed rule document; raises :class:`ConfigError` (one line) on a mistake."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise ConfigError(f"rules {src}: expected a mapping with a 'rules' list")
    out: list[Rule] = []
    seen: set[str] = set()
    for i, entry in enumerate(doc["rules"]):
        name = str(entry.get("name", f"#{i}")) if isinstance(entry, dict) else f"#{i}"
        if not isinstance(entry, dict):
            raise _fail(src, name, "entry", "expected a mapping")
        kind = entry.get("kind")
        model = _BY_KIND.get(str(kind))
        if model is None:
            raise _fail(src, name, "kind", f"{kind!r} is not one of {sorted(_BY_KIND)}")
        try:
            rule: Any = model.model_validate(entry)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "entry"
            raise _fail(src, name, field, err["msg"]) from e
        if rule.name in seen:
            raise _fail(src, name, "name", "defined twice")
        seen.add(rule.name)
        _check_semantics(src, rule, catalog)
        _check_summary(src, rule, str(kind))
        out.append(rule)
    return out


def load_rules(path: Path, catalog: Catalog | None = None) -> list[Rule]:
    """Read and validate a rule file (see the module docstring for the format)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"rules {path}: cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"rules {path.name}: not valid YAML: {e}".splitlines()[0]) from e
    return parse_rules(doc, path.name, catalog)


class _Fmt(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def render(template: str, values: dict[str, Any]) -> str:
    """Fill a summary template; a value that does not fit its format spec prints as is."""
    try:
        return template.format_map(_Fmt(values))
    except (ValueError, TypeError, IndexError, KeyError, AttributeError):
        plain = re.sub(r"\{(\w+)[^}]*\}", r"{\1}", template)
        return plain.format_map(_Fmt({k: ("n/a" if v is None else v) for k, v in values.items()}))
