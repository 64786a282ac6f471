"""Per-node clocks and network delay.

The simulator holds true time. A node's clock reads
``source = true + offset0 + drift_ppm·1e-6·(true - start) + Σ steps taken before true``.
Without the ``clock`` fault every node is chrony-synced (offset within ±50 µs, drift within
±0.5 ppm). With it, a fraction of the nodes (at least one) is unsynced: offset up to
``max_offset`` (±1 h), drift up to ``max_drift`` (±200 ppm), and one node per planning window
steps its clock by ±0.5-30 s. Network delay from a node to the broker is ~200 µs plus an
exponential tail, with rare 5-50 ms spikes when the fault is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lab.simulate.faults import FaultKind, FaultSpec, S
from schemas.wire import ClockBlock, SyncState


@dataclass
class NodeClocks:
    """Vectorized clocks of all nodes; :meth:`offsets` is the clock error at a true time."""

    start_ns: int
    offset0: np.ndarray  # int64 (N,)
    drift_ppm: np.ndarray  # float64 (N,)
    synced: np.ndarray  # bool (N,)
    step_node: list[int]
    step_at: list[int]
    step_ns: list[int]
    jitter: bool

    @classmethod
    def build(
        cls,
        n: int,
        spec: FaultSpec,
        seed: int,
        start_ns: int,
        window_ns: int,
        windows: int,
        node_names: list[str],
        interval_ns: int = S,
    ) -> NodeClocks:
        """Clocks of ``n`` nodes; a step happens on a tick boundary (``interval_ns``)."""
        rng = np.random.default_rng([seed, 104729])
        offset0 = rng.integers(-50_000, 50_001, n).astype(np.int64)
        drift = rng.uniform(-0.5, 0.5, n)
        synced = np.ones(n, dtype=bool)
        steps: tuple[list[int], list[int], list[int]] = ([], [], [])
        k = FaultKind.CLOCK
        if spec.on(k):
            frac = spec.fparam(k, "fraction", 0.25)
            max_off = spec.fparam(k, "max_offset", 3600.0)
            max_drift = spec.fparam(k, "max_drift", 200.0)
            bad = rng.random(n) < frac
            forced = spec.param(k, "node")
            if forced is not None:
                bad[node_names.index(forced) if forced in node_names else int(forced)] = True
            if not bad.any():
                bad[int(rng.integers(n))] = True
            nb = int(bad.sum())
            # a mix of moderately wrong (5 ms .. 2 s) and badly wrong (up to max_offset) clocks
            mag = np.where(
                rng.random(nb) < 0.5,
                rng.uniform(0.005, 2.0, nb),
                rng.uniform(1.0, max(1.0, max_off), nb),
            )
            offset0[bad] = (mag * rng.choice([-1, 1], nb) * S).astype(np.int64)
            drift[bad] = rng.uniform(-max_drift, max_drift, nb)
            synced[bad] = False
            for w in range(windows):
                wr = np.random.default_rng([seed, 104729, w])
                i = int(wr.integers(n))
                size = spec.fparam(k, "step", float(wr.uniform(0.5, 30.0) * wr.choice([-1, 1])))
                at = start_ns + w * window_ns + int(wr.uniform(0.2, 0.8) * window_ns)
                at = start_ns + (at - start_ns) // interval_ns * interval_ns
                steps[0].append(i)
                steps[1].append(at)
                steps[2].append(int(size * S))
                synced[i] = False
        return cls(start_ns, offset0, drift, synced, *steps, jitter=spec.on(k))

    def offsets(self, true_ns: int) -> np.ndarray:
        """Every node's clock error (source - true, ns, int64) at ``true_ns``."""
        el = float(true_ns - self.start_ns)
        off = self.offset0 + (self.drift_ppm * 1e-6 * el).astype(np.int64)
        for i, at, st in zip(self.step_node, self.step_at, self.step_ns, strict=True):
            if true_ns >= at:
                off[i] += st
        return off

    def block(self, i: int, offset_ns: int) -> ClockBlock:
        """What node ``i``'s chrony reports (its offset is only known while synced)."""
        if self.synced[i]:
            return ClockBlock.model_construct(
                source="chrony",
                offset_ns=offset_ns,
                error_bound_ns=100_000,
                state=SyncState.SYNCED,
                stratum=3,
                reference="ptp-gm",
            )
        return ClockBlock.model_construct(
            source="chrony",
            offset_ns=None,
            error_bound_ns=None,
            state=SyncState.UNSYNCED,
            stratum=16,
            reference=None,
        )

    def net_delay_ns(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Delays from node to broker for ``n`` messages (int64 ns)."""
        d = 200_000 + rng.exponential(300_000, n)
        if self.jitter:
            spikes = rng.random(n) < 0.01
            d = np.where(spikes, d + rng.uniform(5e6, 50e6, n), d)
        return d.astype(np.int64)

    def table(self, node_names: list[str]) -> pa.Table:
        """The ``*.clocks.parquet`` truth table."""
        steps = [
            [
                {"at_ns": at, "step_ns": st}
                for i2, at, st in zip(self.step_node, self.step_at, self.step_ns, strict=True)
                if i2 == i
            ]
            for i in range(len(node_names))
        ]
        return pa.table(
            {
                "node": node_names,
                "offset_ns": pa.array(self.offset0, pa.int64()),
                "drift_ppm": pa.array(self.drift_ppm, pa.float64()),
                "synced": pa.array(self.synced, pa.bool_()),
                "steps": pa.array(
                    steps, pa.list_(pa.struct([("at_ns", pa.int64()), ("step_ns", pa.int64())]))
                ),
            }
        )
