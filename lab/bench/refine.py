"""The refining kernel alone: samples per second through :func:`pipelines.refine.refine_batch`
on a synthetic source, no decode, no Kafka."""

from __future__ import annotations

import time

from lab.bench.synthetic_source import synthetic_source
from pipelines.refine.batch import RefineState, refine_batch


def bench_refine(n_batches: int = 200, rows_per_batch: int = 1000) -> dict[str, float]:
    """Samples per second through :func:`refine_batch` alone (no decode, no Kafka), on a
    synthetic source mixing counters (wrapping, scaled), gauges and a bitmask.
    Run ``python -m lab.bench.refine`` for the table."""
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
