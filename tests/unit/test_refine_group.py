"""refine_group: refining many batches at once gives exactly the results and the state of
refining them one by one, on simulator traffic with every fault on (duplicates, overlapping
sources, resets, wraps, clock steps, late and malformed rows)."""

from __future__ import annotations

import random
from dataclasses import replace

import pyarrow as pa
import pytest

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation, Stream
from pipelines.refine.batch import (
    RawBatch,
    RefineResult,
    RefineSettings,
    RefineState,
    refine_batch,
    refine_group,
)
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.wire import Batch, PayloadKind

S = 1_000_000_000
T0 = 1_700_000_000 * S
CAT = default_catalog()


def _traffic(seed: int) -> tuple[list[RawBatch], TopologyIndex]:
    sim = Simulation(Cluster.build(4, seed=seed), "all", seed=seed, start_ns=T0, duration_ns=40 * S)
    items: list[RawBatch] = []
    for tick in sim.ticks():
        for m in tick.messages:
            if m.stream is not Stream.RAW or m.envelope is None or m.table is None:
                continue
            if m.envelope.kind is not PayloadKind.SAMPLES:
                continue
            batch = Batch(envelope=m.envelope, table=m.table)
            items.append(RawBatch(batch, (len(items) % 3, len(items)), m.due_ns))
    topo = TopologyIndex(sim.cluster.topology(), sim.cluster.jobs(T0))
    return items, topo


def _same(a: RefineResult, b: RefineResult) -> None:
    assert (a.outcome, a.input, a.refined_count, a.duplicate, a.quarantined) == (
        b.outcome, b.input, b.refined_count, b.duplicate, b.quarantined,
    )  # fmt: skip
    assert a.clock == b.clock and a.clock_alert == b.clock_alert
    assert a.seq_outcome == b.seq_outcome
    assert [(d.reason, d.detail, d.rows) for d in a.dead_letters] == [
        (d.reason, d.detail, d.rows) for d in b.dead_letters
    ]
    assert a.refined.combine_chunks().equals(b.refined.combine_chunks())


@pytest.mark.parametrize("seed,lateness_s", [(1, 60.0), (2, 0.5)])
def test_group_equals_one_by_one(seed: int, lateness_s: float) -> None:
    """(A short lateness makes the simulator's delayed batches late by watermark.)"""
    items, topo = _traffic(seed)
    cfg = RefineSettings(lateness_ns=int(lateness_s * S))
    assert len(items) > 300
    now = T0 + 60 * S
    one = RefineState()
    expected = [refine_batch(i.batch, i.position, i.log_append_ns, one, CAT, topo, now, cfg)
                for i in items]  # fmt: skip
    assert sum(r.duplicate for r in expected) > 0 and sum(r.quarantined for r in expected) > 0
    assert any(r.refined.num_rows and any(r.refined.column("reset").to_pylist())
               for r in expected)  # fmt: skip

    if lateness_s < 1:
        assert sum(pa.compute.sum(r.refined.column("late")).as_py() or 0 for r in expected) > 0
    rng = random.Random(seed)
    grouped = RefineState()
    got: list[RefineResult] = []
    pos = 0
    while pos < len(items):
        size = rng.choice([1, 2, 7, 40, 200])
        got += refine_group(items[pos : pos + size], grouped, CAT, topo, now, cfg)
        pos += size
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        _same(a, b)
    _nodes_adjacent(got)
    assert grouped.watermarks == one.watermarks
    assert grouped.clocks.keys() == one.clocks.keys()
    for k, c in one.counters.items():
        assert grouped.counters[k].table.equals(c.table), k
    for node, ov in one.overlaps.items():
        assert set(grouped.overlaps[node].sources) == set(ov.sources)
        for src, t in ov.sources.items():
            assert grouped.overlaps[node].sources[src].equals(t)
    for key, w in one.seqs.items():
        assert grouped.seqs[key].positions == w.positions


def _nodes_adjacent(results: list[RefineResult]) -> None:
    """Each result's rows are its slice of its wave's rows (its newest aligned ts given),
    and within a wave every node's rows form one run (what lets the worker publish a node's
    batches as one message)."""
    waves: dict[int, pa.Table] = {}
    for r in results:
        if r.refined_count:
            assert r.wave_rows is not None
            assert r.wave_rows.slice(r.wave_start, r.refined_count).equals(r.refined)
            assert r.newest_ns == max(r.refined.column("ts").to_pylist())
            waves[id(r.wave_rows)] = r.wave_rows
        else:
            assert r.newest_ns is None
    several = 0
    for t in waves.values():
        nodes = t.column("node").to_pylist()
        runs = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
        assert len(runs) == len(set(runs)), runs
        several += len(runs) > 1
    assert several > 0  # waves of several nodes were checked, not only single-node ones


def test_empty_group() -> None:
    assert refine_group([], RefineState(), CAT, TopologyIndex([], []), T0) == []


def test_a_stream_twice_in_a_group_sees_its_own_earlier_batch() -> None:
    items, topo = _traffic(3)
    src = items[0].batch.envelope.source.stream_key()
    mine = [i for i in items if i.batch.envelope.source.stream_key() == src][:3]
    assert len(mine) == 3
    state = RefineState()
    rs = refine_group(mine, state, CAT, topo, T0 + 60 * S)
    # the second batch's counters have a previous reading: from the first, in the same call
    second = rs[1].refined
    assert second.num_rows
    deltas = pa.compute.count(second.column("delta")).as_py()
    assert deltas > 0


def test_refined_rows_carry_their_batchs_raw_topic() -> None:
    """Each batch's rows name the topic it was read from (NULL where not told), in a wave
    mixing telemetry.raw, an ingest topic and untold batches."""
    items, topo = _traffic(3)
    topics = ["telemetry.raw", "telemetry.ingest.influx", None]
    items = [replace(x, topic=topics[i % 3]) for i, x in enumerate(items[:60])]
    results = refine_group(items, RefineState(), CAT, topo, T0 + 60 * S)
    seen = set()
    for x, r in zip(items, results, strict=True):
        if r.refined_count:
            assert set(r.refined.column("raw_topic").to_pylist()) == {x.topic}
            seen.add(x.topic)
    assert seen == set(topics)
