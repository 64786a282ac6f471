"""Compose the pure refining steps for one raw batch: dedupe → clock → validate → overlap →
align → counters → enrich → :data:`~schemas.records.REFINED_SCHEMA`.

:func:`refine_batch` is the whole refining contract of one Kafka record; the Faust agent is
a shim that decodes, calls it, and produces the outputs. Accounting invariant, always:
``input == refined + duplicate + quarantined`` (asserted on every call).

State (:class:`RefineState`) is plain dicts of small objects keyed the way the Faust tables
are: transport seqs by source key (``node|exporter|instance|boot_id``), clocks, counters and
watermarks by stream key (``node|exporter|instance``), overlap by node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipelines._arrow import column
from pipelines.clock import ClockEstimate, ClockEstimator, ClockSettings, align
from pipelines.counters import CounterState, StateDecoder, derive_rates
from pipelines.dedupe import OverlapState, Position, SeqOutcome, SeqWindow, drop_overlaps
from pipelines.enrich import TopologyIndex
from pipelines.validate import LayoutCache, RejectedRows, ValidateLimits, validate_samples
from schemas.catalog import Catalog
from schemas.records import REFINED_SCHEMA, RefinedHeader
from schemas.wire import Batch

REFINED = "refined"
DUPLICATE = "duplicate"


@dataclass(frozen=True)
class RefineSettings:
    limits: ValidateLimits = field(default_factory=ValidateLimits)
    clock: ClockSettings = field(default_factory=ClockSettings)
    clock_alert_ns: int = 1_000_000_000
    lateness_ns: int = 60_000_000_000  # behind the source's watermark by more → late
    seq_window: int = 4096


@dataclass
class RefineState:
    seqs: dict[str, SeqWindow] = field(default_factory=dict)
    clocks: dict[str, ClockEstimator] = field(default_factory=dict)
    counters: dict[str, CounterState] = field(default_factory=dict)
    overlaps: dict[str, OverlapState] = field(default_factory=dict)
    watermarks: dict[str, int] = field(default_factory=dict)
    decoders: dict[int, StateDecoder] = field(default_factory=dict)  # by id(catalog)
    layouts: dict[str, LayoutCache] = field(default_factory=dict)  # caches, not state


@dataclass(frozen=True)
class RefineResult:
    refined: pa.Table  # REFINED_SCHEMA
    dead_letters: list[RejectedRows]  # rows of the input batch, one reason per group
    outcome: str  # refined | duplicate
    seq_outcome: SeqOutcome
    input: int
    refined_count: int
    duplicate: int
    quarantined: int
    clock: ClockEstimate | None
    clock_alert: bool

    def header(self, raw_topic: str, batch: Batch, position: Position) -> RefinedHeader:
        src = batch.envelope.source
        return RefinedHeader(
            raw_topic=raw_topic,
            raw_partition=position[0],
            raw_offset=position[1],
            node=src.node,
            exporter=src.exporter,
            instance=src.instance,
            boot_id=src.boot_id,
            seq=batch.envelope.seq,
            input_samples=self.input,
            refined_samples=self.refined_count,
            duplicate_samples=self.duplicate,
            quarantined_samples=self.quarantined,
            outcome=self.outcome,
        )


def refine_batch(
    batch: Batch,
    position: Position,
    log_append_ns: int,
    state: RefineState,
    catalog: Catalog,
    topology: TopologyIndex,
    now_ns: int,
    settings: RefineSettings = RefineSettings(),
) -> RefineResult:
    """Refine one decoded samples batch read at ``position`` (partition, offset) with broker
    append time ``log_append_ns``. Updates ``state`` in place; never does I/O; raises only
    on a bug (the accounting assertion)."""
    env = batch.envelope
    src = env.source
    n = batch.table.num_rows
    seqs = state.seqs.get(src.key())
    if seqs is None:
        seqs = state.seqs[src.key()] = SeqWindow(window=settings.seq_window)
    seq_outcome = seqs.observe(env.seq, position)
    if seq_outcome.is_duplicate:
        return RefineResult(
            REFINED_SCHEMA.empty_table(), [], DUPLICATE, seq_outcome, n, 0, n, 0, None, False
        )

    stream = src.stream_key()
    clock = state.clocks.get(stream)
    if clock is None:
        clock = state.clocks[stream] = ClockEstimator(settings.clock)
    est = clock.observe(env.sent_ns, log_append_ns, env.clock)

    layout = state.layouts.get(stream)
    if layout is None:
        layout = state.layouts[stream] = LayoutCache()
    v = validate_samples(batch.table, catalog, now_ns, settings.limits, layout)
    acc = v.accepted
    ov_state = state.overlaps.get(src.node, OverlapState())
    ov, state.overlaps[src.node] = drop_overlaps(
        column(acc, "metric"), column(acc, "device"), column(acc, "ts_ns"), stream, ov_state
    )
    if ov.duplicates:
        acc = acc.filter(ov.keep)
    m = acc.num_rows

    ts_source = column(acc, "ts_ns")
    ts, offset, error = align(ts_source, est)
    cstate = state.counters.get(stream, CounterState())
    cols, state.counters[stream] = derive_rates(acc, ts, src.boot_id, cstate)
    decoder = state.decoders.get(id(catalog))
    if decoder is None:
        decoder = state.decoders[id(catalog)] = StateDecoder(catalog)
    decoded = decoder.decode(acc)

    late = cols.late
    if m:
        mark = state.watermarks.get(stream)
        if mark is not None:
            late = pc.or_(late, pc.less(ts, mark - settings.lateness_ns))
        top = pc.max(ts).as_py()
        state.watermarks[stream] = top if mark is None else max(mark, top)
    enr = topology.enrich(src.node, column(acc, "device"), ts)

    def const(value: Any, typ: pa.DataType) -> Any:
        return pa.repeat(pa.scalar(value, typ), m)

    arrays = {
        "node": const(src.node, pa.string()),
        "device": column(acc, "device"),
        "metric": column(acc, "metric"),
        "unit": column(acc, "unit"),
        "ts": ts,
        "ts_source": ts_source,
        "clock_offset_ns": offset,
        "clock_error_ns": const(error, pa.int64()),
        "value": column(acc, "value"),
        "raw": column(acc, "raw"),
        "delta": cols.delta,
        "rate": cols.rate,
        "null_reason": cols.null_reason,
        "reset": cols.reset,
        "late": late,
        "decoded": decoded,
        **{name: enr.column(name) for name in enr.column_names},
        "exporter": const(src.exporter, pa.string()),
        "instance": const(src.instance, pa.string()),
        "boot_id": const(src.boot_id, pa.string()),
        "seq": const(env.seq, pa.int64()),
        "raw_partition": const(position[0], pa.int32()),
        "raw_offset": const(position[1], pa.int64()),
    }
    refined = pa.Table.from_arrays([arrays[f.name] for f in REFINED_SCHEMA], schema=REFINED_SCHEMA)
    quarantined = v.quarantined
    assert n == m + ov.duplicates + quarantined, "accounting invariant broken"
    return RefineResult(
        refined=refined,
        dead_letters=v.rejected,
        outcome=REFINED,
        seq_outcome=seq_outcome,
        input=n,
        refined_count=m,
        duplicate=ov.duplicates,
        quarantined=quarantined,
        clock=est,
        clock_alert=est.alert(settings.clock_alert_ns),
    )


def bench_refine(n_batches: int = 200, rows_per_batch: int = 1000) -> dict[str, float]:
    """Samples per second through :func:`refine_batch` alone (no decode, no Kafka), on a
    synthetic source mixing counters (wrapping, scaled), gauges and a bitmask. The only
    timer read in ``pipelines``: it measures, it never feeds the data path.
    Run ``python -m pipelines.refine`` for the table."""
    from pipelines._bench import synthetic_source

    catalog, topology, batches = synthetic_source(n_batches, rows_per_batch)
    state = RefineState()
    t0 = time.perf_counter()
    refined = 0
    for i, (batch, append_ns) in enumerate(batches):
        r = refine_batch(batch, (0, i), append_ns, state, catalog, topology, append_ns)
        refined += r.refined_count
    dt = time.perf_counter() - t0
    total = n_batches * rows_per_batch
    return {
        "batches": float(n_batches),
        "rows_per_batch": float(rows_per_batch),
        "seconds": dt,
        "samples_per_s": total / dt,
        "batches_per_s": n_batches / dt,
        "us_per_batch": dt / n_batches * 1e6,
        "refined": float(refined),
    }


FAUST_EVENT_US = 20.0  # measured cost of one Faust event, the per-record floor


if __name__ == "__main__":  # pragma: no cover
    for rows in (100, 1000, 5000):
        r = bench_refine(200, rows)
        faust = rows / FAUST_EVENT_US * 1e6  # samples/s Faust alone allows at this batch size
        print(
            f"rows/batch {rows:5d}: {r['samples_per_s']:>12,.0f} samples/s "
            f"({r['us_per_batch']:.0f} us/batch); refine/faust-limit ratio "
            f"{r['samples_per_s'] / faust:.2f}; vs 1M target {r['samples_per_s'] / 1e6:.2f}"
        )
