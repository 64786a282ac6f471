"""Sample validation: one reason per rejected row, sentinels kept as NULL, units scaled."""

from __future__ import annotations

import math

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.validate import LayoutCache, SharedLayouts, ValidateLimits, validate_samples
from schemas.catalog import Catalog, Kind, Metric, Origin, Overflow
from schemas.reasons import Reason
from schemas.wire import SAMPLES_SCHEMA

NOW = 1_700_000_000_000_000_000
ORIGIN = Origin(simulator=True)
CAT = Catalog(
    [
        Metric(name="ib.port_rcv_data", unit="B", kind=Kind.COUNTER, width=64,
               overflow=Overflow.WRAP, scale=4.0, sentinel_texts=("N/A (no PMA)",),
               description="received words", origin=ORIGIN),
        Metric(name="gpu.temp", unit="C", kind=Kind.GAUGE, valid_min=-40, valid_max=150,
               sentinels=(140737488355328.0,), aliases=("DCGM_FI_DEV_GPU_TEMP",),
               description="GPU temperature", origin=ORIGIN),
        Metric(name="ib.link_downed", unit="1", kind=Kind.COUNTER, width=8,
               overflow=Overflow.SATURATE, description="link downed count", origin=ORIGIN),
    ]
)  # fmt: skip


def table(rows: list[dict[str, object]]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in SAMPLES_SCHEMA}
    return pa.table(cols, schema=SAMPLES_SCHEMA)


def row(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"ts_ns": NOW, "metric": "gpu.temp", "device": "gpu0", "value": 50.0}
    base.update(kw)
    return base


def reasons(v) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    return {r.reason.value: r.rows for r in v.rejected}


def test_each_reason_and_priority() -> None:
    t = table(
        [
            row(),  # 0 ok
            row(metric="nope"),  # 1 unknown
            row(device=""),  # 2 bad device
            row(device="x" * 129),  # 3 bad device
            row(ts_ns=NOW - 8 * 86_400 * 10**9),  # 4 too old
            row(ts_ns=NOW + 2 * 86_400 * 10**9),  # 5 too far ahead
            row(value=math.nan),  # 6 non-finite
            row(value=math.inf),  # 7 non-finite
            row(value=151.0),  # 8 out of range
            row(metric="ib.port_rcv_data", value=1.0, raw=None),  # 9 counter without raw
            row(metric="ib.port_rcv_data", value=-1.0, raw=5),  # 10 negative counter
            row(metric="ib.link_downed", value=None, raw=256),  # 11 above 8-bit width
            row(metric="nope", device=""),  # 12 unknown wins over bad device
            row(value=None),  # 13 gauge without a reading
        ]
    )
    v = validate_samples(t, CAT, NOW)
    assert reasons(v) == {
        "unknown_metric": [1, 12],
        "bad_device": [2, 3],
        "timestamp_out_of_window": [4, 5],
        "non_finite": [6, 7],
        "out_of_range": [8, 11],
        "wrong_kind": [9, 10, 13],
    }
    assert v.accepted.column("row").to_pylist() == [0]
    assert v.quarantined + v.accepted.num_rows == t.num_rows


def test_window_is_generous_for_an_hour_off_clock() -> None:
    hour = 3600 * 10**9
    v = validate_samples(table([row(ts_ns=NOW - hour), row(ts_ns=NOW + hour)]), CAT, NOW)
    assert v.accepted.num_rows == 2
    tight = ValidateLimits(past_ns=10, future_ns=10)
    assert validate_samples(table([row(ts_ns=NOW + 11)]), CAT, NOW, tight).quarantined == 1


def test_sentinels_become_null_with_reason_and_aliases_canonical() -> None:
    t = table(
        [
            row(value=140737488355328.0),
            row(metric="ib.port_rcv_data", value=None, raw=None, text="N/A (no PMA)"),
            row(metric="DCGM_FI_DEV_GPU_TEMP", value=40.0),
            row(metric="ib.port_rcv_data", raw=100),
        ]
    )
    v = validate_samples(t, CAT, NOW)
    assert v.rejected == []
    a = v.accepted.to_pydict()
    assert a["value"] == [None, None, 40.0, 400.0]  # scale 4 applies to the counter
    assert a["null_reason"] == ["sentinel", "sentinel", None, None]
    assert a["metric"] == ["gpu.temp", "ib.port_rcv_data", "gpu.temp", "ib.port_rcv_data"]
    assert a["unit"] == ["C", "B", "C", "B"]


def test_empty_batch() -> None:
    v = validate_samples(table([]), CAT, NOW)
    assert v.accepted.num_rows == 0 and v.rejected == []


bad_rows = st.fixed_dictionaries(
    {
        "ts_ns": st.sampled_from([NOW, NOW - 10**18, NOW + 10**17, 0]),
        "metric": st.sampled_from(["gpu.temp", "ib.port_rcv_data", "nope", "DCGM_FI_DEV_GPU_TEMP"]),
        "device": st.sampled_from(["gpu0", "", "mlx5_0/1", "y" * 200]),
        "value": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
        "raw": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        "text": st.sampled_from([None, "N/A (no PMA)", "garbage"]),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(bad_rows, max_size=40))
def test_every_row_is_accepted_or_rejected_exactly_once(rows: list[dict[str, object]]) -> None:
    t = table(rows)
    v = validate_samples(t, CAT, NOW)
    seen = v.accepted.column("row").to_pylist() + [i for r in v.rejected for i in r.rows]
    assert sorted(seen) == list(range(len(rows)))
    assert len({r.reason for r in v.rejected}) == len(v.rejected)
    assert all(r.reason in Reason for r in v.rejected)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(bad_rows, max_size=12), min_size=1, max_size=5), st.integers(1, 3))
def test_parts_with_their_caches_validate_as_the_whole_table(
    batches: list[list[dict[str, object]]], rounds: int
) -> None:
    """A table of several batches validated from each batch's layout cache (kept across
    calls, as a worker keeps one per source) gives what the whole table gives alone."""
    caches = [LayoutCache() for _ in batches]
    t = pa.concat_tables([table(b) for b in batches])
    want = validate_samples(t, CAT, NOW)
    for _ in range(rounds):  # the first round fills the caches, later ones use them
        parts = [(len(b), c) for b, c in zip(batches, caches, strict=True)]
        got = validate_samples(t, CAT, NOW, parts=parts)
        assert got.accepted.equals(want.accepted)
        assert [(r.reason, r.rows, r.detail) for r in got.rejected] == [
            (r.reason, r.rows, r.detail) for r in want.rejected
        ]
    assert all(c.metric is not None for c, b in zip(caches, batches, strict=True) if b)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(bad_rows, min_size=1, max_size=12), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=14),
)
def test_layouts_shared_between_sources_validate_as_each_alone(
    batches: list[list[dict[str, object]]], steps: list[tuple[int, int]]
) -> None:
    """Six sources, each with its own layout cache and one shared between them, send these
    batches in any order: every result is what the batch gives validated alone, and a source
    meeting a batch another source's layout fits takes that layout instead of deriving it."""
    shared = SharedLayouts()
    caches = [LayoutCache() for _ in range(6)]
    derived: set[int] = set()
    expect_hits = 0
    for src, b in steps:
        rows = batches[b % len(batches)]
        t = table(rows)
        want = validate_samples(t, CAT, NOW)
        cache = caches[src]
        own = (
            cache.metric is not None
            and cache.metric.equals(t.column("metric").chunk(0))
            and cache.device.equals(t.column("device").chunk(0))
        )
        fits = {
            i for i, r in enumerate(batches)
            if [(x["metric"], x["device"]) for x in r] == [(x["metric"], x["device"]) for x in rows]
        }  # fmt: skip
        if not own and fits & derived:
            expect_hits += 1
        got = validate_samples(t, CAT, NOW, parts=[(len(rows), cache)], shared=shared)
        assert got.accepted.equals(want.accepted)
        assert [(r.reason, r.rows, r.detail) for r in got.rejected] == [
            (r.reason, r.rows, r.detail) for r in want.rejected
        ]
        derived |= fits
    assert shared.hits == expect_hits


def test_a_source_takes_the_layout_another_source_derived() -> None:
    t = table([row(), row(metric="ib.port_rcv_data", device="mlx5_0/1", raw=5), row(device="")])
    shared = SharedLayouts()
    first, second = LayoutCache(), LayoutCache()
    a = validate_samples(t, CAT, NOW, parts=[(3, first)], shared=shared)
    b = validate_samples(t, CAT, NOW, parts=[(3, second)], shared=shared)
    assert shared.hits == 1
    assert second.idx is first.idx and second.bad_device is first.bad_device
    assert a.accepted.equals(b.accepted) and reasons(a) == reasons(b) == {"bad_device": [2]}
    # another device column: no layout fits it, the source derives its own
    other = table([row(), row(metric="ib.port_rcv_data", device="mlx5_0/1", raw=5), row()])
    c = validate_samples(other, CAT, NOW, parts=[(3, LayoutCache())], shared=shared)
    assert shared.hits == 1 and c.accepted.num_rows == 3


def test_device_length_is_counted_in_characters_not_bytes() -> None:
    t = table(
        [
            row(device="é" * 128),  # 256 bytes, 128 characters: at the limit
            row(device="é" * 129),  # one character over
            row(device="x" * 128),
        ]
    )
    v = validate_samples(t, CAT, NOW)
    assert reasons(v) == {"bad_device": [1]}
    assert v.accepted.column("row").to_pylist() == [0, 2]
