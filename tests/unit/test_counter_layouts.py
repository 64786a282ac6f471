"""Counter layouts: with each stream's :class:`CounterLayout` remembered, derive_rates_group
gives exactly the columns and states it gives without, on simulator traffic with every fault
on (resets, wraps, sentinels, late and duplicated rows, changing series), and most batches
take the remembered layout."""

from __future__ import annotations

import pyarrow as pa
import pytest

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation, Stream
from pipelines.refine.counters import CounterLayout, CounterPart, CounterState, derive_rates_group
from pipelines.refine.validate import validate_samples
from schemas.catalog import default_catalog
from schemas.wire import SAMPLES_SCHEMA, PayloadKind

S = 1_000_000_000
T0 = 1_700_000_000 * S
CAT = default_catalog()


def _waves(seed: int) -> list[list[tuple[str, str, pa.Table]]]:
    """Per tick, the accepted rows of each samples stream: (stream, boot id, rows)."""
    sim = Simulation(Cluster.build(3, seed=seed), "all", seed=seed, start_ns=T0, duration_ns=30 * S)
    waves = []
    for tick in sim.ticks():
        wave: list[tuple[str, str, pa.Table]] = []
        seen: set[str] = set()
        for m in tick.messages:
            if m.stream is not Stream.RAW or m.envelope is None or m.table is None:
                continue
            if m.envelope.kind is not PayloadKind.SAMPLES:
                continue
            stream = m.envelope.source.stream_key()
            if stream in seen:  # a stream once per wave
                waves.append(wave)
                wave, seen = [], set()
            seen.add(stream)
            rows = validate_samples(m.table, CAT, T0 + 60 * S).accepted
            wave.append((stream, m.envelope.source.boot_id, rows))
        if wave:
            waves.append(wave)
    return waves


@pytest.mark.parametrize("seed", [1, 2])
def test_layouts_change_nothing(seed: int) -> None:
    waves = _waves(seed)
    plain: dict[str, CounterState] = {}
    cached: dict[str, CounterState] = {}
    layouts: dict[str, CounterLayout] = {}
    tried = 0
    for wave in waves:
        table = pa.concat_tables([t for _, _, t in wave])
        ts = table.column("ts_ns").combine_chunks()
        a_parts = [CounterPart(t.num_rows, boot, plain.get(k, CounterState()))
                   for k, boot, t in wave]  # fmt: skip
        b_parts = [CounterPart(t.num_rows, boot, cached.get(k, CounterState()),
                               layouts.setdefault(k, CounterLayout()))
                   for k, boot, t in wave]  # fmt: skip
        tried += len(wave)
        a_cols, a_states = derive_rates_group(table, ts, a_parts)
        b_cols, b_states = derive_rates_group(table, ts, b_parts)
        for name in ("delta", "rate", "reset", "late", "null_reason"):
            assert getattr(a_cols, name).equals(getattr(b_cols, name)), name
        for (k, _, _), sa, sb in zip(wave, a_states, b_states, strict=True):
            assert sa.table.equals(sb.table), k
            plain[k], cached[k] = sa, sb
    used = sum(x.hits for x in layouts.values())
    assert tried > 200 and used > tried // 2, (used, tried)


def _batch(rows: list[tuple[str, int, int]]) -> pa.Table:
    """Accepted rows of (device, source ts, raw) of one counter."""
    t = pa.table(
        {
            "ts_ns": pa.array([r[1] for r in rows], pa.int64()),
            "metric": ["rdma.np_cnp_sent"] * len(rows),
            "device": [r[0] for r in rows],
            "value": pa.nulls(len(rows), pa.float64()),
            "raw": pa.array([r[2] for r in rows], pa.uint64()),
            "text": pa.nulls(len(rows), pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return validate_samples(t, CAT, T0 + 60 * S).accepted


def test_a_batch_whose_rows_come_in_another_time_order_is_sorted_again() -> None:
    """Same series in the same rows, but the second batch lists a series' readings newest
    first: the remembered order would pair the wrong readings, so it is not used."""
    t = T0
    first = _batch([("a", t + 1 * S, 10), ("a", t + 2 * S, 20), ("b", t + 1 * S, 5)])
    second = _batch([("a", t + 4 * S, 60), ("a", t + 3 * S, 30), ("b", t + 3 * S, 9)])
    layout = CounterLayout()
    state = CounterState()
    for rows in (first, second):
        ts = rows.column("ts_ns").combine_chunks()
        cols, (state,) = derive_rates_group(
            rows, ts, [CounterPart(rows.num_rows, "b0", state, layout)]
        )
    assert layout.hits == 0
    assert cols.delta.to_pylist() == [30.0, 10.0, 4.0]  # 60-30, 30-20, 9-5
    # a third batch in the first batch's order: the layout (still the first's) fits again
    third = _batch([("a", t + 5 * S, 70), ("a", t + 6 * S, 90), ("b", t + 5 * S, 10)])
    ts = third.column("ts_ns").combine_chunks()
    cols, _ = derive_rates_group(third, ts, [CounterPart(3, "b0", state, layout)])
    assert layout.hits == 1
    assert cols.delta.to_pylist() == [10.0, 20.0, 1.0]  # 70-60, 90-70, 10-9


def _no_view() -> tuple[pa.Array, pa.Array]:
    raise AssertionError("the columns were compared although the generation vouched for them")


def test_a_batch_of_the_remembered_generation_is_not_compared_again() -> None:
    """A layout remembered from a batch of validation generation 7: a later batch of
    generation 7 fits without its metric/device columns being read; one of another
    generation is compared, and a batch with other devices is not taken for the same."""
    t = T0
    first = _batch([("a", t + 1 * S, 10), ("b", t + 1 * S, 5)])
    layout, state = CounterLayout(), CounterState()
    _, (state,) = derive_rates_group(
        first, first.column("ts_ns").combine_chunks(), [CounterPart(2, "b0", state, layout, 7)]
    )
    assert layout.names is not None and layout.known == 7
    second = _batch([("a", t + 2 * S, 30), ("b", t + 2 * S, 9)])
    mask = pa.array([True, True])
    assert layout.matches(_no_view, mask, state, 7)
    cols, (state,) = derive_rates_group(
        second, second.column("ts_ns").combine_chunks(), [CounterPart(2, "b0", state, layout, 7)]
    )
    assert layout.hits == 1 and cols.delta.to_pylist() == [20.0, 4.0]
    # same columns, another generation: compared, fits, and the layout takes the generation
    third = _batch([("a", t + 3 * S, 35), ("b", t + 3 * S, 10)])
    cols, (state,) = derive_rates_group(
        third, third.column("ts_ns").combine_chunks(), [CounterPart(2, "b0", state, layout, 8)]
    )
    assert layout.hits == 2 and layout.known == 8 and cols.delta.to_pylist() == [5.0, 1.0]
    # other devices (so another generation): compared, does not fit, sorted afresh
    other = _batch([("c", t + 4 * S, 1), ("a", t + 4 * S, 40)])
    assert not layout.matches(
        lambda: (other.column("metric").chunk(0), other.column("device").chunk(0)),
        mask, state, 9,
    )  # fmt: skip
    cols, _ = derive_rates_group(
        other, other.column("ts_ns").combine_chunks(), [CounterPart(2, "b0", state, layout, 9)]
    )
    assert layout.hits == 2 and cols.delta.to_pylist() == [None, 5.0]


def test_validation_generations_follow_the_columns() -> None:
    """The generation a batch's validation layout gives is the same while its metric and
    device columns are, and new whenever the layout is filled again, also from a layout
    another source shares (two sources never share a generation)."""
    from pipelines.refine.validate import LayoutCache, SharedLayouts

    t = T0

    def raw(devices: list[str]) -> pa.Table:
        n = len(devices)
        return pa.table(
            {
                "ts_ns": pa.array([t] * n, pa.int64()),
                "metric": ["rdma.np_cnp_sent"] * n,
                "device": devices,
                "value": pa.nulls(n, pa.float64()),
                "raw": pa.array([1] * n, pa.uint64()),
                "text": pa.nulls(n, pa.string()),
            },
            schema=SAMPLES_SCHEMA,
        )

    shared = SharedLayouts()
    mine, theirs = LayoutCache(), LayoutCache()
    gens = []
    for devices, cache in ((["a", "b"], mine), (["a", "b"], mine), (["a", "c"], mine),
                           (["a", "b"], theirs)):  # fmt: skip
        table = raw(devices)
        validate_samples(table, CAT, t, parts=[(table.num_rows, cache)], shared=shared)
        gens.append(cache.gen)
    assert gens[0] == gens[1] and len(set(gens)) == 3 and min(gens) > 0
