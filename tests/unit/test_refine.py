"""refine_batch: the composed contract of one raw record."""

from __future__ import annotations

import math

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.bench.refine import bench_refine
from lab.bench.synthetic_source import bench_catalog, bench_topology
from pipelines.refine.batch import RefineState, refine_batch
from pipelines.refine.enrich import TopologyIndex
from schemas.records import REFINED_SCHEMA
from schemas.wire import SAMPLES_SCHEMA, Batch, ClockBlock, Envelope, SourceId

NOW = 1_700_000_000_000_000_000
S = 1_000_000_000
CAT = bench_catalog()
TOPO = TopologyIndex(*bench_topology("n1"))


def batch(rows: list[dict[str, object]], seq: int, exporter: str = "node", sent: int = NOW,
          boot: str = "b0", clock: ClockBlock | None = None) -> Batch:  # fmt: skip
    cols = {f.name: [r.get(f.name) for r in rows] for f in SAMPLES_SCHEMA}
    env = Envelope(
        source=SourceId(node="n1", exporter=exporter, instance="0", boot_id=boot),
        seq=seq,
        sent_ns=sent,
        clock=clock,
    )
    return Batch(envelope=env, table=pa.table(cols, schema=SAMPLES_SCHEMA))


def ctr(raw: int, ts: int = NOW, device: str = "mlx5_0/1") -> dict[str, object]:
    return {"ts_ns": ts, "metric": "rdma.np_cnp_sent", "device": device, "raw": raw}


def test_refined_rows_carry_schema_lineage_rates_and_enrichment() -> None:
    state = RefineState()
    r1 = refine_batch(batch([ctr(100)], 1), (3, 10), NOW + 2_000_000, state, CAT, TOPO, NOW)
    r2 = refine_batch(
        batch([ctr(300, NOW + 2 * S), {"ts_ns": NOW + 2 * S, "metric": "gpu.sm_clock",
                                       "device": "gpu0", "value": 1400.0}], 2, sent=NOW + 2 * S),
        (3, 11), NOW + 2 * S + 2_000_000, state, CAT, TOPO, NOW,
    )  # fmt: skip
    assert r1.refined.schema == REFINED_SCHEMA and r2.refined.schema == REFINED_SCHEMA
    row = r2.refined.to_pylist()[0]
    assert row["delta"] == 200.0 and math.isclose(row["rate"], 100.0, rel_tol=1e-3)
    assert (row["raw_partition"], row["raw_offset"], row["seq"]) == (3, 11, 2)
    assert (row["exporter"], row["instance"], row["boot_id"]) == ("node", "0", "b0")
    assert row["rail"] == 0 and row["leaf"] == "leaf0" and row["job"] == "j1"
    assert row["ts"] == row["ts_source"] - row["clock_offset_ns"]
    assert r1.refined.to_pylist()[0]["null_reason"] == "first_sample"
    assert r2.outcome == "refined" and r2.refined_count == 2
    h = r2.header("telemetry.raw", batch([], 2), (3, 11))
    assert h.input_samples == 2 and h.outcome == "refined"
    # what the worker serializes without building the model: the model's fields exactly
    assert r2.header_fields("telemetry.raw", batch([], 2), (3, 11)) == h.model_dump()


def test_transport_duplicate_and_replay() -> None:
    state = RefineState()
    b = batch([ctr(1), ctr(2, device="mlx5_1/1")], 7)
    assert refine_batch(b, (0, 5), NOW, state, CAT, TOPO, NOW).outcome == "refined"
    replay = refine_batch(b, (0, 5), NOW, state, CAT, TOPO, NOW)
    assert replay.outcome == "refined" and replay.seq_outcome.value == "replay"
    dup = refine_batch(b, (0, 9), NOW, state, CAT, TOPO, NOW)
    assert dup.outcome == "duplicate" and dup.duplicate == 2 and dup.refined.num_rows == 0


def test_overlapping_exporter_copy_counted_as_duplicate() -> None:
    state = RefineState()
    rows = [ctr(1), ctr(2, device="mlx5_1/1")]
    refine_batch(batch(rows, 1, exporter="a"), (0, 1), NOW, state, CAT, TOPO, NOW)
    r = refine_batch(batch(rows, 1, exporter="b"), (0, 2), NOW, state, CAT, TOPO, NOW)
    assert (r.duplicate, r.refined_count, r.outcome) == (2, 0, "refined")


def test_clock_alert_and_late_flag() -> None:
    state = RefineState()
    off = 5 * S  # the source runs 5 s ahead
    r = refine_batch(batch([ctr(1, NOW + off)], 1, sent=NOW + off), (0, 1), NOW, state, CAT,
                     TOPO, NOW)  # fmt: skip
    assert r.clock_alert and r.clock is not None and abs(r.clock.offset_ns - off) < 10**7
    assert abs(r.refined.column("ts")[0].as_py() - NOW) < 10**7
    r = refine_batch(batch([ctr(2, NOW + off + 100 * S)], 2, sent=NOW + off + 100 * S),
                     (0, 2), NOW + 100 * S, state, CAT, TOPO, NOW)  # fmt: skip
    old = refine_batch(batch([ctr(5, NOW + off, "mlx5_3/1")], 3, sent=NOW + off + 101 * S),
                       (0, 3), NOW + 101 * S, state, CAT, TOPO, NOW)  # fmt: skip
    assert old.refined.column("late").to_pylist() == [True]


good = st.fixed_dictionaries(
    {
        "metric": st.sampled_from(["rdma.np_cnp_sent", "ib.port_rcv_data", "gpu.sm_clock",
                                   "gpu.clock_event_reasons", "cpu.busy"]),
        "device": st.sampled_from(["mlx5_0/1", "mlx5_1/1/prio3", "gpu0", "cpu1", "mlx5_9"]),
        "value": st.floats(0, 1),
        "raw": st.integers(0, 2**32 - 1),
    }
)  # fmt: skip
bad = st.fixed_dictionaries(
    {
        "metric": st.sampled_from(["nope", "gpu.sm_clock", "ib.port_rcv_data", "cpu.busy"]),
        "device": st.sampled_from(["", "gpu0", "z" * 300]),
        "value": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
        "raw": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        "text": st.sampled_from([None, "N/A (no PMA)", "junk"]),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.one_of(good, bad), st.integers(-3, 3)), max_size=30),
            st.sampled_from(["a", "b"]),
            st.integers(0, 6),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_property_accounting_invariant_always_holds(
    batches: list[tuple[list[tuple[dict[str, object], int]], str, int, int]],
) -> None:
    state = RefineState()
    totals = [0, 0, 0, 0]
    for i, (rows, exporter, seq, offset) in enumerate(batches):
        t = NOW + i * S
        rows_ = [{**r, "ts_ns": t + dt * S + (10**18 if r["device"] == "" else 0)}
                 for r, dt in rows]  # fmt: skip
        r = refine_batch(batch(rows_, seq, exporter=exporter, sent=t), (0, offset), t + 10**6,
                         state, CAT, TOPO, t)  # fmt: skip
        assert r.input == len(rows_) == r.refined_count + r.duplicate + r.quarantined
        assert r.refined.num_rows == r.refined_count
        assert r.quarantined == sum(g.count for g in r.dead_letters)
        assert r.refined.schema == REFINED_SCHEMA
        rates = [x for x in r.refined.column("rate").to_pylist() if x is not None]
        assert all(x >= 0 for x in rates)
        for k, v in enumerate((r.input, r.refined_count, r.duplicate, r.quarantined)):
            totals[k] += v
    assert totals[0] == totals[1] + totals[2] + totals[3]


def test_bench_refine_runs() -> None:
    out = bench_refine(5, 200)
    assert out["refined"] == 5 * 200 and out["samples_per_s"] > 0
