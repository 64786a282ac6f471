"""Per-node clocks and network delay.

The simulator holds true time ``t``. Each node has two clocks (all in ns):

- its raw oscillator, what ``CLOCK_MONOTONIC_RAW`` follows, never stepped nor slewed:
  ``raw(t) = t + offset0 + drift_ppm·1e-6·(t - start) - lost(t)``, ``lost`` the time its clocks
  stood still in VM pauses so far;
- its wall clock, ``wall(t) = raw(t) + adj(t)``, ``adj`` the sum of every step and every slew
  made so far: the ``clock`` fault's steps and the clock models' corrections.

Without faults every node is chrony-synced (offset within ±50 µs, drift within ±0.5 ppm). The
``clock`` fault makes a fraction of the nodes (at least one) unsynced: offset up to ``max_offset``
(±1 h), drift up to ``max_drift`` (±200 ppm), and one node per planning window steps its clock
by ±0.5-30 s. The clock models (chrony and ntpd slews, steps, VM pauses, PTP, leap smears, fast
clocks) are fault kinds of their own, planned and evaluated in :mod:`.clock_models`, from which
:func:`.clock_models.truth_offsets` rebuilds a node's clocks out of its truth row. Network
delay from a node to the broker is ~200 µs plus an exponential tail, with rare 5-50 ms spikes
when the ``clock`` fault is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from lab.simulate.clock_models import MODEL_TYPE, ClockModel, ModelPlan, ModelTrack
from lab.simulate.faults import FaultKind, FaultSpec, S
from schemas.wire import ClockBlock, SyncState

K = FaultKind


@dataclass
class NodeClocks:
    """Vectorized clocks of all nodes: :meth:`offsets` (wall - true) and :meth:`raw_offsets`
    (raw - true) at true times; :meth:`paused` and :meth:`resumed` say when a node can
    stamp. ``plan`` adds the models of each planning window when asked
    (:meth:`plan_window`), as the run reaches it."""

    start_ns: int
    offset0: np.ndarray  # int64 (N,)
    drift_ppm: np.ndarray  # float64 (N,)
    synced: np.ndarray  # bool (N,)
    step_node: list[int]
    step_at: list[int]
    step_ns: list[int]
    jitter: bool
    models: list[ClockModel] = field(default_factory=list)
    plan: ModelPlan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._planned = {0} if self.plan is not None else set()
        self._steps: dict[int, list[tuple[int, int]]] = {}  # (at, size) by node
        for i, a, z in zip(self.step_node, self.step_at, self.step_ns, strict=True):
            self._steps.setdefault(i, []).append((a, z))
        self._index()

    def plan_window(self, w: int) -> None:
        """Add the clock models of planning window ``w`` (once)."""
        if self.plan is not None and w not in self._planned:
            self._planned.add(w)
            self.models += self.plan.window(w)
            self._index()

    def _index(self) -> None:
        self.models.sort(key=lambda m: m.start_ns)
        self._tracks: dict[int, ModelTrack] = {}  # nodes with models or steps
        self._pauses: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i in {m.node for m in self.models} | set(self._steps):
            mine = [m for m in self.models if m.node == i]
            d = float(self.drift_ppm[i])
            self._tracks[i] = ModelTrack(mine, d, self._steps.get(i, ()))
            spans = [(m.start_ns, m.start_ns + int(m.params["pause_ns"])) for m in mine
                     if m.kind is K.VM_PAUSE]  # fmt: skip
            if spans:
                self._pauses[i] = (
                    np.asarray([a for a, _ in spans]),
                    np.asarray([b for _, b in spans]),
                )

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
        phase_ns: np.ndarray | None = None,
        idle: np.ndarray | None = None,
    ) -> NodeClocks:
        """Clocks of ``n`` nodes, with the clock models of the whole run and of window 0
        (:meth:`plan_window` adds the others); a ``clock`` step happens on a tick boundary
        (``interval_ns``), a ``steps`` model's on the node's ticks (``phase_ns``); a VM pause
        prefers an ``idle`` node."""
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
        phase = np.zeros(n, np.int64) if phase_ns is None else phase_ns
        plan = ModelPlan(spec, seed, start_ns, window_ns, interval_ns, node_names, phase, idle)
        models = plan.for_run(~synced) + plan.window(0)
        return cls(start_ns, offset0, drift, synced, *steps, spec.on(k), models, plan)

    # -- offsets ------------------------------------------------------------------------------

    def _eval(self, nodes: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(wall - true, raw - true), int64 like ``t`` (M, K): row r is node ``nodes[r]``."""
        drift = self.drift_ppm[nodes][:, None]
        raw = self.offset0[nodes][:, None] + (drift * 1e-6 * (t - self.start_ns)).astype(np.int64)
        wall = raw.copy()
        for r, i in enumerate(map(int, nodes)):
            track = self._tracks.get(i)
            if t.shape[1] and track is not None:
                wall[r], raw[r] = track.offsets(t[r], raw[r])
        return wall, raw

    def _all(self, true_ns: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = np.asarray(true_ns, np.int64)
        n = len(self.offset0)
        if t.ndim == 0:
            wall, raw = self._eval(np.arange(n), np.full((n, 1), int(t), np.int64))
            return wall[:, 0], raw[:, 0]
        return self._eval(np.arange(n), np.broadcast_to(t, (n, t.shape[-1])))

    def offsets(self, true_ns: int | np.ndarray) -> np.ndarray:
        """Every node's wall clock error (wall - true, ns, int64): at a true time, shape (N,);
        at K true times, (N, K); at an (N, K) array of them, node i at row i."""
        return self._all(true_ns)[0]

    def raw_offsets(self, true_ns: int | np.ndarray) -> np.ndarray:
        """Every node's raw clock error (raw - true), shaped as :meth:`offsets`."""
        return self._all(true_ns)[1]

    def node_offsets(self, i: int, true_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Node ``i``'s wall and raw clock errors at each of ``true_ns`` (1-D)."""
        t = np.asarray(true_ns, np.int64).reshape(1, -1)
        wall, raw = self._eval(np.asarray([i]), t)
        return wall[0], raw[0]

    def offset(self, i: int, true_ns: int) -> int:
        """Node ``i``'s wall clock error at ``true_ns``."""
        return int(self.node_offsets(i, np.asarray([true_ns]))[0][0])

    def raw_offset(self, i: int, true_ns: int) -> int:
        """Node ``i``'s raw clock error at ``true_ns``."""
        return int(self.node_offsets(i, np.asarray([true_ns]))[1][0])

    def paused(self, i: int, true_ns: np.ndarray) -> np.ndarray:
        """Whether node ``i`` stands still (a VM pause, its end included) at each of
        ``true_ns``: it stamps nothing then."""
        t = np.asarray(true_ns, np.int64)
        if i not in self._pauses:
            return np.zeros(t.shape, bool)
        starts, ends = self._pauses[i]
        k = np.searchsorted(starts, t, side="right") - 1
        return (k >= 0) & (t <= ends[np.maximum(k, 0)])

    def resumed(self, i: int, true_ns: int) -> int:
        """``true_ns``, or the end of node ``i``'s pause it falls in (when it can send)."""
        starts, ends = self._pauses.get(i, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        k = int(np.searchsorted(starts, true_ns, side="right")) - 1
        return int(ends[k]) if k >= 0 and true_ns < ends[k] else true_ns

    # -- what the node and the truth say --------------------------------------------------------

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
        """The ``*.clocks.parquet`` truth table: per node its clock at the start (offset_ns,
        drift_ppm), the ``clock`` fault's steps, and its clock models (``models``: kind,
        start_ns, end_ns, params), from which :func:`.clock_models.truth_offsets` rebuilds
        its clocks."""
        steps: list[list[dict[str, int]]] = [[] for _ in node_names]
        for at, i, st in sorted(zip(self.step_at, self.step_node, self.step_ns, strict=True)):
            steps[i].append({"at_ns": at, "step_ns": st})
        models: list[list[dict[str, Any]]] = [[] for _ in node_names]
        for m in self.models:
            models[m.node].append(m.row())
        return pa.table(
            {
                "node": node_names,
                "offset_ns": pa.array(self.offset0, pa.int64()),
                "drift_ppm": pa.array(self.drift_ppm, pa.float64()),
                "synced": pa.array(self.synced, pa.bool_()),
                "steps": pa.array(
                    steps, pa.list_(pa.struct([("at_ns", pa.int64()), ("step_ns", pa.int64())]))
                ),
                "models": pa.array(models, pa.list_(MODEL_TYPE)),
            }
        )
