"""The whole pipeline's maximum rate on this machine: what "half load" of a loaded run halves.

The worker's own maximum (``worker_throughput``) is measured with the worker alone on the
cores. A loaded run shares them with detect, ``refinery land``, the broker and the producers,
so half the worker's maximum can be more than the whole pipeline drains: the run then measures
a growing backlog, not a half-loaded pipeline. Here worker, detect and lander run as processes
on fresh topics while the simulator publishes a backlog as fast as it can (spread exporters,
no faults); the rate is the raw samples published over the wall time until every stage has
read everything and the lake has landed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lab.bench.harness import BenchKafka, S, sim_topics
from lab.bench.pipeline_procs import LANDED, Services
from lab.simulate.cluster import Cluster
from lab.simulate.engine import Simulation
from lab.simulate.publish import publish

DERIVED = ("telemetry.refined", "telemetry.events.aligned", "telemetry.collectives.aligned")
RAW = ("telemetry.raw", "telemetry.events", "telemetry.collectives")


@dataclass(frozen=True)
class Capacity:
    samples_per_s: float
    samples: int
    wall_s: float
    nodes: int
    seconds: int

    def details(self) -> dict[str, Any]:
        return {
            "pipeline_max_samples_per_s": round(self.samples_per_s),
            "pipeline_max_samples": self.samples,
            "pipeline_max_wall_s": round(self.wall_s, 1),
            "pipeline_max_nodes": self.nodes,
            "pipeline_max_simulated_s": self.seconds,
        }


def pipeline_max_rate(
    k: BenchKafka, nodes: int = 32, seconds: int = 30, seed: int = 31
) -> Capacity:
    """Publish ``nodes`` x ``seconds`` as a backlog while the services run; raises RuntimeError
    when a child dies or the pipeline does not drain in 10 minutes."""
    prefix = k.fresh_topics()
    svc = Services(k, prefix, k.workdir / f"{prefix}lake")
    p = prefix
    try:
        svc.wait_joined()
        sim = Simulation(
            Cluster.build(nodes, seed=seed), None, seed=seed, duration_ns=seconds * S, spread=True
        )
        t0 = time.monotonic()
        rep = publish(sim, k.kafka, sim_topics(prefix), None, speed=0, progress_cb=None)
        stages = (
            ("worker", RAW),
            ("detect", DERIVED),
            ("land", tuple(t for t, _ in LANDED)),
        )

        def drained() -> bool:
            return all(k.lag(p + g, [p + t for t in topics]) == 0 for g, topics in stages)

        k.wait("the pipeline drains the backlog", drained, 600, svc.kids)
        wall = time.monotonic() - t0
    finally:
        for c in svc.kids:
            if c.alive():
                c.stop(30)
    k.say(
        f"  the whole pipeline drained {rep.samples_acked:,} samples in {wall:.1f}s: "
        f"{rep.samples_acked / wall:,.0f} samples/s"
    )
    return Capacity(rep.samples_acked / wall, rep.samples_acked, wall, nodes, seconds)
