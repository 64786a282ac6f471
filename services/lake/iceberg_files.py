"""The data files of an Iceberg table as this lake writes them: Parquet bytes with the
table's field ids, uploaded through the table's FileIO, described by a pyiceberg DataFile
whose column metrics come from the file's own footer. Shared by the sink (landing) and the
rewrite (compaction); neither commits here."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.lake.datasets import DATASETS
from services.lake.iceberg import stat_columns, table_schema
from services.lake.writer import write_options

if TYPE_CHECKING:
    from pyiceberg.table import Table


def file_options(
    dataset: str, row_group_rows: int, compression_level: int | None = None
) -> dict[str, object]:
    """Parquet options of a data file, encoded as the Parquet lake's: LZ4 when landing
    (``compression_level`` None), zstd at that level when compacting; min/max on ``ts`` and
    the sort key only (:func:`~services.lake.iceberg.metrics_properties` tells Iceberg so)."""
    ds = DATASETS[dataset]
    level = 3 if compression_level is None else compression_level
    opts = write_options(table_schema(dataset), row_group_rows, level, statistics=stat_columns(ds))
    if compression_level is None:
        opts["compression"] = "lz4"
        del opts["compression_level"]
    opts["write_batch_size"] = 1 << 16
    return opts


def _small(t: pa.DataType) -> pa.DataType:
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        f = t.value_field
        return pa.list_(f.with_type(_small(f.type)))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_small(f.type)) for f in t])
    return t


def small_strings(schema: pa.Schema) -> pa.Schema:
    """``schema`` with string and list types where pyiceberg gives large ones (field ids
    kept): the dataset's columns cast to it without copying their values."""
    return pa.schema([f.with_type(_small(f.type)) for f in schema], metadata=schema.metadata)


def arrow_schema(table: Table) -> pa.Schema:
    """The Arrow schema data files of ``table`` are written with (field ids, small strings)."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return small_strings(schema_to_pyarrow(table.schema(), include_field_ids=True))


def parquet_bytes(table: pa.Table, opts: dict[str, object]) -> bytes:
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, **opts)
    return bytes(buf.getvalue().to_pybytes())


def live_data_files(table: Table) -> list[Any]:
    """The DataFiles of ``table``'s current snapshot (append-only tables: no delete files)."""
    snap = table.current_snapshot()
    if snap is None:
        return []
    io = table.io
    return [
        e.data_file
        for m in snap.manifests(io)
        for e in m.fetch_manifest_entry(io, discard_deleted=True)
    ]


def hour_of(data_file: Any) -> tuple[str, str]:
    """``(date, hour)`` (``"YYYY-MM-DD"``, ``"HH"``) of a DataFile's partition."""
    days, hour = data_file.partition[0], data_file.partition[1]
    return (dt.date(1970, 1, 1) + dt.timedelta(days=int(days))).isoformat(), f"{int(hour):02d}"


def upload_data_file(table: Table, data: bytes, path: str, date: str, hour: str) -> Any:
    """Write Parquet ``data`` to ``path`` through the table's FileIO; the DataFile that names
    it in partition ``date``/``hour``. Raises the FileIO's errors (OSError)."""
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    with table.io.new_output(path).create(overwrite=True) as out:
        out.write(data)
    schema = table.schema()
    stats = data_file_statistics_from_parquet_metadata(
        parquet_metadata=pq.read_metadata(pa.BufferReader(data)),
        stats_columns=compute_statistics_plan(schema, table.metadata.properties),
        parquet_column_mapping=parquet_path_to_id_mapping(schema),
    )
    days = (dt.date.fromisoformat(date) - dt.date(1970, 1, 1)).days
    return DataFile.from_args(
        content=DataFileContent.DATA,
        file_path=path,
        file_format=FileFormat.PARQUET,
        partition=Record(days, int(hour)),
        file_size_in_bytes=len(data),
        sort_order_id=None,
        spec_id=table.metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        **stats.to_serialized_dict(),
    )
