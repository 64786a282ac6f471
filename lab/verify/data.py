"""Data figures of a lake against a simulator run's truth: nothing lost, nothing duplicated,
nothing made up, and every sample on its true time within the bound it states.

One DuckDB connection holds the lake's views (``sql/``) and the truth's Parquet files as
views ``truth``, ``truth_sends``, ``truth_events``, ``truth_collectives``. Lake rows are
restricted to the run by the truth's boot ids (samples, events) and jobs (collectives), so a
lake shared with other runs is compared on this run's rows only.

Keys: a sample is ``(node, exporter, instance, boot_id, seq, metric, device, ts_source)``, an
event ``(node, boot_id, seq, event, device, ts_source)``, a collective record
``(job, op_seq, rank, ts_source)``. Only good truth samples (no ``expected_reason``) must land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from lab.simulate.truth import sibling
from services.lake.sqlload import connect

SAMPLE_KEY = ("node", "exporter", "instance", "boot_id", "seq", "metric", "device")
EVENT_KEY = ("node", "boot_id", "seq", "event", "device")
COLLECTIVE_KEY = ("job", "op_seq", "rank")


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
class ClockFigures:
    """|aligned ts - true ts| of every landed sample, against its own ``clock_error_ns``."""

    samples: int
    within: int
    err_p50_ns: float
    err_p99_ns: float
    err_max_ns: float
    bound_p50_ns: float
    bound_p99_ns: float
    worst_sources: list[dict[str, Any]] = field(default_factory=list)  # most out of bound

    @property
    def within_share(self) -> float:
        return self.within / self.samples if self.samples else 1.0


def open_run(lake: Path, truth: Path) -> duckdb.DuckDBPyConnection:
    """The lake's views plus the truth's tables as views."""
    con = connect(lake)
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


def _counts(
    con: duckdb.DuckDBPyConnection, lake: str, truth: str, key: tuple[str, ...], scope: str
) -> Counts:
    """``lake`` and ``truth``: SELECTs (the truth's already restricted to rows that must
    land); ``scope``: a condition on the lake rows that keeps this run's."""
    cols = ", ".join((*key, "ts_source"))
    sql = f"""
        WITH l AS (SELECT {cols}, count(*) AS n FROM ({lake}) WHERE {scope} GROUP BY ALL),
             t AS (SELECT DISTINCT {", ".join(key)}, ts_source_ns FROM ({truth}))
        SELECT (SELECT count(*) FROM t),
               (SELECT count(*) FROM l),
               (SELECT count(*) FROM t WHERE NOT EXISTS (SELECT 1 FROM l WHERE {_join(key)})),
               (SELECT coalesce(sum(n - 1), 0) FROM l),
               (SELECT coalesce(sum(n), 0) FROM l
                WHERE NOT EXISTS (SELECT 1 FROM t WHERE {_join(key)}))"""
    row = con.execute(sql).fetchone()
    assert row is not None
    return Counts(*(int(x) for x in row))


def sample_counts(con: duckdb.DuckDBPyConnection) -> Counts:
    return _counts(
        con,
        "SELECT * FROM samples",
        "SELECT * FROM truth WHERE expected_reason IS NULL",
        SAMPLE_KEY,
        "boot_id IN (SELECT DISTINCT boot_id FROM truth)",
    )


def event_counts(con: duckdb.DuckDBPyConnection) -> Counts:
    return _counts(
        con,
        "SELECT * FROM events",
        "SELECT * FROM truth_events",
        EVENT_KEY,
        "boot_id IN (SELECT DISTINCT boot_id FROM truth UNION SELECT boot_id FROM truth_events)",
    )


def collective_counts(con: duckdb.DuckDBPyConnection) -> Counts:
    return _counts(
        con,
        "SELECT * FROM collectives",
        "SELECT * FROM truth_collectives",
        COLLECTIVE_KEY,
        "job IN (SELECT DISTINCT job FROM truth_collectives)",
    )


def clock_figures(con: duckdb.DuckDBPyConnection, worst: int = 5) -> ClockFigures:
    """Every landed sample of the run joined to its truth row (one lake copy per key)."""
    cols = ", ".join((*SAMPLE_KEY, "ts_source"))
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE verify_err AS
        WITH l AS (SELECT {cols}, any_value(ts) AS ts, any_value(clock_error_ns) AS bound
                   FROM samples WHERE boot_id IN (SELECT DISTINCT boot_id FROM truth)
                   GROUP BY ALL)
        SELECT l.node, l.exporter, l.instance, abs(l.ts - t.ts_true_ns) AS err, l.bound,
               t.ts_true_ns AS true_ns, l.ts AS aligned_ns
        FROM l JOIN truth t ON {_join(SAMPLE_KEY)} WHERE t.expected_reason IS NULL""")
    row = con.execute("""
        SELECT count(*), count(*) FILTER (WHERE err <= bound),
               coalesce(quantile_cont(err, 0.5), 0), coalesce(quantile_cont(err, 0.99), 0),
               coalesce(max(err), 0),
               coalesce(quantile_cont(bound, 0.5), 0), coalesce(quantile_cont(bound, 0.99), 0)
        FROM verify_err""").fetchone()
    assert row is not None
    cur = con.execute(f"""
        SELECT node || '|' || exporter || '|' || instance AS source,
               count(*) FILTER (WHERE err > bound) AS out_of_bound, count(*) AS samples,
               max(err) AS err_max_ns
        FROM verify_err GROUP BY ALL HAVING count(*) FILTER (WHERE err > bound) > 0
        ORDER BY out_of_bound DESC, source LIMIT {int(worst)}""")
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    e50, e99, emax, b50, b99 = (float(x) for x in row[2:])
    return ClockFigures(int(row[0]), int(row[1]), e50, e99, emax, b50, b99, rows)


def data_counts(con: duckdb.DuckDBPyConnection) -> dict[str, Counts]:
    """Samples, events and collectives against the truth."""
    return {
        "samples": sample_counts(con),
        "events": event_counts(con),
        "collectives": collective_counts(con),
    }
