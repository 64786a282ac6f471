"""Load ``sql/`` into a DuckDB connection over one lake, and run named queries by name.

The ``.sql`` files need nothing from Python: they read the lake root from the DuckDB variable
``lake`` (``SET VARIABLE lake = '/path'``) and every view reads the file list that
``sql/refresh.sql`` snapshots into ``lake_files_<dataset>`` (compaction-aware, see
``sql/lake.sql``). This module is the same thing done from Python::

    con = connect("/data/lake")          # SET VARIABLE lake, then sql/init.sql
    refresh(con)                         # see files landed since (run_query does it)
    rel = run_query(con, "pfc_storms", {"min_seconds": "5"})

Named queries (``sql/queries/*.sql``) start with a header::

    -- name: pfc_storms
    -- description: what it answers (continued on lines starting "--   ")
    -- param: min_seconds = 2 | what it means

and use their parameters as ``$min_seconds``.

An Iceberg lake (:mod:`services.lake.iceberg`) is read through the same views: ``connect``
given a :class:`~services.lake.iceberg.SnapshotFiles` defines ``iceberg_files(dataset)`` on the
connection and snapshots ``lake_files_<dataset>`` from it (each table's current snapshot) where
``sql/refresh.sql`` would list directories; :func:`refresh` does the same on such a connection.
A Parquet lake on ``s3://`` likewise snapshots them from ``lake_object_files(dataset)``: one
listing of the dataset's prefix, the same files ``lake_live_files`` would glob
(:mod:`services.lake.s3read`).

A parameter's default fixes its type: integer, float, ``true``/``false``, else text. Errors are
:class:`~services.lake.layout.LakeError` (unknown query or parameter, value of the wrong
type); DuckDB's own errors propagate.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from services.data_files import data_path
from services.lake.layout import LakeError
from services.lake.location import LakeLocation, parse_location

if TYPE_CHECKING:
    from services.lake.iceberg import SnapshotFiles
    from services.lake.s3store import S3Settings

SQL_DIR = data_path("sql")
_PARAM_RE = re.compile(r"^--\s*param:\s*([A-Za-z_]\w*)\s*=\s*(.*?)\s*(?:\|\s*(.*))?$")


@dataclass(frozen=True)
class Param:
    name: str
    default: str
    description: str

    def coerce(self, text: str) -> object:
        """``text`` as this parameter's type (the type of its default)."""
        kind = _kind(self.default)
        try:
            if kind is bool:
                if text.lower() not in ("true", "false"):
                    raise ValueError(text)
                return text.lower() == "true"
            return kind(text)
        except ValueError:
            raise LakeError(f"parameter {self.name}: {text!r} is not {kind.__name__}") from None


@dataclass(frozen=True)
class NamedQuery:
    name: str
    description: str
    params: dict[str, Param] = field(default_factory=dict)
    sql: str = ""
    path: Path | None = None


def _kind(default: str) -> type:
    if re.fullmatch(r"-?\d+", default):
        return int
    if re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", default):
        return float
    if default.lower() in ("true", "false"):
        return bool
    return str


def parse_query(path: Path) -> NamedQuery:
    """Read one named query file and its header; raises LakeError for a missing name."""
    text = path.read_text()
    name, desc, params = None, [], {}
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        if m := re.match(r"^--\s*name:\s*(\S+)", line):
            name = m.group(1)
        elif m := re.match(r"^--\s*description:\s*(.*)$", line):
            desc.append(m.group(1))
        elif m := _PARAM_RE.match(line):
            params[m.group(1)] = Param(m.group(1), m.group(2), m.group(3) or "")
        elif line.startswith("--   ") and desc:
            desc.append(line[2:].strip())
    if name is None:
        raise LakeError(f"{path}: no '-- name:' header")
    return NamedQuery(name, " ".join(desc), params, text, path)


def list_queries(sql_dir: Path = SQL_DIR) -> dict[str, NamedQuery]:
    """Every named query in ``sql_dir/queries``, by name."""
    out = {}
    for p in sorted((sql_dir / "queries").glob("*.sql")):
        q = parse_query(p)
        out[q.name] = q
    return out


def _script(path: Path, sql_dir: Path, *, listing: str = "lake_live_files(") -> list[str]:
    """Statements of an init script, with ``.read`` lines expanded (paths relative to the
    repository root, as the DuckDB CLI would read them from there); ``listing``: the function
    the file lists snapshot from (``iceberg_files(``, ``lake_object_files(``: defined on the
    connection) instead of directory listings."""
    out: list[str] = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith(".read "):
            rel = s[len(".read ") :].strip()
            target = sql_dir.parent / rel
            text = target.read_text()
            if target.name == "refresh.sql":
                text = _refresh_sql(sql_dir, listing)
            out.append(text)
    return out


def iceberg_refresh_sql(sql_dir: Path = SQL_DIR) -> str:
    """``sql/refresh.sql`` with every dataset's file list from ``iceberg_files()``."""
    return _refresh_sql(sql_dir, "iceberg_files(")


def _refresh_sql(sql_dir: Path, listing: str) -> str:
    return (sql_dir / "refresh.sql").read_text().replace("lake_live_files(", listing)


def connect(
    lake: Path | str | LakeLocation,
    con: duckdb.DuckDBPyConnection | None = None,
    *,
    sql_dir: Path = SQL_DIR,
    s3: S3Settings | None = None,
    iceberg: SnapshotFiles | None = None,
) -> duckdb.DuckDBPyConnection:
    """A connection (new, in memory, unless given) with every view of ``sql/views`` defined
    over ``lake``: a directory, or ``s3://bucket/prefix`` read through
    :class:`~services.lake.s3read.LakeReadFS` registered on the connection (``s3``: the
    store's settings, read from the environment when None), its file lists from one listing
    of each dataset's prefix (``lake_object_files(dataset)``); with ``iceberg``, over the
    current snapshots of the lake's Iceberg tables. Raises
    duckdb.Error when the lake has no seed file for a dataset, ConfigError for an
    unsupported scheme."""
    loc = lake if isinstance(lake, LakeLocation) else parse_location(lake)
    con = con if con is not None else duckdb.connect()
    if loc.path is not None:  # a plain path exactly as before; file:// as parsed
        plain = isinstance(lake, str | Path) and ":/" not in str(lake)
        root = str((Path(lake) if isinstance(lake, str | Path) and plain else loc.path).absolute())
    else:
        from services.lake.s3store import S3Settings

        fs = (s3 if s3 is not None else S3Settings()).register(con)
        root = loc.url
    con.execute("SET VARIABLE lake = ?", [root])
    listing = "lake_live_files("
    if iceberg is not None:
        if loc.path is None:  # small data files read as local copies, as a Parquet lake's
            iceberg = iceberg.reading_through(fs.read_urls)
        iceberg.register(con)
        con.execute("SET VARIABLE lake_format = 'iceberg'")
        listing = "iceberg_files("
    elif loc.path is None:
        _register_object_files(con, fs, loc)
        con.execute("SET VARIABLE lake_format = 'objects'")
        listing = "lake_object_files("
    for script in _script(sql_dir / "init.sql", sql_dir, listing=listing):
        con.execute(script)
    return con


def _register_object_files(con: duckdb.DuckDBPyConnection, fs: Any, loc: LakeLocation) -> None:
    """Define ``lake_object_files(dataset)`` on ``con``: the files ``lake_live_files`` would
    glob, from one listing of the dataset's prefix through ``fs`` (a
    :class:`~services.lake.s3read.LakeReadFS`), which remembers each object's size and ETag."""
    from duckdb import list_type, sqltypes

    from services.lake.s3read import lake_object_files

    def files(dataset: str) -> list[str]:
        objects = fs.list_objects(loc.bucket, loc.key(dataset))
        paths: list[str] = fs.read_paths(dataset, loc.bucket, lake_object_files(objects))
        return paths

    con.create_function(
        "lake_object_files", files, [sqltypes.VARCHAR], list_type(sqltypes.VARCHAR),
        side_effects=True,
    )  # fmt: skip


def iceberg_init_sql(lake: str, files: Callable[[str], list[str]], sql_dir: Path = SQL_DIR) -> str:
    """A DuckDB CLI init script (``duckdb -init FILE``) defining the views over the file
    lists ``files(dataset)`` gives now (an Iceberg lake's current snapshots)."""
    out = [f"SET VARIABLE lake = {_literal(lake)};"]
    for text in _script(sql_dir / "init.sql", sql_dir):
        if text == (sql_dir / "refresh.sql").read_text():
            for m in re.finditer(r"lake_files_(\w+) = lake_live_files\('(\w+)'\)", text):
                paths = ", ".join(_literal(p) for p in files(m.group(2)))
                out.append(f"SET VARIABLE lake_files_{m.group(1)} = [{paths}];")
        else:
            out.append(text)
    return "\n".join(out)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def refresh(con: duckdb.DuckDBPyConnection, *, sql_dir: Path = SQL_DIR) -> None:
    """Re-list the lake so views see files landed (and compactions done) since; on an
    Iceberg connection, each table's current snapshot."""
    row = con.execute("SELECT getvariable('lake_format')").fetchone()
    listing = {"iceberg": "iceberg_files(", "objects": "lake_object_files("}
    con.execute(_refresh_sql(sql_dir, listing.get(str(row[0] if row else ""), "lake_live_files(")))


def bind(query: NamedQuery, overrides: dict[str, str]) -> dict[str, object]:
    """Parameter values for ``query``: defaults, replaced by ``overrides`` (text)."""
    unknown = set(overrides) - set(query.params)
    if unknown:
        raise LakeError(f"query {query.name} has no parameter {', '.join(sorted(unknown))}")
    return {
        name: p.coerce(overrides.get(name, p.default))
        for name, p in query.params.items()
        if f"${name}" in query.sql
    }


def run_query(
    con: duckdb.DuckDBPyConnection,
    name: str,
    params: dict[str, str] | None = None,
    *,
    sql_dir: Path = SQL_DIR,
) -> duckdb.DuckDBPyConnection:
    """Refresh the file lists, run named query ``name``; returns the connection holding the
    result (``fetchall()``, ``description``, ``fetch_arrow_table()``)."""
    queries = list_queries(sql_dir)
    if name not in queries:
        raise LakeError(f"no query named {name!r} (see `refinery query --list`)")
    q = queries[name]
    refresh(con, sql_dir=sql_dir)
    return con.execute(q.sql, bind(q, params or {}))
