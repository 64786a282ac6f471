"""The topic catalog: every Kafka topic of Refinery, by its role.

``deploy/topics.yaml`` is the data (partitions, keys, configs, ingest formats; read and
applied by :mod:`services.topics`); :class:`Topics` names its topics for the code, so no
module spells a topic name itself. :data:`TOPICS` is the catalog without a prefix;
:meth:`Topics.with_prefix` the one place a name prefix (tests, tenants) is applied: to the
base names, once, however often it is called. :meth:`Topics.covering` checks a spec file's
topic names against the catalog.

Example::

    >>> TOPICS.raw, TOPICS.with_prefix("t1.").refined
    ('telemetry.raw', 't1.telemetry.refined')
    >>> TOPICS.with_prefix("t1.").with_prefix("t2.").raw
    't2.telemetry.raw'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from schemas.errors import ConfigError


@dataclass(frozen=True)
class Topics:
    """The topics' names (with :attr:`prefix` applied)."""

    # what exporters produce (the worker's inputs)
    raw: str = "telemetry.raw"
    events: str = "telemetry.events"
    collectives: str = "telemetry.collectives"
    # compacted facts: the admin's topology, the node exporters' own facts, job placement
    topology: str = "topology"
    topology_nodes: str = "topology.nodes"
    jobs: str = "jobs"
    # what the worker produces
    refined: str = "telemetry.refined"
    events_aligned: str = "telemetry.events.aligned"
    collectives_aligned: str = "telemetry.collectives.aligned"
    deadletter: str = "telemetry.deadletter"
    accounting: str = "telemetry.accounting"
    # what detection produces
    alerts: str = "telemetry.alerts"
    episodes: str = "telemetry.episodes"
    rollups: str = "telemetry.rollups"
    # what a site's producers publish in their own formats (the worker refines them with raw)
    ingest_otlp: str = "telemetry.ingest.otlp"
    ingest_influx: str = "telemetry.ingest.influx"
    ingest_collectd: str = "telemetry.ingest.collectd"
    ingest_prom: str = "telemetry.ingest.prom"
    prefix: str = ""

    def with_prefix(self, prefix: str) -> Topics:
        """The catalog with every base name prefixed by ``prefix`` (replacing any prefix
        this one has: a prefix is never applied twice)."""
        return replace(
            _BASE, prefix=prefix, **{role: prefix + name for role, name in _BASE.names().items()}
        )

    def names(self) -> dict[str, str]:
        """Role → topic name, for every topic."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prefix"}

    def role(self, name: str) -> str | None:
        """The role of the topic ``name`` (a name of this catalog), or None."""
        return next((r for r, n in self.names().items() if n == name), None)

    @property
    def ingest(self) -> tuple[str, ...]:
        """The ingest topics (foreign formats)."""
        return (self.ingest_otlp, self.ingest_influx, self.ingest_collectd, self.ingest_prom)

    def covering(self, spec_names: Iterable[str], source: str = "topic specs") -> Topics:
        """This catalog, after checking that every one of its topics is among
        ``spec_names`` (a spec file's topics, with this catalog's prefix): ConfigError
        naming the first that is not. A spec file may declare more (a site's own ingest
        topics)."""
        have = set(spec_names)
        for role, name in self.names().items():
            if name not in have:
                raise ConfigError(f"{source}: no topic {name!r} (the catalog's {role})")
        return self


_BASE = Topics()
TOPICS = _BASE  # the catalog without a prefix
