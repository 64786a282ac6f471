"""Generation micro-benchmark: how fast the simulator builds and encodes batches (no Kafka)."""

from __future__ import annotations

import time

from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation, Stream

S = 1_000_000_000


def bench_generate(nodes: int, ticks: int, *, encode: bool = True, seed: int = 0) -> float:
    """Samples per second generated (and Arrow-IPC encoded when ``encode``) for ``ticks`` ticks
    of a ``nodes``-node cluster without faults. CPU-bound; blocks for the whole run."""
    sim = Simulation(
        Cluster.build(nodes, seed=seed),
        None,
        seed=seed,
        start_ns=1_700_000_000 * S,
        duration_ns=ticks * S,
    )
    samples = 0
    t0 = time.perf_counter()
    for tick in sim.ticks():
        for m in tick.messages:
            if m.stream is Stream.RAW:
                samples += m.samples
            if encode:
                m.encode()
    return samples / (time.perf_counter() - t0)
