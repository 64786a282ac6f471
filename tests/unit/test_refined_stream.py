"""A refined message's IPC stream written straight into one buffer: the same bytes as the
stream of parts joined, for any run of a wave's rows, within the bound the worker gives it,
and the plain stream when the buffer is too small."""

from __future__ import annotations

import itertools

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.messages import Stream
from pipelines.refine.enrich import TopologyIndex
from schemas.catalog import default_catalog
from schemas.codec import ipc_stream, ipc_stream_within
from schemas.topics import TOPICS
from services.worker.refiner import RawRecord, Refiner
from services.worker.waves import WaveRows

S = 1_000_000_000
T0 = 1_800_000_000 * S


def _wave() -> pa.RecordBatch:
    """The refined rows of one wave of simulator traffic with every fault (sentinels, late
    rows, duplicates: nulls in many columns)."""
    sim = Simulation(Cluster.build(4, seed=5), "all", seed=5, start_ns=T0, duration_ns=6 * S)
    recs: list[RawRecord] = []
    for tick in sim.ticks():
        for m in tick.messages:
            if m.stream is Stream.RAW:
                ct, body = m.encode()
                off = len(recs)
                recs.append(RawRecord("raw", 0, off, m.key, body, [("content-type", ct.encode())],
                                      m.due_ns // 10**6))  # fmt: skip
    topo = TopologyIndex(sim.cluster.topology(), sim.cluster.jobs(T0))
    ref = Refiner(default_catalog(), TOPICS, lambda: topo, lambda _: None, lambda _: None)
    ref.process_group(recs[: len(recs) // 2], T0 + 10 * S)
    # the second half in one call: one wave's table, read back from a refined result
    from pipelines.refine.batch import RawBatch, refine_group
    from schemas.codec import content_type_of, decode
    from schemas.errors import RejectedInput
    from schemas.wire import PayloadKind

    items = []
    for r in recs[len(recs) // 2 :]:
        try:
            b = decode(r.value, content_type_of(r.headers))
        except RejectedInput:  # the malformed records of the faults
            continue
        if b.envelope.kind is PayloadKind.SAMPLES and b.table.num_rows:
            items.append(RawBatch(b, (0, r.offset), r.append_ms * 1_000_000))
    res = refine_group(items, ref.state.refine, ref.catalog, topo, T0 + 10 * S, ref.settings)
    wave = next(r.wave_rows for r in res if r.wave_rows is not None)
    return wave.combine_chunks().to_batches()[0]


WAVE = _wave()
ROWS = WAVE.num_rows


@settings(max_examples=60, deadline=None)
@given(st.integers(0, ROWS - 1), st.integers(1, ROWS))
def test_a_run_written_within_its_bound_is_the_plain_stream(start: int, rows: int) -> None:
    rows = min(rows, ROWS - start)
    part = WAVE.slice(start, rows)
    plain = ipc_stream(part)
    bound = WaveRows(WAVE, [(start, rows)]).bounds.get(start)
    assert bound is not None and bound >= plain.size  # never the fallback for these columns
    assert ipc_stream_within(part, bound).equals(plain)
    # and read back, the rows themselves
    assert (
        pa.ipc.open_stream(ipc_stream_within(part, bound))
        .read_all()
        .equals(pa.Table.from_batches([part]))
    )


def test_a_buffer_too_small_gives_the_plain_stream() -> None:
    part = WAVE.slice(3, 200)
    plain = ipc_stream(part)
    for size in (0, 64, plain.size - 1):
        assert ipc_stream_within(part, size).equals(plain)
    assert ipc_stream_within(part, plain.size).equals(plain)  # exactly enough


def test_every_run_of_a_wave_gets_its_own_bound() -> None:
    """Runs end to end over the whole wave, bounded all at once: each within its bound."""
    cuts = [0, 1, 2, 50, 51, 700, 1500, ROWS - 1, ROWS]
    spans = [(a, b - a) for a, b in itertools.pairwise(cuts)]
    bounds = WaveRows(WAVE, spans).bounds
    for a, n in spans:
        assert bounds[a] >= ipc_stream(WAVE.slice(a, n)).size


def test_columns_without_a_known_bound_are_serialized_plainly() -> None:
    batch = pa.record_batch({"x": pa.array([[1], [2, 3]], pa.list_(pa.int64()))})
    assert WaveRows(batch, [(0, 2)]).bounds == {}
