"""One lake, two kinds of storage: what the lander, compaction and readers are given.

:func:`open_writer` and :func:`open_compactor` return the local-directory implementations
(:class:`~services.lake.writer.LakeWriter`, :class:`~services.lake.compact.Compactor`,
unchanged: temp file, fsync, rename) or the object-store ones
(:class:`~services.lake.objwriter.ObjectLakeWriter`,
:class:`~services.lake.objcompact.ObjectCompactor`: conditional creates, manifests as objects,
a lease) for ``s3://bucket/prefix``. Both satisfy :class:`LakeSink` / :class:`LakeCompaction`,
the only types the landing service knows. Any other scheme is a ConfigError (one line).

With ``REFINERY_LAKE_FORMAT=iceberg`` (:class:`~services.lake.iceberg.IcebergSettings`) the
writer is :class:`~services.lake.iceberg_sink.IcebergLakeSink`, a :class:`BatchLakeSink` (one
Iceberg append per flush of a dataset), and the compaction rewrites closed hours' small files
in one commit each, then expires old snapshots
(:class:`~services.lake.iceberg_maint.IcebergMaintenance`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.lake.compact import Compactor
from services.lake.location import LakeLocation, parse_location
from services.lake.sink import BatchLakeSink, Flush, LakeCompaction, LakeSink
from services.lake.writer import LakeWriter

__all__ = [
    "BatchLakeSink",
    "Flush",
    "LakeCompaction",
    "LakeSink",
    "check_lake",
    "connect_views",
    "has_data",
    "open_compactor",
    "open_writer",
]  # fmt: skip

if TYPE_CHECKING:
    from services.lake.iceberg import IcebergSettings
    from services.lake.s3store import S3ObjectStore, S3Settings


def _location(lake: Path | str | LakeLocation) -> LakeLocation:
    return lake if isinstance(lake, LakeLocation) else parse_location(lake)


def open_store(lake: Path | str | LakeLocation, s3: S3Settings | None = None) -> S3ObjectStore:
    """The :class:`~services.lake.store.ObjectStore` of an ``s3://`` lake (``s3``: its
    :class:`~services.lake.s3store.S3Settings`, read from the environment when None)."""
    from services.lake.s3store import S3ObjectStore

    loc = _location(lake)
    return S3ObjectStore(loc, s3)


def _iceberg(iceberg: IcebergSettings | None) -> IcebergSettings | None:
    return iceberg if iceberg is not None and iceberg.is_iceberg else None


def connect_views(
    lake: Path | str | LakeLocation,
    *,
    s3: S3Settings | None = None,
    iceberg: IcebergSettings | None = None,
    seed: bool = True,
) -> Any:
    """A DuckDB connection with ``sql/``'s views over ``lake`` in its format: the current
    snapshots of its Iceberg tables when ``iceberg`` says the format is iceberg, else its
    Parquet files (:func:`services.lake.sqlload.connect`). With ``seed``, seeds are made
    where missing and writable (views need every dataset to bind); without, a lake missing
    one is an error (DuckDB's)."""
    import contextlib

    from services.lake import sqlload
    from services.lake.store import StoreAccessError

    loc = _location(lake)
    ice = _iceberg(iceberg)
    sink = open_writer(loc, s3=s3, iceberg=ice) if seed or ice is not None else None
    if seed and sink is not None:
        with contextlib.suppress(OSError, StoreAccessError):
            sink.ensure_seeds()
    if ice is None:
        return sqlload.connect(lake, s3=s3)
    from services.lake.iceberg import SnapshotFiles
    from services.lake.iceberg_sink import IcebergLakeSink

    assert isinstance(sink, IcebergLakeSink)
    files = SnapshotFiles(sink.catalog, ice.iceberg_namespace, sink.seed_path)
    return sqlload.connect(loc, s3=s3, iceberg=files)


def open_writer(
    lake: Path | str | LakeLocation,
    *,
    s3: S3Settings | None = None,
    iceberg: IcebergSettings | None = None,
    **kw: Any,
) -> LakeSink:
    """The writer of ``lake``; ``kw`` as for LakeWriter (row_group_rows, crash_at); an
    IcebergLakeSink when ``iceberg`` says the format is iceberg."""
    loc = _location(lake)
    if (ice := _iceberg(iceberg)) is not None:
        from services.lake.iceberg import open_catalog
        from services.lake.iceberg_sink import IcebergLakeSink
        from services.lake.store import DirectoryObjectStore

        seeds = DirectoryObjectStore(loc.path) if loc.path is not None else open_store(loc, s3)
        cat = open_catalog(ice, loc, s3)
        return IcebergLakeSink(cat, ice.iceberg_namespace, seeds, s3=s3, **kw)
    if loc.path is not None:
        return LakeWriter(loc.path, **kw)
    from services.lake.objwriter import ObjectLakeWriter

    return ObjectLakeWriter(open_store(loc, s3), **kw)


def open_compactor(
    lake: Path | str | LakeLocation,
    *,
    s3: S3Settings | None = None,
    iceberg: IcebergSettings | None = None,
    **kw: Any,
) -> LakeCompaction:
    """The compactor of ``lake``; ``kw`` as for Compactor (grace_s, crash_at, ...). For an
    Iceberg lake, rewrite and snapshot expiry (of ``kw`` only ``crash_at`` applies: expiry
    is its grace period)."""
    loc = _location(lake)
    if (ice := _iceberg(iceberg)) is not None:
        from services.lake.iceberg import open_catalog
        from services.lake.iceberg_maint import IcebergMaintenance

        cat = open_catalog(ice, loc, s3)
        crash_at = kw.get("crash_at")
        return IcebergMaintenance(cat, ice.iceberg_namespace, ice.iceberg_keep_s, crash_at=crash_at)
    if loc.path is not None:
        return Compactor(loc.path, **kw)
    from services.lake.objcompact import ObjectCompactor

    return ObjectCompactor(open_store(loc, s3), **kw)


def check_lake(lake: Path | str | LakeLocation, *, s3: S3Settings | None = None) -> LakeLocation:
    """The lake's location once its store answers: raises StoreAccessError (credentials,
    missing bucket) or StoreUnavailable (endpoint) with one line. A local lake is not
    touched (a missing directory is created when landing, refused when reading)."""
    loc = _location(lake)
    if loc.path is None:
        open_store(loc, s3).check()
    return loc


def has_data(lake: Path | str | LakeLocation, *, s3: S3Settings | None = None) -> bool:
    """Whether the lake holds any data file (seeds do not count)."""
    loc = _location(lake)
    if loc.path is not None:
        return any(f.name != "seed.parquet" for f in loc.path.rglob("*.parquet"))
    from services.lake.datasets import DATASETS
    from services.lake.objwriter import data_files

    store = open_store(loc, s3)
    return any(data_files(store, ds) for ds in DATASETS)
