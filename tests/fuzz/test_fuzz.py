"""Fuzz decode() and the refiner (Refiner.process → refine_batch) with mutated real batches.

Mutations: bit flips, truncation, splices of two batches, wrong types (JSON values replaced,
Arrow columns re-typed), huge dimensions (row counts claimed in the IPC metadata, JSON
columns of mismatched or enormous lengths) and wrong content types. Whatever comes out,
:func:`tests.fuzz.harness.check_record` holds: nothing crashes, every invalid input ends in a
dead letter with a reason, and the accounting invariant holds.

Bounded for CI to about 30 s in all; ``REFINERY_FUZZ_EXAMPLES`` raises the example count of
each test for a longer local run.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import ARROW, ENVELOPE_KEY, JSON
from tests.fuzz.harness import check_record, seeds

EXAMPLES = int(os.environ.get("REFINERY_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("REFINERY_FUZZ_EXAMPLES") is None,  # CI: same cases each run
)
CONTENT_TYPES = st.sampled_from([ARROW, JSON, None, "text/plain", ARROW + "; x", ""])
seed_index = st.integers(min_value=0, max_value=len(seeds()) - 1)


@FUZZ
@given(
    i=seed_index, flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 7)), max_size=8)
)
def test_bit_flips(i: int, flips: list[tuple[int, int]]) -> None:
    body, ct = seeds()[i]
    data = bytearray(body)
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    check_record(bytes(data), ct)


@FUZZ
@given(i=seed_index, cut=st.integers(0, 1 << 30), ct=st.none() | CONTENT_TYPES)
def test_truncation(i: int, cut: int, ct: str | None) -> None:
    body, seed_ct = seeds()[i]
    check_record(body[: cut % (len(body) + 1)], seed_ct if ct is None else ct)


@FUZZ
@given(a=seed_index, b=seed_index, x=st.integers(0, 1 << 30), y=st.integers(0, 1 << 30))
def test_splices(a: int, b: int, x: int, y: int) -> None:
    (first, ct), (second, _) = seeds()[a], seeds()[b]
    check_record(first[: x % (len(first) + 1)] + second[y % (len(second) + 1) :], ct)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def _json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            paths += _json_paths(v, (*prefix, k))
    elif isinstance(doc, list) and doc:
        paths += _json_paths(doc[0], (*prefix, 0))
    return paths


@FUZZ
@given(i=seed_index, pick=st.integers(0, 1 << 20), value=json_values)
def test_wrong_types_json(i: int, pick: int, value: Any) -> None:
    body, ct = seeds()[i]
    if ct != JSON:
        body = seeds()[i - i % 4 + 1][0]  # the JSON encoding of the same batch
    doc = json.loads(body)
    paths = _json_paths(doc)[1:]
    path = paths[pick % len(paths)]
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    check_record(json.dumps(doc).encode(), JSON)


ARROW_TYPES = st.sampled_from(
    [pa.string(), pa.int8(), pa.uint64(), pa.float16(), pa.bool_(), pa.binary(), pa.null()]
)


@FUZZ
@given(i=seed_index, col=st.integers(0, 50), to=ARROW_TYPES)
def test_wrong_types_arrow(i: int, col: int, to: pa.DataType) -> None:
    body, ct = seeds()[i]
    if ct != ARROW:
        return
    table = pa.ipc.open_stream(body).read_all()
    name = table.column_names[col % table.num_columns]
    try:
        column = table.column(name).cast(to)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        column = pa.nulls(table.num_rows, to)
    table = table.set_column(table.column_names.index(name), name, column)
    meta = {ENVELOPE_KEY: (table.schema.metadata or {})[ENVELOPE_KEY]}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema.with_metadata(meta)) as w:
        w.write_table(table)
    check_record(sink.getvalue().to_pybytes(), ARROW)


@FUZZ
@given(i=seed_index, rows=st.sampled_from([-1, 0, 1, 41, 200_001, 1 << 31, (1 << 63) - 1]))
def test_huge_claimed_rows_arrow(i: int, rows: int) -> None:
    """Overwrite the row count in each record batch's metadata (the 8 bytes after the
    flatbuffer's root points at RecordBatch.length for pyarrow's layout: found by value)."""
    body, ct = seeds()[i]
    if ct != ARROW:
        return
    n = pa.ipc.open_stream(body).read_all().num_rows
    needle = struct.pack("<q", n)
    data = bytearray(body)
    at = data.find(needle, 8)
    if at < 0:
        return
    data[at : at + 8] = struct.pack("<q", rows)
    check_record(bytes(data), ARROW)


@FUZZ
@given(
    i=seed_index,
    column=st.sampled_from(["ts_ns", "metric", "device", "value", "raw", "text", "event"]),
    length=st.sampled_from([0, 1, 39, 41, 200_001]),
    filler=st.sampled_from([0, 1.5, "x", None, "y" * 20_000, [1]]),
)
def test_huge_dims_json(i: int, column: str, length: int, filler: Any) -> None:
    body, ct = seeds()[i]
    if ct != JSON:
        return
    if length > 1000 and isinstance(filler, str) and len(filler) > 10:
        length = 1000  # 200 001 long strings would be 4 GB of JSON: the test, not the code
    doc = json.loads(body)
    doc["columns"][column] = [filler] * length
    check_record(json.dumps(doc).encode(), JSON)


@FUZZ
@given(i=seed_index, ct=CONTENT_TYPES, junk=st.binary(max_size=64))
def test_content_types_and_junk(i: int, ct: str | None, junk: bytes) -> None:
    body, _ = seeds()[i]
    check_record(body, ct)
    check_record(junk, ct)
