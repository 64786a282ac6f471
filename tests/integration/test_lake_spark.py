"""Apache Spark reads the Iceberg lake the lander writes: Iceberg's JdbcCatalog on the same
catalog database as pyiceberg's SqlCatalog (SQLite; PostgreSQL as well when the server
binaries are installed), and the Spark SQL form of every named query (``sql/spark/``)
answers what ``refinery query`` (DuckDB, :mod:`services.lake.sqlload`) answers on the same
tables. A commit the sink makes while Spark's catalog is open is seen by Spark's next query.

Skipped, with the reason, without pyspark (``pip install -e '.[spark]'``), java or mvn, or
when Maven cannot fetch the jars (cached under ``~/.cache/refinery/spark-jars-*``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pydantic import SecretStr

from lab import spark as lab_spark
from lab.lake import synth
from lab.postgres import LocalPostgres, PostgresUnavailable
from services.lake import sqlload
from services.lake.backend import open_writer
from services.lake.datasets import JOBS_SCHEMA, TOPOLOGY_SCHEMA
from services.lake.iceberg import IcebergSettings, SnapshotFiles
from services.lake.iceberg_sink import IcebergLakeSink

pytestmark = pytest.mark.slow

# every named query, with parameters that find rows in the landed data (synth's PFC bursts
# pause a port for up to 5% of a second; see _land_findings for what else is there)
QUERIES: dict[str, dict[str, str]] = {
    "data_quality": {},
    "gpu_throttling_by_cause": {"start": "2026-01-01 00:00:30"},
    "job_busbw": {"bucket_s": "10"},
    "pfc_storms": {"min_paused_fraction": "0.01", "min_seconds": "0"},
    "stragglers": {"window_s": "5"},
    "top_congested_links": {},
}


@pytest.fixture(scope="module")
def jars() -> list[Path]:
    try:
        import pyspark  # noqa: F401

        from lab.broker import java_binary

        java_binary()
        return lab_spark.resolve_jars()
    except ImportError:
        pytest.skip("pyspark not installed (pip install -e '.[spark]')")
    except Exception as e:  # SparkUnavailable, BrokerError (no java)
        pytest.skip(f"Spark cannot run here: {e}")


def _land(tmp: Path, url: str) -> tuple[IcebergLakeSink, int]:
    ice = IcebergSettings(lake_format="iceberg", iceberg_catalog=SecretStr(url))
    sink = open_writer(tmp / "lake", iceberg=ice)
    assert isinstance(sink, IcebergLakeSink)
    sink.ensure_seeds()
    samples = synth.refined_samples(nodes=2, seconds=90, start_ns=synth.T0_NS)
    synth.land_lake(sink, samples, chunk_rows=4_000, partitions=2)
    return sink, samples.num_rows + _land_findings(sink, samples)


def _land_findings(sink: IcebergLakeSink, samples: pa.Table) -> int:
    """What the queries look for beyond synth's lake (landed after it, at offsets above its
    own): a second placement of synth's job that moves each rank to the other node (the
    straggler rank 5 to node001); netdev facts mapping eth<g> to mlx5_<g> port 1 and a
    second version of node001's links from 10 s on (switch port 9); 3 s of samples after a
    30 s gap (every series has a gap) with counter resets (rdma.np_cnp_sent), late rows
    (cpu) and an unknown clock on node001 (error bound 2**62 ns); and 500 rows landed twice
    (duplicates in the lake). Returns the samples landed."""
    ranks = [{"rank": r, "node": f"node{1 - r // 8:03d}", "gpu": f"gpu{r % 8}"} for r in range(16)]
    job = {"ts": synth.T0_NS, "job": "job-1001", "start_ns": synth.T0_NS, "ranks": ranks}
    row = {"kafka_partition": 0, "kafka_offset": 1, **job}
    sink.land("jobs", pa.Table.from_pylist([row], schema=JOBS_SCHEMA), partition=0, first=1, last=1)
    netdevs = [
        {
            "ts": 0,
            "id": f"netdev:node{n:03d}:eth{g}",
            "kind": "netdev",
            "valid_from": 0,
            "node": f"node{n:03d}",
            "device": f"eth{g}",
            "nic": f"mlx5_{g}",
            "attrs": '{"port": 1}',
            "source": "sim",
            "kafka_partition": 0,
            "kafka_offset": 100 + 8 * n + g,
        }
        for n in range(2)
        for g in range(8)
    ]
    later = synth.topology(2, valid_from=synth.T0_NS + 10 * 10**9)
    later = later.filter(
        pc.and_(pc.equal(later["kind"], "link"), pc.equal(later["node"], "node001"))
    )
    later = later.set_column(
        later.schema.get_field_index("switch_port"),
        "switch_port",
        pa.array(["9"] * later.num_rows, pa.string()),
    )
    topo = pa.concat_tables([pa.Table.from_pylist(netdevs, schema=TOPOLOGY_SCHEMA), later])
    sink.land("topology", topo, partition=0, first=1, last=1)
    more = synth.refined_samples(nodes=2, seconds=3, start_ns=synth.T0_NS + 120 * 10**9, seed=1)
    for name, values in (
        ("reset", pc.equal(more["metric"], "rdma.np_cnp_sent")),
        ("late", pc.equal(more["device"], "cpu")),
        (
            "clock_error_ns",
            pc.if_else(pc.equal(more["node"], "node001"), 2**62, more["clock_error_ns"]),
        ),
    ):
        more = more.set_column(more.schema.get_field_index(name), name, values)
    twice = samples.slice(0, 500)
    sink.land("samples", more, partition=0, first=100, last=100)
    sink.land("samples", twice, partition=0, first=101, last=101)
    return int(more.num_rows + twice.num_rows)


def _norm(rows: list[tuple[Any, ...]]) -> list[str]:
    """Rows as sortable text, floats to 9 significant digits (sums add in another order)."""
    return sorted(
        repr(tuple(float(f"{v:.9g}") if isinstance(v, float) else v for v in r)) for r in rows
    )


def _compare(spark: Any, sink: IcebergLakeSink, tmp: Path) -> dict[str, tuple[int, float, float]]:
    """Each query of QUERIES by Spark and by DuckDB: the same rows. Returns per query the
    row count and both times (s)."""
    files = SnapshotFiles(sink.catalog, "refinery", sink.seed_path)
    con = sqlload.connect(tmp / "lake", iceberg=files)
    out = {}
    for name, params in QUERIES.items():
        t0 = time.perf_counter()
        got = lab_spark.run_query(spark, name, params)
        t1 = time.perf_counter()
        want = sqlload.run_query(con, name, params).fetchall()
        t2 = time.perf_counter()
        assert want, f"{name}: DuckDB found nothing to compare with"
        assert _norm(got) == _norm(want), name
        out[name] = (len(want), t1 - t0, t2 - t1)
    return out


@pytest.fixture
def postgres_url() -> Iterator[str]:
    try:
        pg = LocalPostgres.start()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server here: {e}")
    try:
        yield pg.create_database(f"spark_{uuid.uuid4().hex[:8]}")
    finally:
        pg.stop()


def test_spark_answers_the_named_queries_as_duckdb_over_a_sqlite_catalog(
    jars: list[Path], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/catalog.db"
    sink, rows = _land(tmp_path, url)
    t0 = time.perf_counter()
    spark = lab_spark.spark_session(
        url, f"file://{tmp_path}/lake", jars=jars, scratch=tmp_path / "spark"
    )
    try:
        lab_spark.use_namespace(spark, "refinery")
        started = time.perf_counter() - t0
        assert spark.sql("SELECT count(*) FROM samples").collect()[0][0] == rows
        figures = _compare(spark, sink, tmp_path)
        # the lander commits while Spark's catalog is open (on SQLite: not locked out, see
        # lab.spark.jdbc_catalog_conf) and Spark's next query sees it
        more = synth.refined_samples(nodes=2, seconds=3, start_ns=synth.T0_NS + 7_200 * 10**9)
        sink.land("samples", more, partition=0, first=1_000, last=1_001)
        count = spark.sql("SELECT count(*) FROM samples").collect()[0][0]
        assert count == rows + more.num_rows
    finally:
        spark.stop()
    print(
        f"\nspark session {started:.1f} s; "
        + "; ".join(
            f"{n}: {k} rows, spark {s:.2f} s, duckdb {d:.2f} s" for n, (k, s, d) in figures.items()
        )
    )


def test_spark_reads_a_postgresql_catalog(
    jars: list[Path], tmp_path: Path, postgres_url: str
) -> None:
    sink, rows = _land(tmp_path, postgres_url)
    spark = lab_spark.spark_session(
        postgres_url, f"file://{tmp_path}/lake", jars=jars, scratch=tmp_path / "spark"
    )
    try:
        lab_spark.use_namespace(spark, "refinery")
        assert spark.sql("SELECT count(*) FROM samples").collect()[0][0] == rows
        _compare(spark, sink, tmp_path)
        sink.land(
            "samples", synth.refined_samples(nodes=1, seconds=2), partition=1, first=99, last=99
        )
        assert spark.sql("SELECT count(*) FROM samples").collect()[0][0] > rows
    finally:
        spark.stop()
