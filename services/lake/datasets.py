"""The lake's datasets: name, source topic, Arrow schema and how a Kafka record becomes rows.

Every dataset has an int64 ``ts`` column (ns since the epoch, common clock where known) that
picks its ``date=YYYY-MM-DD/hour=HH`` directory. JSON topics are flattened to columns; nested
values (``evidence``, ``attrs``, ``lineage``) are kept as JSON text. Rows that came from a JSON or
event topic carry ``kafka_partition``/``kafka_offset`` so versioned tables (topology, jobs) can
take the latest record per key in landing order.

==============  =============================  ==========  ======================================
dataset         topic                          encoding    ``ts`` is
==============  =============================  ==========  ======================================
samples         telemetry.refined              Arrow IPC   aligned sample time (REFINED ``ts``)
events          telemetry.events.aligned       Arrow IPC   aligned event time (common clock)
collectives     telemetry.collectives.aligned  Arrow IPC   aligned rank arrival (common clock)
alerts          telemetry.alerts               JSON        ``emitted_ns``
episodes        telemetry.episodes             JSON        ``emitted_ns``
deadletter      telemetry.deadletter           JSON        ``ts_ns`` (when rejected)
rollups         telemetry.rollups              Arrow IPC   ``window_start``
topology        topology                       JSON        ``valid_from``
node_facts      topology.nodes                 JSON        ``valid_from`` (netdev facts)
jobs            jobs                           JSON        ``start_ns``
accounting      telemetry.accounting           Arrow/JSON  when the batch was refined
==============  =============================  ==========  ======================================

:data:`ACCOUNTING_SCHEMA` is the contract for the refining worker's per-batch accounting: one
row per raw Kafka record it consumed, published on ``telemetry.accounting`` as one JSON object
per record (what the worker does; extra keys are ignored, ``ts`` defaults to the Kafka
timestamp), columnar JSON ``{"columns": {...}}`` or Arrow IPC. Outcome ``replay`` (a raw
record reprocessed after a crash, nothing republished) is kept but never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import pyarrow as pa

from pipelines.refine.aligned import ALIGNED_COLLECTIVES_SCHEMA, ALIGNED_EVENTS_SCHEMA
from schemas.records import REFINED_SCHEMA, ROLLUP_SCHEMA
from schemas.topics import TOPICS


class Encoding(StrEnum):
    ARROW = "arrow"  # Arrow IPC stream whose table has the dataset's columns
    JSON = "json"  # one pydantic record per Kafka message


_POSITION = [
    pa.field("kafka_partition", pa.int32(), nullable=False),
    pa.field("kafka_offset", pa.int64(), nullable=False),
]
_TS = pa.field("ts", pa.int64(), nullable=False)

# Events and collectives land from the refiner's aligned topics: ``ts`` (and ``ts_ns``, kept
# for queries written against the wire payload) is the common clock, ``ts_source`` the
# source's own stamp, with the offset and error bound applied and the raw lineage.
EVENTS_LAKE_SCHEMA = ALIGNED_EVENTS_SCHEMA.append(pa.field("ts_ns", pa.int64()))
COLLECTIVES_LAKE_SCHEMA = ALIGNED_COLLECTIVES_SCHEMA.append(pa.field("ts_ns", pa.int64()))
ROLLUPS_LAKE_SCHEMA = pa.schema([_TS, *ROLLUP_SCHEMA])

ALERTS_SCHEMA = pa.schema(
    [
        _TS,
        pa.field("id", pa.string(), nullable=False),
        pa.field("rule", pa.string(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("severity", pa.string(), nullable=False),
        pa.field("entity", pa.string(), nullable=False),
        pa.field("node", pa.string()),
        pa.field("device", pa.string()),
        pa.field("job", pa.string()),
        pa.field("starts_ns", pa.int64(), nullable=False),
        pa.field("ends_ns", pa.int64()),
        pa.field("summary", pa.string(), nullable=False),
        pa.field("cause", pa.string()),
        pa.field("evidence", pa.string()),  # JSON
        pa.field("lineage", pa.string()),  # JSON
        pa.field("emitted_ns", pa.int64(), nullable=False),
        *_POSITION,
    ]
)

EPISODES_SCHEMA = pa.schema(
    [
        _TS,
        pa.field("id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("entity", pa.string(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64()),
        pa.field("peak", pa.string()),  # JSON object metric -> value
        pa.field("ports", pa.list_(pa.string())),
        pa.field("nics", pa.list_(pa.string())),
        pa.field("nodes", pa.list_(pa.string())),
        pa.field("jobs", pa.list_(pa.string())),
        pa.field("cause_hint", pa.string()),
        pa.field("emitted_ns", pa.int64(), nullable=False),
        *_POSITION,
    ]
)

DEADLETTER_SCHEMA = pa.schema(
    [
        _TS,
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("node", pa.string()),
        pa.field("content_type", pa.string()),
        pa.field("scope", pa.string(), nullable=False),
        pa.field("samples", pa.int64(), nullable=False),
        pa.field("rows", pa.list_(pa.int64())),
        pa.field("original_b64", pa.string()),
        pa.field("ts_ns", pa.int64(), nullable=False),
        *_POSITION,
    ]
)

TOPOLOGY_SCHEMA = pa.schema(
    [
        _TS,
        pa.field("id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("valid_from", pa.int64(), nullable=False),
        pa.field("valid_to", pa.int64()),
        *(
            pa.field(n, pa.string())
            for n in ("node", "device", "rack", "pod", "switch", "switch_port", "peer", "role")
        ),
        pa.field("rail", pa.int32()),
        pa.field("numa", pa.int32()),
        pa.field("nvlink_domain", pa.string()),
        pa.field("gpu", pa.string()),
        pa.field("nic", pa.string()),
        pa.field("guid", pa.string()),
        pa.field("attrs", pa.string()),  # JSON
        pa.field("source", pa.string(), nullable=False),
        *_POSITION,
    ]
)

RANK_TYPE = pa.struct(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu", pa.string(), nullable=False),
    ]
)

JOBS_SCHEMA = pa.schema(
    [
        _TS,
        pa.field("job", pa.string(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64()),
        pa.field("user", pa.string()),
        pa.field("name", pa.string()),
        pa.field("nodes", pa.list_(pa.string())),
        pa.field("ranks", pa.list_(RANK_TYPE)),
        *_POSITION,
    ]
)

ACCOUNTING_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.int64(), nullable=False),  # when the batch was refined (common clock)
        pa.field("raw_topic", pa.string()),  # NULL means telemetry.raw
        pa.field("raw_partition", pa.int32(), nullable=False),
        pa.field("raw_offset", pa.int64(), nullable=False),
        pa.field("input_samples", pa.int64(), nullable=False),
        pa.field("refined_samples", pa.int64(), nullable=False),
        pa.field("duplicate_samples", pa.int64(), nullable=False),
        pa.field("quarantined_samples", pa.int64(), nullable=False),
        pa.field("outcome", pa.string(), nullable=False),  # refined|duplicate|replay|deadletter
        pa.field("node", pa.string()),
        pa.field("reason", pa.string()),  # dead-letter reason when outcome is deadletter
    ]
)


@dataclass(frozen=True)
class Dataset:
    """One lake dataset: where it comes from and the columns it lands with."""

    name: str
    topic: str
    encoding: Encoding
    schema: pa.Schema
    sort_by: tuple[str, ...]


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        # (node, metric, ts): the devices of one scrape sit together, so ts deltas are tiny
        # (measured smaller than one run per series); device breaks ties for a stable order.
        Dataset(
            "samples",
            TOPICS.refined,
            Encoding.ARROW,
            REFINED_SCHEMA,
            ("node", "metric", "ts", "device"),
        ),
        Dataset(
            "events",
            TOPICS.events_aligned,
            Encoding.ARROW,
            EVENTS_LAKE_SCHEMA,
            ("node", "event", "device", "ts"),
        ),
        Dataset(
            "collectives",
            TOPICS.collectives_aligned,
            Encoding.ARROW,
            COLLECTIVES_LAKE_SCHEMA,
            ("job", "comm", "op_seq", "rank"),
        ),
        Dataset("alerts", TOPICS.alerts, Encoding.JSON, ALERTS_SCHEMA, ("entity", "ts")),
        Dataset("episodes", TOPICS.episodes, Encoding.JSON, EPISODES_SCHEMA, ("entity", "ts")),
        Dataset(
            "deadletter", TOPICS.deadletter, Encoding.JSON, DEADLETTER_SCHEMA, ("reason", "ts")
        ),
        Dataset(
            "rollups",
            TOPICS.rollups,
            Encoding.ARROW,
            ROLLUPS_LAKE_SCHEMA,
            ("node", "metric", "device", "window_s", "ts"),
        ),
        Dataset("topology", TOPICS.topology, Encoding.JSON, TOPOLOGY_SCHEMA, ("id", "valid_from")),
        Dataset(
            "node_facts",
            TOPICS.topology_nodes,
            Encoding.JSON,
            TOPOLOGY_SCHEMA,
            ("id", "valid_from"),
        ),
        Dataset("jobs", TOPICS.jobs, Encoding.JSON, JOBS_SCHEMA, ("job", "ts")),
        Dataset(
            "accounting",
            TOPICS.accounting,
            Encoding.ARROW,
            ACCOUNTING_SCHEMA,
            ("raw_partition", "raw_offset"),
        ),
    )
}

TOPIC_DATASETS: dict[str, str] = {d.topic: d.name for d in DATASETS.values()}


_NOT_NULL: dict[int, tuple[pa.Schema, tuple[int, ...]]] = {}  # by id: hashing a schema ~20 us


def _not_null(schema: pa.Schema) -> tuple[int, ...]:
    """The positions of ``schema``'s non-nullable fields (computed once per schema object)."""
    got = _NOT_NULL.get(id(schema))
    if got is None or got[0] is not schema:
        if len(_NOT_NULL) >= 64:  # the datasets' schemas and a few others: never many
            _NOT_NULL.clear()
        got = _NOT_NULL[id(schema)] = (
            schema,
            tuple(i for i, f in enumerate(schema) if not f.nullable),
        )
    return got[1]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast ``table`` to ``schema``; absent nullable columns become NULL.

    Raises ValueError when a non-nullable column is absent or has NULLs, or a cast fails.
    """
    if table.schema.equals(schema):
        # what the stream processors write (refined samples above all): nothing to select or
        # cast, only the NULL checks (the general path costs ~170 us a record of 35 columns)
        for i in _not_null(schema):
            if table.column(i).null_count:
                raise ValueError(f"column {schema.names[i]} has NULLs")
        return table.replace_schema_metadata(schema.metadata)
    n = table.num_rows
    names = set(table.column_names)
    cols = []
    for field in schema:
        if field.name in names:
            col = table.column(field.name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            try:
                col = col if col.type == field.type else col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"column {field.name}: {col.type} is not {field.type}") from e
            if not field.nullable and col.null_count:
                raise ValueError(f"column {field.name} has NULLs")
        elif field.nullable:
            col = pa.chunked_array([pa.nulls(n, field.type)])
        else:
            raise ValueError(f"column {field.name} is missing")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)
