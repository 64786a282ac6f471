"""Data figures of a lake against a simulator run's truth: nothing lost, nothing duplicated,
nothing made up, every sample, event and collective record on its true time within the bound
it states, and how tight those bounds are.

One DuckDB connection holds the lake's views (``sql/``) and the truth's Parquet files as
views ``truth``, ``truth_sends``, ``truth_events``, ``truth_collectives``. Lake rows are
restricted to the run by the truth's boot ids (samples, events) and jobs (collectives), so a
lake shared with other runs is compared on this run's rows only.

Keys: a sample is ``(node, exporter, instance, boot_id, seq, metric, device, ts_source)``, an
event ``(node, boot_id, seq, event, device, ts_source)``, a collective record
``(job, op_seq, rank, ts_source)``. Only good truth samples (no ``expected_reason``) must land.
The truth's ``ts_true_ns`` of each is its true time, the broker's clock at speed 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from lab.simulate.truth import sibling
from services.lake.backend import connect_views
from services.lake.iceberg import IcebergSettings

SAMPLE_KEY = ("node", "exporter", "instance", "boot_id", "seq", "metric", "device")
EVENT_KEY = ("node", "boot_id", "seq", "event", "device")
COLLECTIVE_KEY = ("job", "op_seq", "rank")
WIDE_BOUND_NS = 100_000_000  # a row bounded wider than this is "wide" (issue #42: ≤ 0.1 %)


@dataclass(frozen=True)
class Dataset:
    """How one lake dataset is joined with its truth."""

    view: str  # the lake's view
    truth: str  # a SELECT of the truth rows that must land
    key: tuple[str, ...]  # with ts_source: one row
    scope: str  # a condition on the lake rows that keeps this run's
    source: str  # SQL naming a lake row's clock source


DATASETS = {
    "samples": Dataset(
        "samples",
        "SELECT * FROM truth WHERE expected_reason IS NULL",
        SAMPLE_KEY,
        "boot_id IN (SELECT DISTINCT boot_id FROM truth)",
        "node || '|' || exporter || '|' || instance",
    ),
    "events": Dataset(
        "events",
        "SELECT * FROM truth_events",
        EVENT_KEY,
        "boot_id IN (SELECT DISTINCT boot_id FROM truth UNION SELECT boot_id FROM truth_events)",
        "node || '|' || exporter",
    ),
    "collectives": Dataset(
        "collectives",
        "SELECT * FROM truth_collectives",
        COLLECTIVE_KEY,
        "job IN (SELECT DISTINCT job FROM truth_collectives)",
        "node || '|' || exporter",  # the collector's node: the job's first
    ),
}


@dataclass(frozen=True)
class Counts:
    """One dataset's rows against the truth."""

    truth: int  # rows the truth says must land
    landed: int  # distinct keys of this run in the lake
    lost: int  # truth rows with no lake row
    duplicated: int  # lake rows beyond the first per key
    unexpected: int  # lake rows of this run the truth does not have

    @property
    def ok(self) -> bool:
        return self.lost == self.duplicated == self.unexpected == 0


@dataclass(frozen=True)
class BasisBounds:
    """The stated bounds (``clock_error_ns``) of the rows of one ``clock_basis``."""

    rows: int
    p50_ns: float
    p99_ns: float


@dataclass(frozen=True)
class ClockFigures:
    """|aligned ts - true ts| of every landed row of one dataset (each key once), against its
    own ``clock_error_ns``, and how tight those bounds are."""

    rows: int
    within: int
    err_p50_ns: float
    err_p99_ns: float
    err_max_ns: float
    bound_p50_ns: float
    bound_p99_ns: float
    wide: int = 0  # rows bounded wider than WIDE_BOUND_NS
    by_basis: dict[str, BasisBounds] = field(default_factory=dict)  # NULL basis: "unknown"
    worst_sources: list[dict[str, Any]] = field(default_factory=list)  # most out of bound
    # most rows bounded wider than WIDE_BOUND_NS: source, wide, rows, how many of them in
    # the source's first 5 s (its start-up), the widest bound
    wide_sources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """``rows`` under the name the samples' figures had (lab/bench reads it)."""
        return self.rows

    @property
    def within_share(self) -> float:
        return self.within / self.rows if self.rows else 1.0

    @property
    def wide_share(self) -> float:
        return self.wide / self.rows if self.rows else 0.0


def open_run(lake: Path, truth: Path) -> duckdb.DuckDBPyConnection:
    """The lake's views (in the format the environment sets, as ``refinery sql`` reads it)
    plus the truth's tables as views."""
    con: duckdb.DuckDBPyConnection = connect_views(lake, iceberg=IcebergSettings(), seed=False)
    files = {"truth": truth}
    files |= {f"truth_{n}": sibling(truth, n) for n in ("sends", "events", "collectives")}
    for name, path in files.items():
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{_quote(path)}')")
    return con


def _quote(path: Path) -> str:
    return str(path.absolute()).replace("'", "''")


def _join(key: tuple[str, ...], lake_ts: str = "ts_source", truth_ts: str = "ts_source_ns") -> str:
    on = " AND ".join(f"l.{k} = t.{k}" for k in key)
    return f"{on} AND l.{lake_ts} = t.{truth_ts}"


def counts(con: duckdb.DuckDBPyConnection, d: Dataset) -> Counts:
    """Dataset ``d``'s truth rows lost, its lake rows duplicated and not in the truth."""
    cols = ", ".join((*d.key, "ts_source"))
    sql = f"""
        WITH l AS (SELECT {cols}, count(*) AS n FROM {d.view} WHERE {d.scope} GROUP BY ALL),
             t AS (SELECT DISTINCT {", ".join(d.key)}, ts_source_ns FROM ({d.truth}))
        SELECT (SELECT count(*) FROM t),
               (SELECT count(*) FROM l),
               (SELECT count(*) FROM t WHERE NOT EXISTS (SELECT 1 FROM l WHERE {_join(d.key)})),
               (SELECT coalesce(sum(n - 1), 0) FROM l),
               (SELECT coalesce(sum(n), 0) FROM l
                WHERE NOT EXISTS (SELECT 1 FROM t WHERE {_join(d.key)}))"""
    row = con.execute(sql).fetchone()
    assert row is not None
    return Counts(*(int(x) for x in row))


def err_table(name: str) -> str:
    """The temp table of dataset ``name``'s joined rows (``verify_err`` for the samples:
    :mod:`lab.verify.alerts` reads the run's pace from it)."""
    return "verify_err" if name == "samples" else f"verify_err_{name}"


def clock_figures(
    con: duckdb.DuckDBPyConnection, name: str = "samples", worst: int = 5
) -> ClockFigures:
    """Every landed row of the run in dataset ``name`` joined to its truth row (one lake copy
    per key): the error against the row's bound, the bounds' p50/p99 overall and per
    ``clock_basis``, and the rows bounded wider than :data:`WIDE_BOUND_NS`."""
    d, table = DATASETS[name], err_table(name)
    cols = ", ".join((*d.key, "ts_source"))
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {table} AS
        WITH l AS (SELECT {cols}, any_value(ts) AS ts, any_value(clock_error_ns) AS bound,
                          any_value(coalesce(clock_basis, 'unknown')) AS basis,
                          any_value({d.source}) AS source
                   FROM {d.view} WHERE {d.scope} GROUP BY {cols})
        SELECT l.source, abs(l.ts - t.ts_true_ns) AS err, l.bound, l.basis,
               t.ts_true_ns AS true_ns, l.ts AS aligned_ns
        FROM l JOIN ({d.truth}) t ON {_join(d.key)}""")
    row = con.execute(f"""
        SELECT count(*), count(*) FILTER (WHERE err <= bound),
               count(*) FILTER (WHERE bound > {WIDE_BOUND_NS}),
               coalesce(quantile_cont(err, 0.5), 0), coalesce(quantile_cont(err, 0.99), 0),
               coalesce(max(err), 0),
               coalesce(quantile_cont(bound, 0.5), 0), coalesce(quantile_cont(bound, 0.99), 0)
        FROM {table}""").fetchone()
    assert row is not None
    basis = {
        str(b): BasisBounds(int(n), float(p50), float(p99))
        for b, n, p50, p99 in con.execute(f"""
            SELECT basis, count(*), quantile_cont(bound, 0.5), quantile_cont(bound, 0.99)
            FROM {table} GROUP BY basis ORDER BY basis""").fetchall()
    }
    cur = con.execute(f"""
        SELECT source, count(*) FILTER (WHERE err > bound) AS out_of_bound, count(*) AS rows,
               max(err) AS err_max_ns
        FROM {table} GROUP BY ALL HAVING count(*) FILTER (WHERE err > bound) > 0
        ORDER BY out_of_bound DESC, source LIMIT {int(worst)}""")
    names = [c[0] for c in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    e50, e99, emax, b50, b99 = (float(x) for x in row[3:])
    return ClockFigures(
        int(row[0]), int(row[1]), e50, e99, emax, b50, b99, int(row[2]), basis, rows,
        wide_sources(con, table, worst),
    )  # fmt: skip


def wide_sources(
    con: duckdb.DuckDBPyConnection, table: str, worst: int = 5
) -> list[dict[str, Any]]:
    """The sources with the most rows bounded wider than :data:`WIDE_BOUND_NS` in the joined
    rows ``table``: how many, of how many rows, how many of them in the source's first 5 s
    (a start-up's wide bounds, before its exchanges are short), and the widest bound."""
    cur = con.execute(f"""
        WITH s AS (SELECT *, true_ns - min(true_ns) OVER (PARTITION BY source) AS since
                   FROM {table})
        SELECT source, count(*) FILTER (WHERE bound > {WIDE_BOUND_NS}) AS wide,
               count(*) AS rows,
               count(*) FILTER (WHERE bound > {WIDE_BOUND_NS} AND since < 5e9) AS at_start,
               max(bound) AS bound_max_ns
        FROM s GROUP BY ALL HAVING count(*) FILTER (WHERE bound > {WIDE_BOUND_NS}) > 0
        ORDER BY wide DESC, source LIMIT {int(worst)}""")
    names = [c[0] for c in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def data_counts(con: duckdb.DuckDBPyConnection) -> dict[str, Counts]:
    """Samples, events and collectives against the truth."""
    return {name: counts(con, d) for name, d in DATASETS.items()}


def all_clock_figures(con: duckdb.DuckDBPyConnection) -> dict[str, ClockFigures]:
    """:func:`clock_figures` of samples, events and collectives."""
    return {name: clock_figures(con, name) for name in DATASETS}
