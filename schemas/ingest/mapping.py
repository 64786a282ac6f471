"""Foreign metric names onto the catalog, as data (``schemas/catalog/ingest/<family>.yaml``).

A foreign series is a name, its labels (Prometheus labels, Influx tags, collectd's
``plugin_instance``/``type_instance``, OTLP resource and point attributes) and a hint of
what its values are (``""``: as the catalog's kind says; ``"rate"``: a per-second rate of a
counter, as collectd's ``StoreRates`` and OTLP delta sums send). A :class:`Mapping` resolves
each distinct series once to a :class:`Target`: catalog metric, device, the factor that
turns the foreign value into the catalog's raw unit, whether it is a counter, and the node
the series belongs to. Decoders resolve distinct series only; their samples are mapped by
index (see :mod:`schemas.ingest.assemble`).

Rules of one family file::

    node_labels: [host, Hostname]          # the first present names the node
    node_hint: "set the host tag"          # what a producer without one must set
    default_device: ["gpu{gpu}", "node"]   # the first template whose labels are all present
    rules:
      - name: node_cpu_seconds_total        # or pattern: a regex over the whole name
        select: mode                        # a label whose value picks the metric
        metrics: {user: cpu.user_seconds}   # (or metric: one catalog name, may use {1})
        device: "cpu{cpu}"                  # labels and regex groups by name / number
        to_raw: 100                         # foreign value x to_raw = catalog raw reading

``select`` names a label, a regex group (``"1"``) or, with braces, a template of several
(``"{direction}/{type}"``); a list gives alternatives, the first present wins (attribute
names of older and newer OpenTelemetry semantic conventions). ``device`` may be a list of
templates too (the first whose fields are all present), and ``device_names`` renames a
rendered device (Telegraf's ``cpu-total`` is the catalog's ``all``). A field may be
lowercased: ``{1:lower}`` (``node_netstat_Tcp_InSegs`` -> ``net.tcp_insegs``).

A name that is a catalog name or alias (DCGM field names) maps to itself with the default
device. Anything else keeps its foreign name as the metric, so the refiner dead-letters it
as ``unknown_metric`` naming it. A rate maps to the counter's rate gauge from ``rates.yaml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.catalog import Catalog, Kind, default_catalog
from schemas.errors import ConfigError

MAPPING_DIR = Path(__file__).resolve().parent.parent / "catalog" / "ingest"
SeriesKey = tuple[str, tuple[tuple[str, str], ...], str]  # name, sorted labels, hint
_FIELD = re.compile(r"\{([^{}]+)\}")
DEVICE_CHARS = re.compile(r"[^A-Za-z0-9._:/+@-]")


class Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = None
    pattern: str | None = None
    metric: str | None = None
    select: str | tuple[str, ...] | None = None  # a label, or labels: the first present
    metrics: dict[str, str] = Field(default_factory=dict)
    device: str | tuple[str, ...] | None = None  # a template, or templates: the first whole
    device_names: dict[str, str] = Field(default_factory=dict)  # rendered device -> device
    to_raw: float = 1.0

    @model_validator(mode="after")
    def _check(self) -> Rule:
        if (self.name is None) == (self.pattern is None):
            raise ValueError("a rule needs exactly one of name or pattern")
        if (self.metric is None) == (self.select is None):
            raise ValueError("a rule needs exactly one of metric or select (with metrics)")
        if self.select is not None and not self.metrics:
            raise ValueError("select needs metrics")
        return self


class RatePair(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    counter: str
    rate: str
    factor: float = 1.0  # counter unit per second -> the rate gauge's unit


class Family(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node_labels: tuple[str, ...] = ()
    # what a producer that sends none of node_labels (and no Kafka key that is a name) must
    # set: the dead letter says it
    node_hint: str = ""
    default_device: tuple[str, ...] = ("node",)
    rules: tuple[Rule, ...] = ()


@dataclass(frozen=True)
class Target:
    """Where one foreign series goes. ``factor`` multiplies the foreign value: into the raw
    unit of a counter or gauge, or for a rate into the rate gauge's unit."""

    metric: str
    device: str
    factor: float
    counter: bool  # the sample carries ``raw`` (uint64), rounded from value x factor
    node: str | None
    mapped: bool


def _selected(select: str | tuple[str, ...], ctx: dict[str, str]) -> str:
    """The key ``select`` picks from ``ctx`` (labels and regex groups): the first of its
    names present, or of its templates whose fields are all present; "" if none is."""
    for name in (select,) if isinstance(select, str) else select:
        if "{" in name:
            got = _template(name, ctx, clean=False)
            if got is not None:
                return got
        elif name in ctx:
            return ctx[name]
    return ""


def _template(tpl: str, ctx: dict[str, str], clean: bool = True) -> str | None:
    """``tpl`` with each ``{field}`` (``{field:lower}``) filled from ``ctx``; None where a
    field is absent. ``clean``: characters a device may not hold become ``_``."""
    out = []
    pos = 0
    for m in _FIELD.finditer(tpl):
        field, _, how = m.group(1).partition(":")
        v = ctx.get(field)
        if v is None:
            return None
        out.append(tpl[pos : m.start()])
        out.append(v.lower() if how == "lower" else v)
        pos = m.end()
    out.append(tpl[pos:])
    return DEVICE_CHARS.sub("_", "".join(out)) if clean else "".join(out)


class Mapping:
    """One family's rules over a catalog. Resolves a series once; not thread-safe (cache)."""

    def __init__(self, family: Family, rates: list[RatePair], catalog: Catalog) -> None:
        self.family = family
        self.catalog = catalog
        self._exact = {r.name: r for r in family.rules if r.name is not None}
        self._patterns = [(re.compile(r.pattern), r) for r in family.rules if r.pattern]
        self._rates = {catalog.canonical(p.counter): p for p in rates}
        self._cache: dict[SeriesKey, Target] = {}
        # a family whose rules read no node label (only ``node`` does) resolves a series
        # from its labels less the node's: each host's series then share one resolution
        # (a new host's thousands of series cost a dict lookup each, not a rule match)
        read = _fields_read(family)
        self._node_free = not read & set(family.node_labels)
        self._shared: dict[SeriesKey, Target] = {}
        for r in family.rules:
            for m in [r.metric] if r.metric else list(r.metrics.values()):
                if "{" not in m and m not in catalog:
                    raise ConfigError(f"ingest mapping: {m!r} is not in the catalog")

    def resolve(self, key: SeriesKey) -> Target:
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) > 200_000:  # bounded: distinct series, not samples
                self._cache.clear()
            t = self._cache[key] = self._resolve_anew(key)
        return t

    def _resolve_anew(self, key: SeriesKey) -> Target:
        """:meth:`_resolve` of ``key``: through the resolution of its labels less the
        node's when no rule reads those (the same target but for ``node``)."""
        if not self._node_free:
            return self._resolve(key)
        name, pairs, hint = key
        node_labels = self.family.node_labels
        shared_key = (name, tuple(p for p in pairs if p[0] not in node_labels), hint)
        t = self._shared.get(shared_key)
        if t is None:
            if len(self._shared) > 200_000:
                self._shared.clear()
            t = self._shared[shared_key] = self._resolve(shared_key)
        return Target(t.metric, t.device, t.factor, t.counter, self._node(dict(pairs)), t.mapped)

    def _node(self, labels: dict[str, str]) -> str | None:
        for name in self.family.node_labels:
            v = labels.get(name)
            if v:
                return v
        return None

    def _device(
        self, tpl: str | tuple[str, ...] | None, ctx: dict[str, str], names: dict[str, str]
    ) -> str:
        tpls = (
            self.family.default_device if tpl is None else (tpl,) if isinstance(tpl, str) else tpl
        )
        for t in tpls:
            d = _template(t, ctx)
            if d:
                return names.get(d, d)
        return "node"

    def _resolve(self, key: SeriesKey) -> Target:
        name, pairs, hint = key
        labels = dict(pairs)
        node = self._node(labels)
        rule, groups = self._exact.get(name), {}
        if rule is None:
            for rx, r in self._patterns:
                m = rx.fullmatch(name)
                if m:
                    rule = r
                    groups = {str(i + 1): g or "" for i, g in enumerate(m.groups())}
                    groups.update({k: v for k, v in m.groupdict().items() if v is not None})
                    break
        ctx = {**labels, **groups}
        metric: str | None
        if rule is not None:
            if rule.select is not None:
                metric = rule.metrics.get(_selected(rule.select, ctx))
            else:
                metric = _template(rule.metric or "", ctx)
            device, factor = self._device(rule.device, ctx, rule.device_names), rule.to_raw
        else:
            metric, device, factor = name, self._device(None, ctx, {}), 1.0
        if metric is None or metric not in self.catalog:
            shown = name
            if rule is not None and rule.select is not None:
                shown = f"{name}{{{_selected(rule.select, ctx)!r}}}"
            return Target(shown + (":rate" if hint else ""), device, 1.0, False, node, False)
        entry = self.catalog[metric]
        if hint == "rate":
            pair = self._rates.get(entry.name) if entry.kind is Kind.COUNTER else None
            if pair is None:
                return Target(f"{name}:rate", device, 1.0, False, node, False)
            scale = factor * entry.scale * pair.factor
            return Target(pair.rate, device, scale, False, node, True)
        return Target(entry.name, device, factor, entry.kind is Kind.COUNTER, node, True)


def _fields_read(family: Family) -> set[str]:
    """Every label (or regex group) name a resolution in ``family`` may read from a
    series' labels, besides its node labels: the fields of its metric, select and device
    templates, and the names its selects read whole."""
    templates = list(family.default_device)
    names: set[str] = set()
    for r in family.rules:
        templates += [r.metric or ""]
        templates += (
            [] if r.device is None else [r.device] if isinstance(r.device, str) else r.device
        )
        for sel in (
            [] if r.select is None else [r.select] if isinstance(r.select, str) else r.select
        ):
            if "{" in sel:
                templates.append(sel)
            else:
                names.add(sel)
    for t in templates:
        names.update(m.group(1).partition(":")[0] for m in _FIELD.finditer(t))
    return names


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"ingest mapping {path.name}: {e}".splitlines()[0]) from e


def load_rates(directory: Path = MAPPING_DIR) -> list[RatePair]:
    doc = _load_yaml(directory / "rates.yaml") or {}
    try:
        return [RatePair.model_validate(p) for p in doc.get("rates", [])]
    except ValidationError as e:
        raise ConfigError(f"ingest mapping rates.yaml: {str(e).splitlines()[0]}") from e


def load_mapping(
    family: str, catalog: Catalog | None = None, directory: Path = MAPPING_DIR
) -> Mapping:
    """The mapping of one family (``prometheus``, ``influx``, ``collectd``, ``otlp``);
    :class:`~schemas.errors.ConfigError` naming the file for anything malformed."""
    path = directory / f"{family}.yaml"
    doc = _load_yaml(path)
    try:
        fam = Family.model_validate(doc or {})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"ingest mapping {path.name}: {loc}: {err['msg']}") from e
    cat = catalog or default_catalog()
    try:
        return Mapping(fam, load_rates(directory), cat)
    except KeyError as e:
        raise ConfigError(f"ingest mapping rates.yaml: {e} is not in the catalog") from e


@lru_cache(maxsize=8)
def default_mapping(family: str) -> Mapping:
    """The packaged mapping of ``family`` over the packaged catalog. Its cache of resolved
    series is shared by every caller in the process (resolution is deterministic)."""
    return load_mapping(family)
