"""The metric catalog: the single source of counter semantics.

The catalog is data (``schemas/catalog/*.yaml``), one file per origin domain. Each entry names
a metric, its unit, kind, counter width and overflow behaviour, scale to the documented unit,
valid range, sentinels and where it comes from. :func:`load_catalog` reads and checks all of
them; a malformed entry raises :class:`~schemas.errors.ConfigError` naming file and metric.

Example::

    >>> cat = load_catalog()
    >>> m = cat["ib.port_rcv_data"]
    >>> (m.unit, m.kind, m.width, m.scale)
    ('B', 'counter', 64, 4.0)
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import ConfigError

CATALOG_DIR = Path(__file__).with_name("catalog")


class Kind(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    BITMASK = "bitmask"
    ENUM = "enum"
    EVENT = "event"


class Overflow(StrEnum):
    WRAP = "wrap"  # rolls over to 0 past 2**width - 1 (mlx5 Q counters, /proc/net/dev)
    SATURATE = "saturate"  # sticks at 2**width - 1 (IB PMA legacy counters)


class Origin(BaseModel):
    """Where the value is read; at least one field is set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dcgm_field: str | None = None
    dcgm_id: int | None = None
    nvml: str | None = None
    sysfs: str | None = None
    procfs: str | None = None
    ethtool: str | None = None
    redfish: str | None = None
    nccl: str | None = None
    simulator: bool = False


class Metric(BaseModel):
    """One catalog entry. ``scale`` multiplies the raw reading into ``unit``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$", max_length=96)
    unit: str = Field(min_length=1)
    kind: Kind
    description: str = Field(min_length=8)
    origin: Origin
    width: int | None = None
    overflow: Overflow | None = None
    scale: float = 1.0
    valid_min: float | None = None
    valid_max: float | None = None
    sentinels: tuple[float, ...] = ()
    sentinel_texts: tuple[str, ...] = ()
    bits: dict[int, str] = Field(default_factory=dict)
    values: dict[int, str] = Field(default_factory=dict)
    aliases: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check_kind(self) -> Metric:
        if self.kind is Kind.COUNTER:
            if self.width not in (8, 16, 32, 64):
                raise ValueError("a counter needs width 8, 16, 32 or 64")
            if self.overflow is None:
                raise ValueError("a counter needs overflow: wrap or saturate")
        elif self.width is not None or self.overflow is not None:
            raise ValueError("width/overflow apply to counters only")
        if self.kind is Kind.BITMASK and not self.bits:
            raise ValueError("a bitmask needs bits")
        if self.kind is Kind.ENUM and not self.values:
            raise ValueError("an enum needs values")
        if (
            self.valid_min is not None
            and self.valid_max is not None
            and self.valid_min > self.valid_max
        ):
            raise ValueError("valid_min > valid_max")
        return self

    @property
    def max_raw(self) -> int | None:
        """Largest raw reading of a counter (``2**width - 1``), None for other kinds."""
        return None if self.width is None else (1 << self.width) - 1

    def decode_bits(self, value: int) -> list[str]:
        """Names of the bits set in a bitmask value, lowest bit first."""
        return [name for bit, name in sorted(self.bits.items()) if value & (1 << bit)]


class Catalog:
    """Metrics by name and by alias (e.g. a DCGM field name). Immutable after load."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._by_name: dict[str, Metric] = {}
        self._alias: dict[str, str] = {}
        for m in metrics:
            if m.name in self._by_name:
                raise ConfigError(f"catalog: metric {m.name!r} defined twice")
            self._by_name[m.name] = m
        for m in metrics:
            for a in m.aliases:
                if a in self._by_name or a in self._alias:
                    raise ConfigError(f"catalog: alias {a!r} of {m.name!r} is not unique")
                self._alias[a] = m.name

    def __getitem__(self, name: str) -> Metric:
        return self._by_name[self._alias.get(name, name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._by_name or name in self._alias)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def canonical(self, name: str) -> str:
        """The catalog name for ``name`` or one of its aliases; KeyError if unknown."""
        return self[name].name

    def names(self) -> list[str]:
        return sorted(self._by_name)


def _load_file(path: Path) -> list[Metric]:
    try:
        doc: Any = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"catalog {path.name}: not valid YAML: {e}".splitlines()[0]) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), list):
        raise ConfigError(f"catalog {path.name}: expected a mapping with a 'metrics' list")
    out = []
    for i, entry in enumerate(doc["metrics"]):
        name = entry.get("name", f"#{i}") if isinstance(entry, dict) else f"#{i}"
        try:
            out.append(Metric.model_validate(entry))
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "entry"
            raise ConfigError(f"catalog {path.name}: metric {name}: {field}: {err['msg']}") from e
    return out


def load_catalog(directory: Path | None = None) -> Catalog:
    """Read every ``*.yaml`` in ``directory`` (default: the packaged catalog)."""
    d = directory or CATALOG_DIR
    metrics: list[Metric] = []
    for path in sorted(d.glob("*.yaml")):
        metrics.extend(_load_file(path))
    return Catalog(metrics)


@lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The packaged catalog, loaded once per process (it is immutable)."""
    return load_catalog()
