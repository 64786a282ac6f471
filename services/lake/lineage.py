"""What a lander has landed already, by each dataset's identity of a record: what makes
landing exactly-once when the producer of a topic publishes a record twice.

The lander's own exactly-once (file names, the landed high-water mark) covers its own
crashes. Its inputs can repeat too: a refining worker killed after publishing and before its
checkpoint publishes the same outputs again, a detect process restarted from its committed
offset publishes the alerts, episodes and rollups it had published since. Such a copy is the
same record at a new Kafka offset; the lander drops it by the record's identity:

==============  ===========================  ===============================  =============
dataset         stream                       identity within the stream       ordered by
==============  ===========================  ===============================  =============
samples         [raw_topic,] raw_partition   raw_offset (lineage)             raw_offset
events          [raw_topic,] raw_partition   raw_offset (lineage)             raw_offset
collectives     [raw_topic,] raw_partition   raw_offset (lineage)             raw_offset
deadletter      topic, partition             offset, scope, reason            offset
accounting      raw_topic, raw_partition     raw_offset                       raw_offset
alerts          (one)                        id, state                        kafka_offset
episodes        (one)                        id, state                        kafka_offset
rollups         node, window_s               window_start, samples (sum)      window_start
==============  ===========================  ===============================  =============

[raw_topic,]: refined and aligned rows name their raw topic (telemetry.raw or an ingest
topic: each has positions of its own); rows written before they carried it, and accounting
rows without one, read as telemetry.raw (:data:`RAW_TOPIC`), so a copy of a record landed
before is known by rows that name its topic.

A rollup window's samples (the sum of ``count`` over the node's rows of that window in one
message) belong to its identity: detect flushes its open windows part-way when stopped and
the next process publishes them whole; both land and the ``rollups`` view keeps the fuller.

A producer publishes every row of one identity in one message, each time it publishes it (a
refined or aligned message holds whole raw records; a dead letter, an accounting row, an
alert or an episode is one message; a node's closed rollup windows are one message), so an
identity seen in an earlier message means the whole row set is a copy. Copies go to the same
partition of the topic (the same key), so one index per source partition of the lander
suffices, rebuilt from that partition's landed files when the lander is assigned it.

Memory is bounded per stream: identities are remembered exactly within ``window`` (in units
of the order column) below the stream's highest order. Below that, an identity ordered by a
position (raw offsets, window starts: streams that only move forward, and whose copies come
within seconds) counts as landed; one ordered by the lander's own offset (alerts, episodes,
whose ids carry no order) is forgotten.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from schemas.topics import TOPICS

Key = tuple[Hashable, ...]
_TOTAL = "__total"
RAW_TOPIC = TOPICS.raw  # what a NULL or absent raw_topic stands for


@dataclass(frozen=True)
class Identity:
    """How the rows of a dataset tell a record and its copies (see the module's table)."""

    stream: tuple[str, ...]
    ident: tuple[str, ...]
    order: str
    window: int
    older_landed: bool = True
    optional: tuple[str, ...] = ()  # columns a producer may not write yet: read as NULL
    # what a NULL (or an absent optional column) reads as, by column
    defaults: tuple[tuple[str, str], ...] = ()
    # a column summed over an identity's rows in one message, part of the identity: the same
    # record published again with more in it (a rollup window flushed part-way at a stop,
    # then whole by the next process) is another record
    total: str | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.stream, *self.ident, self.order)))

    def default(self, column: str) -> str | None:
        return dict(self.defaults).get(column)


# raw_topic: a raw topic besides telemetry.raw (the ingest topics) has positions of its own
_RAW_TOPIC = (("raw_topic", RAW_TOPIC),)
_LINEAGE = Identity(
    ("raw_topic", "raw_partition"),
    ("raw_offset",),
    "raw_offset",
    50_000,
    optional=("raw_topic",),
    defaults=_RAW_TOPIC,
)
_BY_ID = Identity((), ("id", "state"), "kafka_offset", 50_000, older_landed=False)

IDENTITIES: dict[str, Identity] = {
    "samples": _LINEAGE,
    "events": _LINEAGE,
    "collectives": _LINEAGE,
    "deadletter": Identity(("topic", "partition"), ("offset", "scope", "reason"), "offset", 50_000),
    "accounting": Identity(
        ("raw_topic", "raw_partition"), ("raw_offset",), "raw_offset", 50_000, defaults=_RAW_TOPIC
    ),
    "alerts": _BY_ID,
    "episodes": _BY_ID,
    "rollups": Identity(
        ("node", "window_s"), ("window_start",), "window_start", 3_600 * 10**9, total="count"
    ),
}


class Landed:
    """The identities landed from one stream: exact within ``window`` of the highest order;
    older ones count as landed or are forgotten (``older_landed``)."""

    def __init__(self, window: int, older_landed: bool = True) -> None:
        self.window = window
        self.older_landed = older_landed
        self.high: int | None = None
        self._recent: dict[Key, int] = {}
        self._prune_at = 1024

    def has(self, ident: Key, order: int) -> bool:
        if self.older_landed and self.high is not None and order <= self.high - self.window:
            return True
        return ident in self._recent

    def add(self, ident: Key, order: int) -> None:
        self._recent[ident] = order
        if self.high is None or order > self.high:
            self.high = order
        if len(self._recent) >= self._prune_at:  # amortized: at most twice what the window holds
            floor = self.high - self.window
            self._recent = {k: o for k, o in self._recent.items() if o > floor}
            self._prune_at = max(2 * len(self._recent), 1024)


class LineageIndex:
    """The landed identities of one source partition of a dataset, by stream."""

    def __init__(self, spec: Identity) -> None:
        self.spec = spec
        self.streams: dict[Key, Landed] = {}

    def _stream(self, key: Key) -> Landed:
        got = self.streams.get(key)
        if got is None:
            got = self.streams[key] = Landed(self.spec.window, self.spec.older_landed)
        return got

    @classmethod
    def from_files(
        cls,
        spec: Identity,
        files: Sequence[str],
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> LineageIndex:
        """The identities the landed ``files`` hold within each stream's window, read by
        ``con`` (one that reads the files' URLs) or DuckDB's default connection."""
        index = cls(spec)
        if not files:
            return index
        run = duckdb.execute if con is None else con.execute
        cols = spec.columns
        have = {
            str(r[0])
            for r in run(
                "DESCRIBE SELECT * FROM read_parquet(?, union_by_name = true)", [list(files)]
            ).fetchall()
        }
        sel = ", ".join(_select(spec, c, c in have) for c in cols)
        names = ", ".join(f'"{c}"' for c in cols)
        over = ", ".join(f'"{c}"' for c in spec.stream)
        window = f"PARTITION BY {over}" if over else ""
        if spec.total:  # an identity's rows in one message lie in one file (one hour)
            rows = f"""
                SELECT {names}, sum("{spec.total}") AS "{_TOTAL}"
                FROM (SELECT filename, {sel}, "{spec.total}"
                      FROM read_parquet(?, union_by_name = true, filename = true))
                WHERE "{spec.order}" IS NOT NULL GROUP BY filename, {names}
            """
        else:
            rows = f"""
                SELECT {sel} FROM read_parquet(?, union_by_name = true)
                WHERE "{spec.order}" IS NOT NULL
            """
        sql = f"""
            SELECT DISTINCT * FROM ({rows})
            QUALIFY "{spec.order}" > max("{spec.order}") OVER ({window}) - ?
            ORDER BY "{spec.order}"
        """
        keys = [*cols, _TOTAL] if spec.total else list(cols)
        for row in run(sql, [list(files), spec.window]).fetchall():
            index.add(dict(zip(keys, row, strict=True)))
        return index

    def add(self, values: dict[str, Hashable]) -> None:
        spec = self.spec
        order = values[spec.order]
        assert isinstance(order, int)
        ident = tuple(values[c] for c in (*spec.ident, *((_TOTAL,) if spec.total else ())))
        self._stream(tuple(values[c] for c in spec.stream)).add(ident, order)

    def drop_landed(self, table: pa.Table) -> pa.Table:
        """``table`` less the rows of identities landed before (and remembers the others)."""
        spec = self.spec
        schema = table.schema
        if any(schema.get_field_index(c) < 0 for c in spec.columns if c not in spec.optional):
            return table  # rows written by a producer that carries no identity: all land
        dups: list[tuple[Key, Key]] = []
        idents = _identities(table, spec)
        for stream, ident, order in idents:
            if order is None:
                continue
            landed = self.streams.get(stream) or self._stream(stream)
            if landed.has(ident, order):
                dups.append((stream, ident))
            else:
                landed.add(ident, order)
        if not dups:
            return table
        if len(dups) == len(idents):  # a copy of whole records, the usual replay
            return table.slice(0, 0)
        values = [
            dict(
                zip((*spec.stream, *spec.ident), (*stream, *ident[: len(spec.ident)]), strict=True)
            )
            for stream, ident in dups
        ]
        return table.filter(pc.invert(_rows_of(table, spec, values)))


def _identities(table: pa.Table, spec: Identity) -> list[tuple[Key, Key, int | None]]:
    """The distinct identities of ``table``'s rows: (stream, identity, order). A single stream
    whose order is the whole identity (refined and aligned rows: one raw partition per
    message) is settled by min/max passes and the distinct orders (or none when one)."""
    names = table.schema.names
    if spec.ident == (spec.order,) and spec.total is None:
        stream = _one_stream(table, spec, names)
        off = table.column(spec.order)
        if stream is not None and off.null_count == 0:
            o = pc.min_max(off)
            first, last = o["min"].as_py(), o["max"].as_py()
            offs = [first] if first == last else pc.unique(off).to_pylist()
            return [(stream, (x,), x) for x in offs]
    cols = spec.columns
    sub = pa.table([_read(table, spec, c) for c in cols], names=list(cols))
    sums: list[tuple[str, str]] = []
    if spec.total:
        sub = sub.append_column(_TOTAL, table.column(spec.total))
        sums = [(_TOTAL, "sum")]
    groups = sub.group_by(list(cols), use_threads=False).aggregate(sums)
    at = {c: i for i, c in enumerate(groups.column_names)}
    ident = [*spec.ident, *((f"{_TOTAL}_sum",) if spec.total else ())]
    rows = zip(*(groups.column(c).to_pylist() for c in groups.column_names), strict=True)
    return [
        (
            tuple(r[at[c]] for c in spec.stream),
            tuple(r[at[c]] for c in ident),
            r[at[spec.order]],
        )
        for r in rows
    ]


def _one_stream(table: pa.Table, spec: Identity, names: list[str]) -> Key | None:
    """The stream of every row of ``table`` when it has one (absent optional columns are
    NULL), else None."""
    key: list[Hashable] = []
    for c in spec.stream:
        if c not in names:
            key.append(spec.default(c))
            continue
        col = _plain(table.column(c))
        if col.null_count:
            if col.null_count == len(col):
                key.append(spec.default(c))
                continue
            return None
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo != hi:
            return None
        key.append(lo)
    return tuple(key)


def _plain(col: pa.ChunkedArray) -> pa.ChunkedArray:
    return col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col


def _read(table: pa.Table, spec: Identity, c: str) -> pa.ChunkedArray | pa.Array:
    """Column ``c`` of ``table`` as the identity reads it: plain, NULL (or absent) as the
    column's default."""
    default = spec.default(c)
    if c not in table.schema.names:
        return (
            pa.nulls(table.num_rows, pa.string())
            if default is None
            else pa.repeat(pa.scalar(default, pa.string()), table.num_rows)
        )
    col = _plain(table.column(c))
    return col if default is None or not col.null_count else pc.fill_null(col, default)


def _select(spec: Identity, c: str, have: bool) -> str:
    """The SQL select item of column ``c`` as the identity reads it (see :func:`_read`)."""
    default = spec.default(c)
    if default is None:
        return f'"{c}"' if have else f'NULL AS "{c}"'
    lit = "'" + default.replace("'", "''") + "'"
    return f'coalesce("{c}", {lit}) AS "{c}"' if have else f'{lit} AS "{c}"'


def _rows_of(table: pa.Table, spec: Identity, idents: list[dict[str, Hashable]]) -> pa.ChunkedArray:
    """A mask of the rows whose identity columns equal one of ``idents`` (a column the rows
    do not carry, or a NULL, reads as its default, else as NULL)."""
    names = table.schema.names
    hit = pa.chunked_array([pa.repeat(False, table.num_rows)])
    read = {c: _read(table, spec, c) for c in idents[0]} if idents else {}
    for values in idents:
        if any(c not in names and v != spec.default(c) for c, v in values.items()):
            continue  # wants another value than the rows' absent column reads as: no row
        one: pa.ChunkedArray | None = None
        for c, v in values.items():
            if c not in names:
                continue
            col = read[c]
            eq = pc.is_null(col) if v is None else pc.fill_null(pc.equal(col, v), False)
            one = eq if one is None else pc.and_(one, eq)
        if one is not None:
            hit = pc.or_(hit, one)
    return hit
