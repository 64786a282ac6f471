"""Apache Spark over the Iceberg lake: a local SparkSession that reads the tables the lander
writes, through Iceberg's ``JdbcCatalog`` on the same catalog database as pyiceberg's
``SqlCatalog`` (SQLite or PostgreSQL), and the Spark SQL forms of named queries
(``sql/spark/``).

Jars (:func:`resolve_jars`) come from Maven Central through ``mvn`` (as :mod:`lab.broker`
resolves Kafka's) into ``~/.cache/refinery/spark-jars-<iceberg version>/`` once:
``iceberg-spark-runtime-4.0_2.13`` (a shaded jar: nothing else needed), the Xerial SQLite and
the PostgreSQL JDBC drivers. pyspark comes from the ``spark`` extra (``pip install
-e '.[spark]'``); its minor version must be the runtime jar's Spark version (4.0).

The catalog must be named as pyiceberg names it (``refinery``: the ``catalog_name`` column of
``iceberg_tables``); tables are ``refinery.<namespace>.<dataset>``. pyiceberg creates
The catalog tables are the same: pyiceberg 0.12 creates ``iceberg_tables`` with Iceberg's V1
JDBC schema (``iceberg_type`` column, ``'TABLE'`` in its rows) and
``iceberg_namespace_properties`` as the Java catalog does; ``jdbc.schema-version=V1`` matches
it (a catalog made by an older pyiceberg lacks ``iceberg_type``: V1 adds it by ALTER TABLE
at start-up, V0 leaves it). The lander creates them: ``jdbc.init-catalog-tables=false`` (see
:func:`jdbc_catalog_conf`: with SQLite the Java probe would lock out the lander's commits).
Data files use BYTE_STREAM_SPLIT for floats, which Iceberg's vectorized reader refuses: the
session turns it off (``spark.sql.iceberg.vectorization.enabled=false``).

    spark = spark_session("sqlite:////var/lib/refinery/catalog.db", "file:///data/lake")
    use_namespace(spark, "refinery")     # USE refinery.refinery, then sql/spark/views.sql
    spark.sql("SELECT count(*) FROM samples WHERE date = DATE '2026-01-01'")
    rows = run_query(spark, "job_busbw", {"bucket_s": "10"})

Every failure to get Spark going (no pyspark, no java or mvn, a jar Maven cannot resolve)
raises :class:`SparkUnavailable` with one line saying what is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab.broker import default_cache_dir, java_binary
from schemas.errors import BrokerError, RefineryError
from services.data_files import data_path
from services.lake.sqlload import NamedQuery, parse_query

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ICEBERG_VERSION = "1.10.1"
SPARK_SERIES = "4.0"
JARS = (
    f"org.apache.iceberg:iceberg-spark-runtime-{SPARK_SERIES}_2.13:{ICEBERG_VERSION}",
    "org.xerial:sqlite-jdbc:3.50.3.0",
    "org.postgresql:postgresql:42.7.8",
)
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
SPARK_SQL_DIR = data_path("sql") / "spark"
CATALOG = "refinery"  # pyiceberg's catalog_name: the Spark catalog must carry the same name


class SparkUnavailable(RefineryError):
    """pyspark, java, mvn or a jar is missing: Spark cannot run here (one line why)."""


def resolve_jars(cache_dir: Path | None = None) -> list[Path]:
    """The jars of :data:`JARS` in ``cache_dir/spark-jars-<iceberg>/`` (default
    ``~/.cache/refinery``), fetched through ``mvn`` once (seconds to minutes; blocks).
    Raises SparkUnavailable without mvn or when Maven cannot resolve one."""
    lib = (cache_dir or default_cache_dir()) / f"spark-jars-{ICEBERG_VERSION}"
    marker = lib / ".complete"
    names = [_jar_name(coord) for coord in JARS]
    if marker.exists() and all((lib / n).exists() for n in names):
        return [lib / n for n in names]
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SparkUnavailable("mvn not found: install Apache Maven to fetch the Iceberg jars")
    lib.mkdir(parents=True, exist_ok=True)
    for coord in JARS:
        cmd = [mvn, "-q", "-B", f"{DEPENDENCY_PLUGIN}:copy", f"-Dartifact={coord}"]
        proc = subprocess.run(
            [*cmd, f"-DoutputDirectory={lib}"], capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
            raise SparkUnavailable(f"maven could not resolve {coord}: {last[0][:200]}")
    marker.write_text("\n".join(JARS) + "\n")
    return [lib / n for n in names]


def _jar_name(coord: str) -> str:
    _, artifact, version = coord.split(":")
    return f"{artifact}-{version}.jar"


def jdbc_catalog_conf(
    catalog_url: str, warehouse: str, schema_version: str = "V1"
) -> dict[str, str]:
    """Spark settings of catalog :data:`CATALOG`: Iceberg's JdbcCatalog on the database of
    the SQLAlchemy URL ``catalog_url`` (``sqlite:///...``, ``postgresql+psycopg2://...``)
    with ``warehouse`` (``file:///data/lake``, ``s3://...``). Raises SparkUnavailable for
    another database."""
    from sqlalchemy.engine import make_url

    url = make_url(catalog_url)
    pre = f"spark.sql.catalog.{CATALOG}"
    conf = {
        pre: "org.apache.iceberg.spark.SparkCatalog",
        f"{pre}.catalog-impl": "org.apache.iceberg.jdbc.JdbcCatalog",
        f"{pre}.warehouse": warehouse,
        f"{pre}.jdbc.schema-version": schema_version,
        f"{pre}.cache-enabled": "false",  # see each commit of the lander at the next query
        # the lander creates the catalog tables; the Java catalog's start-up probe of them
        # leaves a result set open, which on SQLite holds a read lock for the session's
        # lifetime: every commit of the lander then fails ("database is locked")
        f"{pre}.jdbc.init-catalog-tables": "false",
    }
    if url.get_backend_name() == "sqlite":
        conf[f"{pre}.uri"] = f"jdbc:sqlite:{url.database}"
    elif url.get_backend_name() == "postgresql":
        port = f":{url.port}" if url.port else ""
        conf[f"{pre}.uri"] = f"jdbc:postgresql://{url.host}{port}/{url.database}"
        if url.username:
            conf[f"{pre}.jdbc.user"] = url.username
        if url.password:
            conf[f"{pre}.jdbc.password"] = str(url.password)
    else:
        raise SparkUnavailable(f"no JDBC catalog for {url.get_backend_name()!r} here")
    return conf


def spark_session(
    catalog_url: str,
    warehouse: str,
    *,
    jars: list[Path] | None = None,
    memory: str = "1g",
    schema_version: str = "V1",
    scratch: Path | None = None,
    extra: dict[str, str] | None = None,
) -> SparkSession:
    """A ``local[2]`` SparkSession (UTC, no UI, 4 shuffle partitions) with catalog
    :data:`CATALOG` on ``catalog_url``; ``jars`` resolved when None. Starts a JVM (seconds;
    one per process: stop it with ``spark.stop()``). Raises SparkUnavailable."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise SparkUnavailable("pyspark not installed: pip install -e '.[spark]'") from None
    try:
        java_binary()
    except BrokerError as e:
        raise SparkUnavailable(str(e)) from None
    paths = jars if jars is not None else resolve_jars()
    tmp = scratch or Path(tempfile.mkdtemp(prefix="refinery-spark-"))
    conf = {
        "spark.master": "local[2]",
        "spark.app.name": "refinery-lake",
        "spark.driver.memory": memory,
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        # the lake's doubles are BYTE_STREAM_SPLIT-encoded, which Iceberg's vectorized
        # Parquet reader refuses ("Cannot support vectorized reads ... BYTE_STREAM_SPLIT")
        "spark.sql.iceberg.vectorization.enabled": "false",
        "spark.local.dir": str(tmp),
        "spark.sql.warehouse.dir": str(tmp / "spark-warehouse"),
        "spark.jars": ",".join(str(p) for p in paths),
        "spark.sql.extensions": (
            "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
        ),
        **jdbc_catalog_conf(catalog_url, warehouse, schema_version),
        **(extra or {}),
    }
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def statements(text: str) -> list[str]:
    """The statements of a ``.sql`` file (``;`` ends one at the end of a line)."""
    out, cur = [], []
    for line in text.splitlines():
        cur.append(line)
        if line.rstrip().endswith(";"):
            out.append("\n".join(cur).rstrip().rstrip(";"))
            cur = []
    rest = "\n".join(cur).strip()
    return [s for s in [*out, rest] if s.strip() and not _only_comments(s)]


def _only_comments(stmt: str) -> bool:
    return all(not ln.strip() or ln.strip().startswith("--") for ln in stmt.splitlines())


def use_namespace(spark: SparkSession, namespace: str, sql_dir: Path = SPARK_SQL_DIR) -> None:
    """``USE refinery.<namespace>`` (the tables by their dataset names, as DuckDB's views
    are named), then the temporary views of ``sql/spark/views.sql`` (``rates``,
    ``topology_links``, ...; a view named as its table, such as ``topology``, replaces it).

    A dataset without a table yet (the lander creates one with its first rows) reads as an
    empty temporary view with the table's columns, as DuckDB's views read the lake's empty
    seed file: the views over it (``node_facts`` in ``topology``) then bind. Such an empty
    view (and a view of the file named as it) hides a table created later until this runs
    again (it may run any number of times)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from services.lake.datasets import DATASETS
    from services.lake.iceberg import table_schema

    spark.sql(f"USE {CATALOG}.`{namespace}`")
    stmts = statements((sql_dir / "views.sql").read_text())
    views = [(_view(stmt), stmt) for stmt in stmts]
    # this file's views and the empty ones go first: a view that reads its own name
    # (``topology`` over table ``topology``) binds to the table only then
    for name in [*(v[0] for v, _ in views if v), *DATASETS]:
        spark.catalog.dropTempView(name)
    listed = spark.sql(f"SHOW TABLES IN {CATALOG}.`{namespace}`").collect()
    missing = set(DATASETS) - {r.tableName for r in listed}
    for dataset in sorted(missing):
        schema = from_arrow_schema(table_schema(dataset))
        spark.createDataFrame([], schema).createOrReplaceTempView(dataset)
    for view, stmt in views:
        if view and view[0] in missing:
            # over the empty view of the same name: SQL would see a cycle, a DataFrame's
            # view keeps the plan it was made with
            spark.sql(view[1]).createOrReplaceTempView(view[0])
        else:
            spark.sql(stmt)


_CREATE_VIEW = re.compile(
    r"^\s*CREATE\s+OR\s+REPLACE\s+TEMPORARY\s+VIEW\s+(\w+)\s+AS\s", re.M | re.I
)


def _view(stmt: str) -> tuple[str, str] | None:
    """The name and query of the temporary view a statement creates (None: another
    statement)."""
    m = _CREATE_VIEW.search(stmt)
    return (m.group(1), stmt[m.end() :]) if m else None


def list_queries(sql_dir: Path = SPARK_SQL_DIR) -> dict[str, NamedQuery]:
    """The Spark SQL forms of named queries (``sql/spark/queries/*.sql``), by name."""
    out = {}
    for p in sorted((sql_dir / "queries").glob("*.sql")):
        q = parse_query(p)
        out[q.name] = q
    return out


def run_query(
    spark: SparkSession,
    name: str,
    params: dict[str, str] | None = None,
    *,
    sql_dir: Path = SPARK_SQL_DIR,
) -> list[tuple[Any, ...]]:
    """Run the Spark form of named query ``name`` (parameters as ``refinery query`` takes
    them, bound as ``:name`` markers); its rows. Raises KeyError for an unknown name,
    LakeError for an unknown parameter or a value of the wrong type."""
    q = list_queries(sql_dir)[name]
    values = _bind(q, params or {})
    return [tuple(r) for r in spark.sql(q.sql, args=values).collect()]


def _bind(query: NamedQuery, overrides: dict[str, str]) -> dict[str, object]:
    """As :func:`services.lake.sqlload.bind`, for ``:name`` markers."""
    from services.lake.layout import LakeError

    unknown = set(overrides) - set(query.params)
    if unknown:
        raise LakeError(f"query {query.name} has no parameter {', '.join(sorted(unknown))}")
    return {
        n: p.coerce(overrides.get(n, p.default))
        for n, p in query.params.items()
        if f":{n}" in query.sql
    }
