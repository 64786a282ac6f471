"""What the report shows, aggregated in DuckDB over the ``sql/`` views and named queries.

:func:`resolve_scope` fixes the window, time bucket and job filter once; each ``*_data``
function then runs a few grouped queries and returns plain rows (lists of tuples or dicts),
never per-sample data, so a lake of millions of rows reports in seconds.

The job filter (``--job J``): GPU rows keep samples enriched with job J; fabric, clock and
data-quality rows keep the nodes J ran on (samples or collectives labelled J, or its placement
in ``job_ranks``); the straggler rows are J's collectives. Without ``--job`` the straggler
figure shows the job with the most stragglers in the window.

DuckDB errors propagate (the CLI prints them on one line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb

from services.lake import sqlload
from services.report.svg import NS, iso, nice_bucket_ns

Row = tuple[Any, ...]
PAUSE, PAUSE_US = "nic.rx_prio_pause", "nic.rx_prio_pause_duration"
ECN, CNP_SENT, CNP_HANDLED = (
    "rdma.np_ecn_marked_roce_packets",
    "rdma.np_cnp_sent",
    ("rdma.rp_cnp_handled"),
)
CAUSES = (
    (3, "HW_SLOWDOWN"),
    (6, "HW_THERMAL"),
    (7, "HW_POWER_BRAKE"),
    (5, "SW_THERMAL"),
    (2, "SW_POWER_CAP"),
    (4, "SYNC_BOOST"),
    (1, "CLOCKS_SETTING"),
)  # most severe first: a cell shows the first bit set
IDLE_BITS = 0b1_0000_0001  # GPU_IDLE, DISPLAY_CLOCKS: not throttling


@dataclass(frozen=True)
class Scope:
    """The window ``[start_ns, end_ns)`` (aligned time), bucket size, and job filter
    (``nodes`` is None without one)."""

    start_ns: int
    end_ns: int
    bucket_ns: int
    job: str | None
    nodes: tuple[str, ...] | None

    @property
    def bucket_s(self) -> float:
        return self.bucket_ns / NS

    def params(self, **extra: object) -> dict[str, object]:
        return {"s": self.start_ns, "e": self.end_ns, "b": self.bucket_ns, **extra}

    def named(self, **extra: str) -> dict[str, str]:
        """Window parameters for a named query (µs text; the end rounded up)."""
        return {"start": iso(self.start_ns), "end": iso(-(-self.end_ns // 1000) * 1000), **extra}

    def node_ok(self, node: str | None) -> bool:
        return self.nodes is None or node in self.nodes


def named(
    con: duckdb.DuckDBPyConnection, name: str, params: dict[str, str], cols: tuple[str, ...]
) -> list[Row]:
    """Rows of named query ``name`` projected onto ``cols`` by column name, so a query that
    gains or reorders columns keeps working here; a missing column raises KeyError."""
    cur = sqlload.run_query(con, name, params)
    have = [d[0] for d in cur.description or []]
    idx = [have.index(c) if c in have else -1 for c in cols]
    if -1 in idx:
        raise KeyError(f"query {name} has no column {cols[idx.index(-1)]}")
    return [tuple(r[i] for i in idx) for r in cur.fetchall()]


STORM_COLS: tuple[str, ...] = (
    *("node", "device", "prio", "rail", "leaf", "leaf_port", "start_time", "end_time"),
    *("seconds", "samples", "peak_paused_fraction"),
)
LINK_COLS: tuple[str, ...] = (
    *("rail", "switch", "switch_port", "node", "port", "pause_frames", "paused_us"),
    *("ecn_marked", "cnp_sent", "score"),
)
STRAGGLER_COLS: tuple[str, ...] = (
    *("job", "comm", "op", "op_seq", "rank", "nranks", "node", "gpu", "skew_ms"),
    *("arrival", "nic", "leaf", "leaf_port", "likely_cause"),
)
THROTTLE_COLS: tuple[str, ...] = (
    *("node", "gpu", "cause", "samples", "seconds", "mean_sm_clock"),
    *("min_sm_clock", "unthrottled_sm_clock", "jobs"),
)
QUALITY_COLS = ("check", "subject", "count", "value", "detail")


def _nodes_sql(scope: Scope, col: str = "node") -> str:
    return "TRUE" if scope.nodes is None else f"{col} IN (SELECT node FROM report_nodes)"


def lake_rows(con: duckdb.DuckDBPyConnection) -> int:
    """Rows the lake holds in samples, collectives, deadletter and accounting together."""
    sqlload.refresh(con)
    q = (
        "SELECT (SELECT count(*) FROM samples) + (SELECT count(*) FROM collectives)"
        " + (SELECT count(*) FROM deadletter) + (SELECT count(*) FROM refine_accounting)"
    )
    row = con.execute(q).fetchone()
    return int(row[0]) if row else 0


def resolve_scope(
    con: duckdb.DuckDBPyConnection,
    start_ns: int | None,
    end_ns: int | None,
    job: str | None,
    cells: int = 60,
) -> Scope:
    """The report's scope: the given window, else the extent of the (job's) data; a round
    bucket giving about ``cells`` time buckets. Creates temp table ``report_nodes``."""
    sqlload.refresh(con)
    nodes: tuple[str, ...] | None = None
    if job is not None:
        rows = con.execute(
            "SELECT DISTINCT node FROM (SELECT node FROM samples WHERE job = $j"
            " UNION SELECT node FROM collectives WHERE job = $j"
            " UNION SELECT node FROM job_ranks WHERE job = $j) WHERE node IS NOT NULL",
            {"j": job},
        ).fetchall()
        nodes = tuple(sorted(r[0] for r in rows))
    con.execute("CREATE OR REPLACE TEMP TABLE report_nodes (node VARCHAR)")
    if nodes:
        con.executemany("INSERT INTO report_nodes VALUES (?)", [[n] for n in nodes])
    if start_ns is None or end_ns is None:
        probe = Scope(0, 1 << 62, NS, job, nodes)
        row = con.execute(
            f"SELECT min(lo), max(hi) FROM ("
            f" SELECT min(ts) AS lo, max(ts) AS hi FROM samples WHERE {_nodes_sql(probe)}"
            f" UNION ALL SELECT min(ts_ns), max(ts_ns) FROM collectives"
            f"  WHERE {_nodes_sql(probe)} AND ($j IS NULL OR job = $j))",
            {"j": job},
        ).fetchone()
        lo, hi = (row[0], row[1]) if row else (None, None)
        start_ns = start_ns if start_ns is not None else (lo if lo is not None else 0)
        end_ns = end_ns if end_ns is not None else (hi + 1 if hi is not None else start_ns + NS)
    if end_ns <= start_ns:
        raise ValueError("the window is empty: --to must be after --from")
    return Scope(start_ns, end_ns, nice_bucket_ns(end_ns - start_ns, cells), job, nodes)


# --- (1) congestion ------------------------------------------------------------------------


def congestion_data(
    con: duckdb.DuckDBPyConnection, scope: Scope, rows: int = 24
) -> dict[str, list[Row]]:
    """``cells``: (rail, switch, switch_port, t, paused_fraction, pause_fps, ecn_ps, cnp_ps)
    per time bucket for the ``rows`` switch ports with the most congestion (score as in
    top_congested_links: each signal's total over the largest port's total, summed).
    paused_fraction is the busiest host port-priority's paused time over the bucket (0..1);
    the others are summed per second. ``storms``: pfc_storms rows (STORM_COLS); ``links``:
    top_congested_links rows (LINK_COLS; both filtered by the job's nodes)."""
    b = scope.params(bs=scope.bucket_s)
    cells = con.execute(
        f"""
        WITH d AS (
            SELECT rail, coalesce(leaf, '?') AS switch, coalesce(leaf_port, '?') AS switch_port,
                   node, device, ts // $b * $b AS t,
                   sum(delta) FILTER (WHERE metric = '{PAUSE}') AS frames,
                   sum(delta) FILTER (WHERE metric = '{PAUSE_US}') AS paused_us,
                   sum(delta) FILTER (WHERE metric = '{ECN}') AS ecn,
                   sum(delta) FILTER (WHERE metric = '{CNP_SENT}') AS cnp
            FROM rates
            WHERE metric IN ('{PAUSE}', '{PAUSE_US}', '{ECN}', '{CNP_SENT}')
              AND ts >= $s AND ts < $e AND {_nodes_sql(scope)}
            GROUP BY ALL
        ),
        c AS (
            SELECT rail, switch, switch_port, t,
                   coalesce(max(paused_us), 0) / ($bs * 1e6) AS paused_fraction,
                   coalesce(sum(frames), 0) / $bs AS pause_fps,
                   coalesce(sum(ecn), 0) / $bs AS ecn_ps,
                   coalesce(sum(cnp), 0) / $bs AS cnp_ps
            FROM d GROUP BY ALL
        ),
        tot AS (
            SELECT rail, switch, switch_port,
                   sum(paused_fraction) AS a, sum(pause_fps) AS f, sum(ecn_ps) AS n,
                   sum(cnp_ps) AS p
            FROM c GROUP BY ALL
        ),
        top AS (
            SELECT rail, switch, switch_port,
                   coalesce(a / nullif(max(a) OVER (), 0), 0)
                   + coalesce(f / nullif(max(f) OVER (), 0), 0)
                   + coalesce(n / nullif(max(n) OVER (), 0), 0)
                   + coalesce(p / nullif(max(p) OVER (), 0), 0) AS score
            FROM tot WHERE a + f + n + p > 0
            ORDER BY score DESC, switch, switch_port LIMIT {int(rows)}
        )
        SELECT c.rail, c.switch, c.switch_port, c.t, c.paused_fraction, c.pause_fps,
               c.ecn_ps, c.cnp_ps
        FROM c JOIN top USING (rail, switch, switch_port)
        ORDER BY c.rail NULLS LAST, c.switch, c.switch_port, c.t
        """,
        b,
    ).fetchall()
    storms = [r for r in named(con, "pfc_storms", scope.named(), STORM_COLS) if scope.node_ok(r[0])]
    links = named(con, "top_congested_links", scope.named(limit="100000"), LINK_COLS)
    links = [r for r in links if scope.node_ok(r[3])][:8]
    return {"cells": cells, "storms": storms, "links": links}


# --- (2) stragglers --------------------------------------------------------------------------


def straggler_data(
    con: duckdb.DuckDBPyConnection, scope: Scope, skew_ms: float, most: int = 5000
) -> dict[str, Any]:
    """For one job (the scope's, else the one with most stragglers): ``ops`` (comm, op,
    op_seq, t0_ns, ranks, max_skew_ms, p50_skew_ms, stragglers) per op instance, ``slow``
    (rank, node, gpu, op_seq, ts_ns, t0_ns, skew_ms) per straggler arrival (largest ``most``),
    ``path`` (t, pause_fps, cnp_ps) per bucket on the stragglers' NICs and leaf ports, and
    ``causes``: stragglers query rows (STRAGGLER_COLS)."""
    p = scope.params(sk=skew_ms * 1e6, j=scope.job)
    window = "ts_ns >= $s AND ts_ns < $e"
    job = scope.job
    if job is None:
        row = con.execute(
            f"""WITH c AS (SELECT job, ts_ns - min(ts_ns) OVER w AS skew FROM collectives
                           WHERE {window} WINDOW w AS (PARTITION BY job, comm, op, op_seq))
                SELECT job FROM c GROUP BY job
                ORDER BY count(*) FILTER (WHERE skew > $sk) DESC, count(*) DESC, job LIMIT 1""",
            {k: p[k] for k in ("s", "e", "sk")},
        ).fetchone()
        job = row[0] if row else None
    out: dict[str, Any] = {"job": job, "ops": [], "slow": [], "path": [], "causes": []}
    if job is None:
        return out
    p["j"] = job
    base = f"""WITH c AS (
        SELECT comm, op, op_seq, rank, node, device, ts_ns,
               min(ts_ns) OVER w AS t0, ts_ns - min(ts_ns) OVER w AS skew
        FROM collectives WHERE job = $j AND {window}
        WINDOW w AS (PARTITION BY comm, op, op_seq))"""
    q = {k: p[k] for k in ("s", "e", "j", "sk")}
    out["ops"] = con.execute(
        f"""{base} SELECT comm, op, op_seq, min(t0) AS t0, count(*) AS ranks,
                   max(skew) FILTER (WHERE skew <= $sk) / 1e6,
                   median(skew) / 1e6, count(*) FILTER (WHERE skew > $sk)
            FROM c GROUP BY ALL ORDER BY t0, comm, op_seq LIMIT {int(most)}""",
        q,
    ).fetchall()
    out["slow"] = con.execute(
        f"""{base} SELECT rank, node, device, op_seq, ts_ns, t0, skew / 1e6 FROM c
            WHERE skew > $sk ORDER BY skew DESC LIMIT {int(most)}""",
        q,
    ).fetchall()
    causes = named(
        con,
        "stragglers",
        scope.named(job=job, skew_ms=str(skew_ms), limit="100000", window_s="10"),
        STRAGGLER_COLS,
    )
    out["causes"] = causes
    path = {(r[6], r[10], r[11], r[12]) for r in causes}  # node, nic, leaf, leaf_port
    con.execute(
        "CREATE OR REPLACE TEMP TABLE report_path "
        "(node VARCHAR, nic VARCHAR, leaf VARCHAR, leaf_port VARCHAR)"
    )
    if path:
        con.executemany("INSERT INTO report_path VALUES (?, ?, ?, ?)", [list(x) for x in path])
        out["path"] = con.execute(
            f"""SELECT ts // $b * $b AS t,
                       coalesce(sum(delta) FILTER (WHERE metric = '{PAUSE}'), 0) / $bs,
                       coalesce(sum(delta) FILTER (WHERE metric IN ('{CNP_SENT}',
                                                   '{CNP_HANDLED}')), 0) / $bs
                FROM rates AS r
                WHERE metric IN ('{PAUSE}', '{CNP_SENT}', '{CNP_HANDLED}')
                  AND ts >= $s AND ts < $e
                  AND EXISTS (SELECT 1 FROM report_path AS p
                              WHERE (p.node = r.node AND p.nic = coalesce(r.nic, r.nic_dev))
                                 OR (p.leaf = r.leaf AND p.leaf_port = r.leaf_port))
                GROUP BY ALL ORDER BY t""",
            scope.params(bs=scope.bucket_s),
        ).fetchall()
    return out


# --- (3) GPU clocks --------------------------------------------------------------------------


def gpu_data(con: duckdb.DuckDBPyConnection, scope: Scope, gpus: int = 8) -> dict[str, Any]:
    """``by_cause``: gpu_throttling_by_cause rows (THROTTLE_COLS, job-filtered);
    ``clock``: (node, gpu, t, mean SM MHz, OR of non-idle reason bits) per bucket for the
    ``gpus`` GPUs throttled longest (else the lowest-clocked); ``fleet``: (t, median SM MHz
    over every GPU)."""
    jf = "TRUE" if scope.job is None else "job = $j"
    thr = named(con, "gpu_throttling_by_cause", scope.named(), THROTTLE_COLS)
    if scope.job is not None:
        thr = [r for r in thr if scope.job in (r[8] or [])]
    secs: dict[tuple[str, str], float] = {}
    for r in thr:
        secs[(r[0], r[1])] = secs.get((r[0], r[1]), 0.0) + float(r[4] or 0.0)
    pick = sorted(secs, key=lambda k: (-secs[k], k))[:gpus]
    p = scope.params(j=scope.job) if scope.job is not None else scope.params()
    if not pick:
        pick = [
            (r[0], r[1])
            for r in con.execute(
                f"""SELECT node, device FROM samples
                    WHERE metric = 'gpu.sm_clock' AND ts >= $s AND ts < $e AND {jf}
                    GROUP BY ALL ORDER BY avg(value), node, device LIMIT {int(gpus)}""",
                {k: v for k, v in p.items() if k != "b"},
            ).fetchall()
        ]
    con.execute("CREATE OR REPLACE TEMP TABLE report_gpus (node VARCHAR, device VARCHAR)")
    if pick:
        con.executemany("INSERT INTO report_gpus VALUES (?, ?)", [list(x) for x in pick])
    clock = con.execute(
        f"""SELECT node, device, ts // $b * $b AS t,
                   avg(value) FILTER (WHERE metric = 'gpu.sm_clock'),
                   bit_or(CAST(value AS UBIGINT) & ~CAST({IDLE_BITS} AS UBIGINT))
                       FILTER (WHERE metric = 'gpu.clock_event_reasons')
            FROM samples
            WHERE metric IN ('gpu.sm_clock', 'gpu.clock_event_reasons') AND value IS NOT NULL
              AND ts >= $s AND ts < $e AND {jf}
              AND (node, device) IN (SELECT (node, device) FROM report_gpus)
            GROUP BY ALL ORDER BY node, device, t""",
        p,
    ).fetchall()
    fleet = con.execute(
        f"""SELECT ts // $b * $b AS t, median(value) FROM samples
            WHERE metric = 'gpu.sm_clock' AND value IS NOT NULL AND ts >= $s AND ts < $e
              AND {jf}
            GROUP BY ALL ORDER BY t""",
        p,
    ).fetchall()
    return {"by_cause": thr, "clock": clock, "fleet": fleet, "gpus": pick}


# --- (4) clocks --------------------------------------------------------------------------------


def clock_data(con: duckdb.DuckDBPyConnection, scope: Scope, sources: int = 10) -> dict[str, Any]:
    """``series``: (source, t, mean clock_offset ms, max clock_error ms, late rows) per bucket
    for the ``sources`` sources (node/exporter/instance) with the largest |offset|;
    ``total``: sources in scope."""
    rows = con.execute(
        f"""WITH s AS (
                SELECT node || '/' || exporter || '/' || instance AS source, ts, late,
                       clock_offset_ns, clock_error_ns
                FROM samples WHERE ts >= $s AND ts < $e AND {_nodes_sql(scope)}
            ),
            top AS (
                SELECT source, max(abs(clock_offset_ns)) AS m FROM s GROUP BY source
            ),
            pick AS (SELECT source FROM top ORDER BY m DESC, source LIMIT {int(sources)})
            SELECT source, ts // $b * $b AS t, avg(clock_offset_ns) / 1e6,
                   max(clock_error_ns) / 1e6, count(*) FILTER (WHERE late),
                   (SELECT count(*) FROM top)
            FROM s WHERE source IN (SELECT source FROM pick)
            GROUP BY ALL ORDER BY source, t""",
        scope.params(),
    ).fetchall()
    return {"series": [r[:5] for r in rows], "total": rows[0][5] if rows else 0}


# --- (5) data quality ----------------------------------------------------------------------------


def quality_data(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """``accounting``: lake_accounting rows (raw_partition, input, refined, duplicate,
    quarantined, unaccounted, ok) for the raw partitions that carried the scope's samples or
    dead letters (whole-partition totals: accounting rows have no sample times);
    ``dead``: (reason, records, samples);
    ``findings``: data_quality rows (check, subject, count, value, detail) for the scope."""
    acc = con.execute(
        f"""SELECT raw_partition, input_samples, refined_samples, duplicate_samples,
                   quarantined_samples, unaccounted_samples, ok
            FROM lake_accounting
            WHERE raw_partition IN (
                SELECT raw_partition FROM samples
                WHERE ts >= $s AND ts < $e AND {_nodes_sql(scope)}
                UNION SELECT partition FROM deadletter
                WHERE ts >= $s AND ts < $e AND {_nodes_sql(scope)}
                  AND (topic = 'telemetry.raw' OR topic LIKE '%.raw'))
            ORDER BY raw_partition""",
        {"s": scope.start_ns, "e": scope.end_ns},
    ).fetchall()
    dead = con.execute(
        f"""SELECT reason, count(*), coalesce(sum(samples), 0) FROM deadletter
            WHERE ts >= $s AND ts < $e AND {_nodes_sql(scope)}
            GROUP BY reason ORDER BY count(*) DESC, reason""",
        {"s": scope.start_ns, "e": scope.end_ns},
    ).fetchall()
    findings = named(con, "data_quality", scope.named(), QUALITY_COLS)
    if scope.nodes is not None:
        node_checks = {"gap", "reset", "duplicate_in_lake", "clock_offset"}
        findings = [
            f for f in findings if f[0] not in node_checks or scope.node_ok(f[1].split("/")[0])
        ]
        parts = {f"raw partition {r[0]}" for r in acc}
        findings = [f for f in findings if f[0] != "duplicate_deduplicated" or f[1] in parts]
        findings = [f for f in findings if f[0] != "deadletter"]
        findings += [("deadletter", r, c, float(n), "records") for r, c, n in dead]
    return {"accounting": acc, "dead": dead, "findings": findings}
