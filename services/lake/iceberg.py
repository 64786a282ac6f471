"""The lake as Apache Iceberg tables: settings, the SQL catalog, one table per dataset, the
Kafka offsets each snapshot carries, snapshot expiry, and the file lists DuckDB reads.

=============================  ===============================================  ===========
variable                       meaning                                          default
=============================  ===============================================  ===========
REFINERY_LAKE_FORMAT           ``parquet`` (files, the default) or ``iceberg``  parquet
REFINERY_ICEBERG_CATALOG       SQLAlchemy URL of the pyiceberg SQL catalog:     (required
                               ``sqlite:////var/lib/refinery/catalog.db`` on    for iceberg)
                               one machine, ``postgresql+psycopg2://u:p@h/db``
                               for several (a secret: it may hold a password)
REFINERY_ICEBERG_NAMESPACE     the catalog namespace of the tables              refinery
REFINERY_ICEBERG_KEEP_S        snapshot expiry keeps snapshots this recent      3600
=============================  ===============================================  ===========

The warehouse is ``REFINERY_LAKE`` (a directory or ``s3://bucket/prefix`` with the S3
settings of :mod:`services.lake.s3store`); table ``<namespace>.<dataset>`` lives in
``<lake>/<namespace>/<dataset>``. Each table has the dataset's columns plus ``date`` and
``hour`` (UTC, of ``ts``: the columns the Parquet lake's directories give its readers) and is
partitioned by identity on them, one partition per hour. ``samples.raw`` (uint64, which
Iceberg lacks) is ``decimal(20,0)``.

Every snapshot the lander commits carries, in its summary, ``refinery.kafka-offsets``: the
last landed Kafka offset of every source partition of the dataset's topic so far (JSON
``{"0": 41, "1": 17}``), merged with what the snapshot before it carried. The newest
ancestor of the current snapshot that has the key (:func:`landed_offsets`) is where landing
resumes; :func:`expire_snapshots` never removes it.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.errors import ConfigError
from services.lake.datasets import DATASETS, Dataset
from services.lake.location import LakeLocation
from services.lake.store import StoreAccessError, StoreUnavailable

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.table import Table

    from services.lake.s3store import S3Settings

OFFSETS_KEY = "refinery.kafka-offsets"
TOPIC_KEY = "refinery.kafka-topic"
COMPACTED_KEY = "refinery.compacted"  # on compaction's snapshots: the hour it rewrote

# commit retries off: pyiceberg's retry re-applies a stale append on top of the new snapshot
# (measured: 320 rows, 310 distinct); the sink re-reads the offsets and retries itself
TABLE_PROPERTIES = {
    "format-version": "2",
    "commit.retry.num-retries": "0",
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "50",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
}


class IcebergSettings(BaseSettings):
    """The lake's format and, for Iceberg, its catalog (table in the module docstring)."""

    model_config = SettingsConfigDict(env_prefix="REFINERY_", frozen=True, extra="ignore")

    lake_format: Literal["parquet", "iceberg"] = "parquet"
    iceberg_catalog: SecretStr | None = None
    iceberg_namespace: str = "refinery"
    iceberg_keep_s: float = Field(default=3600.0, gt=0)

    @property
    def is_iceberg(self) -> bool:
        return self.lake_format == "iceberg"


def warehouse_url(lake: LakeLocation) -> str:
    return f"file://{lake.path}" if lake.path is not None else lake.url


def _fileio_properties(s3: S3Settings | None) -> dict[str, str]:
    """pyiceberg's PyArrowFileIO settings for the lake's S3-compatible store."""
    if s3 is None:
        return {}
    props = {
        "s3.region": s3.region_name,
        "s3.force-virtual-addressing": str(not s3.use_path_style).lower(),
        "s3.connect-timeout": str(s3.timeout_s),
        "s3.request-timeout": str(s3.timeout_s),
    }
    if s3.endpoint:
        props["s3.endpoint"] = s3.endpoint
    if s3.access_key_id:
        props["s3.access-key-id"] = s3.access_key_id
    if s3.secret_access_key is not None:
        props["s3.secret-access-key"] = s3.secret_access_key.get_secret_value()
    if s3.session_token is not None:
        props["s3.session-token"] = s3.session_token.get_secret_value()
    return props


# pyarrow's S3 errors (AWS SDK error names, curl's) that say the store was out of reach or
# failing for a while: refused or cut connections, timeouts, 5xx, throttling
_UNREACHABLE = re.compile(
    r"NETWORK_CONNECTION|curlCode|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|SLOW_DOWN|THROTTLING"
    r"|REQUEST_TIMEOUT|Unable to connect|HTTP status 5\d\d"
)


def fileio_unavailable(e: BaseException, where: str) -> StoreUnavailable | None:
    """``e``, raised by a table's FileIO (pyarrow's S3 file system), as StoreUnavailable
    (``<where>: cannot reach the store (...)``, as :class:`~services.lake.s3store.S3ObjectStore`
    says it) when it means the store could not be reached; None for any other error (a
    missing object, access denied, a local file system's errors)."""
    if isinstance(e, ConnectionError | TimeoutError):
        cause = _first_line(e)
    elif isinstance(e, OSError) and not isinstance(e, FileNotFoundError | PermissionError):
        text = " ".join(str(e).split())
        if _UNREACHABLE.search(text) is None:
            return None
        cause = text[text.find("AWS Error") :] if "AWS Error" in text else text
        cause = cause.split(";", 1)[0]
    else:
        return None
    return StoreUnavailable(f"{where}: cannot reach the store ({cause[:160]})")


def open_catalog(
    settings: IcebergSettings, lake: LakeLocation, s3: S3Settings | None = None
) -> SqlCatalog:
    """The SQL catalog (its tables created when absent). ConfigError without a catalog URL;
    StoreAccessError / StoreUnavailable (one line) when its database refuses or is down."""
    import sqlalchemy.exc
    from pyiceberg.catalog.sql import SqlCatalog

    if settings.iceberg_catalog is None or not settings.iceberg_catalog.get_secret_value():
        raise ConfigError(
            "REFINERY_LAKE_FORMAT=iceberg needs REFINERY_ICEBERG_CATALOG, a SQLAlchemy URL "
            "(sqlite:////path/catalog.db, postgresql+psycopg2://user:pass@host/db)"
        )
    if s3 is None and lake.path is None:  # an s3:// warehouse: the store's settings from the
        from services.lake.s3store import S3Settings  # environment, as the lake's own store

        s3 = S3Settings()
    uri = settings.iceberg_catalog.get_secret_value()
    props = {"uri": uri, "warehouse": warehouse_url(lake), "init_catalog_tables": "true"}
    # a pooled connection the database dropped (restart, failover) is replaced at checkout
    props["pool_pre_ping"] = "true"
    for attempt in range(3):
        try:
            return SqlCatalog("refinery", **props, **_fileio_properties(s3))
        except sqlalchemy.exc.OperationalError as e:
            # two landers starting on a new catalog both create its tables: the one that
            # lost the race finds them made (SQLite says so as an OperationalError)
            if "already exists" in str(e) and attempt < 2:
                continue
            raise StoreUnavailable(f"iceberg catalog {_safe(uri)}: {_first_line(e)}") from None
        except sqlalchemy.exc.SQLAlchemyError as e:
            if "already exists" in str(e) and attempt < 2:
                continue
            raise StoreAccessError(f"iceberg catalog {_safe(uri)}: {_first_line(e)}") from None
    raise AssertionError("unreachable")


def _safe(uri: str) -> str:
    """The URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(uri).render_as_string(hide_password=True)
    except Exception:
        return "(unparsable URL)"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# --- tables --------------------------------------------------------------------------------


def table_schema(dataset: str) -> pa.Schema:
    """The Arrow schema of ``dataset``'s table: its columns (uint64 as decimal(20,0)), then
    ``date`` (date32) and ``hour`` (int32), both UTC of ``ts`` and non-null."""
    fields = []
    for f in DATASETS[dataset].schema:
        if pa.types.is_uint64(f.type):
            f = f.with_type(pa.decimal128(20, 0))
        fields.append(f.remove_metadata())
    fields += [pa.field("date", pa.date32(), nullable=False)]
    fields += [pa.field("hour", pa.int32(), nullable=False)]
    return pa.schema(fields)


def with_hour_columns(table: pa.Table, schema: pa.Schema, date: str, hour: str) -> pa.Table:
    """The rows of one UTC hour of ``table`` (conformed to its dataset's schema) cast to
    ``schema`` (:func:`table_schema`, field ids included or not), with ``date`` and ``hour``
    set to that hour (``"YYYY-MM-DD"``, ``"HH"``)."""
    n = table.num_rows
    day = datetime.strptime(date, "%Y-%m-%d").date()
    cols = []
    for f in schema:
        if f.name == "date":
            cols.append(pa.array([day] * n, pa.date32()) if n else pa.array([], pa.date32()))
        elif f.name == "hour":
            cols.append(pa.array([int(hour)] * n, pa.int32()))
        else:
            col = table.column(f.name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            cols.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def open_table(catalog: SqlCatalog, namespace: str, dataset: str) -> Table:
    """``namespace.dataset``, created (hour-partitioned, retries off) when absent; a column
    the dataset gained since is added. Safe against a concurrent creator."""
    from pyiceberg.exceptions import NoSuchTableError

    ident = (namespace, dataset)
    try:
        table = catalog.load_table(ident)
    except NoSuchTableError:
        catalog.create_namespace_if_not_exists(namespace)
        schema = iceberg_schema(dataset)
        props = {**TABLE_PROPERTIES, **metrics_properties(dataset)}
        table = catalog.create_table_if_not_exists(
            ident, schema=schema, partition_spec=_spec(schema), properties=props
        )
    want = table_schema(dataset)
    have = set(table.schema().column_names)
    if any(f.name not in have for f in want):
        with table.update_schema() as update:
            update.union_by_name(want)
        table = catalog.load_table(ident)
    return table


def stat_columns(ds: Dataset) -> list[str]:
    """The columns whose min/max the data files carry: ``ts`` and the sort key."""
    return list(dict.fromkeys(("ts", *ds.sort_by, "date", "hour")))


def metrics_properties(dataset: str) -> dict[str, str]:
    """Iceberg column metrics: min/max and counts where the files have statistics, else none."""
    cols = stat_columns(DATASETS[dataset])
    return {
        "write.metadata.metrics.default": "none",
        **{f"write.metadata.metrics.column.{c}": "full" for c in cols},
    }


def iceberg_schema(dataset: str) -> Any:
    """:func:`table_schema` as a pyiceberg Schema with field ids assigned."""
    from pyiceberg.io.pyarrow import _ConvertToIcebergWithoutIDs, visit_pyarrow
    from pyiceberg.schema import assign_fresh_schema_ids

    converted = visit_pyarrow(table_schema(dataset), _ConvertToIcebergWithoutIDs())
    return assign_fresh_schema_ids(converted)


def _spec(schema: Any) -> Any:
    """Identity partitions on ``date`` then ``hour``: one per UTC hour of ``ts``."""
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import IdentityTransform

    return PartitionSpec(
        PartitionField(schema.find_field("date").field_id, 1000, IdentityTransform(), "date"),
        PartitionField(schema.find_field("hour").field_id, 1001, IdentityTransform(), "hour"),
    )


# --- offsets -------------------------------------------------------------------------------


def _lineage(table: Table) -> Iterator[Any]:
    from pyiceberg.table.snapshots import ancestors_of

    return iter(ancestors_of(table.current_snapshot(), table.metadata))


def offsets_snapshot(table: Table) -> Any | None:
    """The newest ancestor of the current snapshot whose summary carries the offsets."""
    for snap in _lineage(table):
        if snap.summary is not None and OFFSETS_KEY in snap.summary.additional_properties:
            return snap
    return None


def landed_offsets(table: Table) -> dict[int, int]:
    """``{partition: last landed offset}`` as of ``table``'s current snapshot."""
    snap = offsets_snapshot(table)
    if snap is None:
        return {}
    doc = json.loads(snap.summary.additional_properties[OFFSETS_KEY])
    return {int(p): int(o) for p, o in doc.items()}


def offsets_property(landed: dict[int, int]) -> str:
    return json.dumps({str(p): o for p, o in sorted(landed.items())}, separators=(",", ":"))


def data_files(table: Table) -> list[str]:
    """The data files of the current snapshot (append-only tables: no delete files)."""
    return [path for path, _ in sized_data_files(table)]


def sized_data_files(table: Table) -> list[tuple[str, int]]:
    """The data files of the current snapshot with their sizes in bytes."""
    snap = table.current_snapshot()
    if snap is None:
        return []
    io = table.io
    return [
        (e.data_file.file_path, int(e.data_file.file_size_in_bytes))
        for m in snap.manifests(io)
        for e in m.fetch_manifest_entry(io, discard_deleted=True)
    ]


def duckdb_path(path: str) -> str:
    """A data file's path as DuckDB reads it (``file:`` URLs as plain paths)."""
    return path[len("file://") :] if path.startswith("file://") else path


# --- expiry --------------------------------------------------------------------------------


def expire_snapshots(table: Table, keep_s: float, *, now: float | None = None) -> int:
    """Expire the snapshots older than ``keep_s`` seconds except the current one, the newest
    carrying the Kafka offsets and those between them (so that :func:`landed_offsets` still
    reaches it); delete their manifest lists, and the data files compaction replaced once no
    snapshot older than its own is left (:func:`replaced_files`). Returns how many went.
    The commit may fail on a concurrent append (CommitFailedException): try again later."""
    cutoff_ms = int(((time.time() if now is None else now) - keep_s) * 1000)
    keep = {s.snapshot_id for s in _to_offsets(table)}
    old = [
        s
        for s in table.metadata.snapshots
        if s.timestamp_ms < cutoff_ms and s.snapshot_id not in keep
    ]
    if not old:
        return 0
    freed = replaced_files(table, {s.snapshot_id for s in old})
    table.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in old]).commit()
    for s in old:  # referenced by nothing now; a manifest may be shared, so those stay
        with contextlib.suppress(OSError):
            table.io.delete(s.manifest_list)
    for path in freed:
        with contextlib.suppress(OSError):
            table.io.delete(path)
    return len(old)


def _to_offsets(table: Table) -> list[Any]:
    """The current snapshot and its ancestors down to the newest carrying the offsets."""
    out = []
    for snap in _lineage(table):
        out.append(snap)
        if snap.summary is not None and OFFSETS_KEY in snap.summary.additional_properties:
            break
    else:
        return out[:1]  # no offsets anywhere: only the current one matters
    return out


def replaced_files(table: Table, expiring: set[int]) -> list[str]:
    """The data files that compaction snapshots (:data:`COMPACTED_KEY`) removed and that no
    snapshot will name once ``expiring`` is gone: those of each compaction snapshot that has
    an older snapshot now and none after the expiry (files are never added back)."""
    from pyiceberg.manifest import ManifestEntryStatus

    snaps = table.metadata.snapshots
    seq = {s.snapshot_id: s.sequence_number or 0 for s in snaps}  # set in format 2
    floor = min((q for i, q in seq.items() if i not in expiring), default=None)
    out: list[str] = []
    for s in snaps:
        if s.summary is None or COMPACTED_KEY not in s.summary.additional_properties:
            continue
        older = [q for q in seq.values() if q < seq[s.snapshot_id]]
        if not older or (floor is not None and floor < seq[s.snapshot_id]):
            continue  # freed earlier, or still named by a snapshot that stays
        for m in s.manifests(table.io):
            for e in m.fetch_manifest_entry(table.io, discard_deleted=False):
                if e.status == ManifestEntryStatus.DELETED and e.snapshot_id == s.snapshot_id:
                    out.append(e.data_file.file_path)
    return out


def snapshot_time(snap: Any) -> datetime:
    return datetime.fromtimestamp(snap.timestamp_ms / 1000, UTC)


# --- reading -------------------------------------------------------------------------------


class SnapshotFiles:
    """What DuckDB's views read of an Iceberg lake: for a dataset, its seed file and the data
    files of its table's current snapshot (re-listed only when the snapshot changed). A
    dataset without a table yet reads as its seed alone. ``localize(dataset, files)``, where
    given, names the path DuckDB reads each data file ``(url, size)`` by (an ``s3://``
    lake's local copies of small files: :meth:`~services.lake.s3read.LakeReadFS.read_urls`);
    it is asked again each time the snapshot changes."""

    def __init__(
        self,
        catalog: SqlCatalog,
        namespace: str,
        seed_path: Any,
        localize: Callable[[str, list[tuple[str, int]]], list[str]] | None = None,
    ) -> None:
        self.catalog = catalog
        self.namespace = namespace
        self.seed_path = seed_path  # dataset -> the seed file's path or URL
        self.localize = localize
        self._cache: dict[str, tuple[int | None, list[str]]] = {}

    def reading_through(
        self, localize: Callable[[str, list[tuple[str, int]]], list[str]]
    ) -> SnapshotFiles:
        """The same tables, their data files' paths named by ``localize``."""
        return SnapshotFiles(self.catalog, self.namespace, self.seed_path, localize)

    def __call__(self, dataset: str) -> list[str]:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self.catalog.load_table((self.namespace, dataset))
        except NoSuchTableError:
            return [self.seed_path(dataset)]
        snap = table.current_snapshot()
        sid = None if snap is None else snap.snapshot_id
        got = self._cache.get(dataset)
        if got is None or got[0] != sid:
            files = sized_data_files(table)
            paths = (
                self.localize(dataset, files)
                if self.localize is not None
                else [duckdb_path(p) for p, _ in files]
            )
            got = self._cache[dataset] = (sid, paths)
        return [self.seed_path(dataset), *got[1]]

    def register(self, con: Any) -> None:
        """Define ``iceberg_files(dataset)`` (a list of paths) on DuckDB connection ``con``."""
        from duckdb import list_type, sqltypes

        con.create_function(
            "iceberg_files",
            self,
            [sqltypes.VARCHAR],
            list_type(sqltypes.VARCHAR),
            side_effects=True,
        )
