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
by ±0.5-30 s. The clock models (:class:`ClockModel`; fault kinds of their own, parameters in
:mod:`.faults`) follow real clock discipline, each on one node by default (a synced one no other
model holds); ``x`` is the offset a daemon has left to correct (s):

============  ===================================================================================
chrony_slew   chrony slews an offset away at ``min(maxslewrate, x / 1 s, x² / C)``: its slew lasts
              ``C / |x|``, at least 1 s, ``C`` its correction_rate (sys_generic.c), until x < 1 µs
ntpd_slew     ntpd (``adjtime``) slews an offset away at the kernel's 500 ppm
steps         steps of the wall clock below and above the product's 50 µs step tolerance, then
              two steps 0.3 s apart that net 40 µs, between two sends of every exporter
vm_pause      wall and raw stand still for ``pause`` (nothing is stamped nor sent meanwhile);
              ``delay`` later the daemon catches the wall clock up: a step past 1 s, else a slew
ptp           a PTP servo: the wall clock is true time plus a sub-µs offset and wander
leap_smear    a 24 h linear smear of a leap second: the wall runs 11.574 ppm off for the run
fast_clock    the wall clock runs 1,000 ppm fast for a minute (a daemon's bad frequency)
============  ===================================================================================

A model is zero before its start; its effect stops changing at its end. Network delay from a
node to the broker is ~200 µs plus an exponential tail, with rare 5-50 ms spikes when the
``clock`` fault is on.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from lab.simulate.faults import FaultKind, FaultSpec, S
from schemas.errors import ConfigError
from schemas.wire import ClockBlock, SyncState

K = FaultKind
# models that hold for the whole run start this long before it (before the exporters greet)
RUN_LEAD_NS = 10 * S
DONE_S = 1e-6  # a slew with less than this left is done
FOREVER = 1 << 62  # the end of a model that holds for the run
CHRONY_MAX_PPM = 1e6 / 12  # chrony's default maxslewrate
# chrony's correction_rate: corrtimeratio 3 x 1/2 x offset sd 100 µs x update interval 64 s
CHRONY_CORRECTION = 3 * 0.5 * 100e-6 * 64
MODEL_TYPE = pa.struct(
    [
        ("kind", pa.string()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("params", pa.map_(pa.string(), pa.float64())),
    ]
)


def chrony_left(x0: float, max_rate: float, corr: float, dt: np.ndarray) -> np.ndarray:
    """What chrony has left of an offset ``x0`` (s, > 0) ``dt`` s into slewing it away at
    ``min(max_rate, x / 1 s, x² / corr)``: linear at the cap, then exponential, then 1/t;
    0 once under :data:`DONE_S`."""
    if x0 < DONE_S:
        return np.zeros(np.shape(dt))
    xa = max(max_rate, math.sqrt(max_rate * corr))  # the cap binds above xa
    ta = max(0.0, (x0 - xa) / max_rate)
    xb = min(x0, xa)
    tb = math.log(xb / corr) if xb > corr else 0.0
    xc = min(xb, corr)
    dt = np.maximum(dt, 0.0)
    x = np.where(
        dt < ta,
        x0 - max_rate * dt,
        np.where(dt < ta + tb, xb * np.exp(ta - dt), 1 / (1 / xc + (dt - ta - tb) / corr)),
    )
    return np.where(x < DONE_S, 0.0, x)


def chrony_duration(x0: float, max_rate: float, corr: float) -> float:
    """Seconds :func:`chrony_left` takes to be done with ``x0``."""
    if x0 < DONE_S:
        return 0.0
    xa = max(max_rate, math.sqrt(max_rate * corr))
    xb = min(x0, xa)
    xc = min(xb, corr)
    tail = corr * (1 / DONE_S - 1 / xc) if xc > DONE_S else 0.0
    return max(0.0, (x0 - xa) / max_rate) + (math.log(xb / corr) if xb > corr else 0.0) + tail


@dataclass(frozen=True)
class ClockModel:
    """One clock model of node ``node`` (module docstring), from ``start_ns`` (true time);
    its effect stops changing at ``end_ns`` (:data:`FOREVER`: it holds for the run).
    ``params`` by kind: chrony_slew offset_s, maxslewrate_ppm, correction_s2; ntpd_slew
    offset_s, rate_ppm; steps size_ns (one model a step); vm_pause pause_ns, delay_ns, step
    (1: stepped back, 0: slewed as chrony_slew), maxslewrate_ppm, correction_s2; ptp
    offset_ns, wander_ns, p1_s, p2_s, phi1, phi2 (two sines); leap_smear ppm; fast_clock
    ppm, dur_ns."""

    node: int
    kind: FaultKind
    start_ns: int
    end_ns: int
    params: dict[str, float] = field(default_factory=dict)

    def lost(self, el: np.ndarray, drift_ppm: float) -> np.ndarray:
        """ns the node's clocks stood still by ``el`` ns after the start (a VM pause: the
        raw clock stands still, so it loses true time and its drift alike)."""
        if self.kind is not K.VM_PAUSE:
            return np.zeros(el.shape)
        lost = np.clip(el, 0, self.params["pause_ns"]) * (1 + drift_ppm * 1e-6)
        return np.asarray(lost, np.float64)

    def adj(self, el: np.ndarray, drift_ppm: float, raw: np.ndarray) -> np.ndarray:
        """ns it has added to ``wall - raw`` by ``el`` ns after its start (float); ``raw`` the
        node's oscillator's offset then, pauses aside (a PTP servo cancels it; a pause is
        the VM's, caught up by its own model)."""
        p, k = self.params, self.kind
        if k in (K.CHRONY_SLEW, K.NTPD_SLEW):
            x0, dt = abs(p["offset_s"]), np.maximum(el, 0) / S
            if k is K.CHRONY_SLEW:
                left = chrony_left(x0, p["maxslewrate_ppm"] * 1e-6, p["correction_s2"], dt)
            else:
                left = np.maximum(x0 - p["rate_ppm"] * 1e-6 * dt, 0.0)
            return -math.copysign(S, p["offset_s"]) * (x0 - left)
        if k is K.STEPS:
            return np.where(el >= 0, p["size_ns"], 0.0)
        if k is K.VM_PAUSE:
            behind = p["pause_ns"] * (1 + drift_ppm * 1e-6)  # what the wall clock lost
            since = el - p["pause_ns"] - p["delay_ns"]  # the catch-up's start
            if p["step"]:
                return np.where(since >= 0, behind, 0.0)
            cap = p["maxslewrate_ppm"] * 1e-6
            return behind - S * chrony_left(behind / S, cap, p["correction_s2"], since / S)
        if k is K.PTP:
            w = 2 * math.pi * el / S
            wander = 0.7 * np.sin(w / p["p1_s"] + p["phi1"])
            wander += 0.3 * np.sin(w / p["p2_s"] + p["phi2"])
            return np.where(el >= 0, p["offset_ns"] + p["wander_ns"] * wander - raw, 0.0)
        span = np.clip(el, 0, p["dur_ns"] if k is K.FAST_CLOCK else None)  # leap_smear: all
        return np.asarray(p["ppm"] * 1e-6 * span, np.float64)

    def row(self) -> dict[str, Any]:
        """The model as an item of the clocks truth's ``models`` list (:data:`MODEL_TYPE`)."""
        return {
            "kind": self.kind.value,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "params": self.params,
        }


@dataclass
class _Track:
    """One node's clock models, indexed for any true time: ``finite`` by start (the longest
    lasts ``longest``), ``forever`` (held for the run), and the effect of the finite ones
    once done (after their end and a second: :meth:`ClockModel.adj` no longer changes),
    summed in order of that instant."""

    finite: list[ClockModel]
    forever: list[ClockModel]
    longest: int
    done_at: np.ndarray  # int64 (F,) ascending
    done: np.ndarray  # int64 (F + 1, 2): lost, adj of those done before, cumulated


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
    plan: _ModelPlan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._planned = {0} if self.plan is not None else set()
        self._steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # at, cumulated sizes
        for i in set(self.step_node):
            steps = sorted(
                (a, z) for n, a, z in zip(self.step_node, self.step_at, self.step_ns, strict=True)
                if n == i
            )  # fmt: skip
            at = np.asarray([a for a, _ in steps], np.int64)
            self._steps[i] = at, np.cumsum([0] + [z for _, z in steps], dtype=np.int64)
        self._index()

    def plan_window(self, w: int) -> None:
        """Add the clock models of planning window ``w`` (once)."""
        if self.plan is not None and w not in self._planned:
            self._planned.add(w)
            self.models += self.plan.window(w)
            self._index()

    def _index(self) -> None:
        self.models.sort(key=lambda m: m.start_ns)
        self._tracks: dict[int, _Track] = {}
        self._pauses: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i in {m.node for m in self.models}:
            mine = [m for m in self.models if m.node == i]
            finite = [m for m in mine if m.end_ns < FOREVER]
            d = float(self.drift_ppm[i])
            by_end = sorted(finite, key=lambda m: m.end_ns)
            done = [(0, 0)] + [_final(m, d) for m in by_end]
            self._tracks[i] = _Track(
                finite,
                [m for m in mine if m.end_ns >= FOREVER],
                max((m.end_ns + S - m.start_ns for m in finite), default=0),
                np.asarray([m.end_ns + S for m in by_end], np.int64),
                np.cumsum(np.asarray(done, np.int64), axis=0),
            )
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
        plan = _ModelPlan(spec, seed, start_ns, window_ns, interval_ns, node_names, phase, idle)
        models = plan.for_run(~synced) + plan.window(0)
        return cls(start_ns, offset0, drift, synced, *steps, spec.on(k), models, plan)

    # -- offsets ------------------------------------------------------------------------------

    def _node(self, i: int, t: np.ndarray, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Node ``i``'s (wall, raw) offsets at ``t`` (1-D) from ``raw``, its oscillator's."""
        track = self._tracks.get(i)
        adj = np.zeros(t.shape, np.int64)
        if track is not None:
            lo, hi, d = int(t.min()), int(t.max()), float(self.drift_ppm[i])
            done = track.done[np.searchsorted(track.done_at, t, side="left")]
            a = bisect_left(track.finite, lo - track.longest, key=lambda m: m.start_ns)
            b = bisect_right(track.finite, hi, key=lambda m: m.start_ns)
            live = [m for m in track.finite[a:b] if m.end_ns + S >= lo] + track.forever
            lost = done[:, 0].copy()
            for m in live:  # the done ones are in ``done``, the others from their start
                on = t <= m.end_ns + S
                lost += np.where(on, np.rint(m.lost(t - m.start_ns, d)).astype(np.int64), 0)
            osc, raw = raw, raw - lost
            adj += done[:, 1]
            for m in live:
                on = t <= m.end_ns + S
                adj += np.where(on, np.rint(m.adj(t - m.start_ns, d, osc)).astype(np.int64), 0)
        if i in self._steps:
            at, cum = self._steps[i]
            adj += cum[np.searchsorted(at, t, side="right")]
        return raw + adj, raw

    def _eval(self, nodes: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(wall - true, raw - true), int64 like ``t`` (M, K): row r is node ``nodes[r]``."""
        drift = self.drift_ppm[nodes][:, None]
        raw = self.offset0[nodes][:, None] + (drift * 1e-6 * (t - self.start_ns)).astype(np.int64)
        wall = raw.copy()
        for r, i in enumerate(map(int, nodes)):
            if t.shape[1] and (i in self._tracks or i in self._steps):
                wall[r], raw[r] = self._node(i, t[r], raw[r])
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
        start_ns, end_ns, params), from which :func:`truth_offsets` rebuilds its clocks."""
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


def truth_offsets(
    row: Mapping[str, Any], true_ns: np.ndarray, start_ns: int, raw: bool = False
) -> np.ndarray:
    """The wall (``raw``: raw) clock error of the node of clocks truth ``row`` at each of
    ``true_ns``, rebuilt as :class:`NodeClocks` computes it; ``start_ns`` the run's start (the
    drift's origin). A row without ``models`` (an older truth) has none."""
    models = []
    for item in row.get("models") or ():
        params = item["params"]
        pairs = params.items() if isinstance(params, Mapping) else params
        models.append(
            ClockModel(
                0,
                FaultKind(item["kind"]),
                int(item["start_ns"]),
                int(item["end_ns"]),
                {str(k): float(v) for k, v in pairs},
            )
        )
    steps = [(int(s["at_ns"]), int(s["step_ns"])) for s in row.get("steps") or ()]
    clocks = NodeClocks(
        start_ns,
        np.asarray([int(row["offset_ns"])], np.int64),
        np.asarray([float(row["drift_ppm"])]),
        np.asarray([bool(row.get("synced", True))]),
        [0] * len(steps),
        [at for at, _ in steps],
        [st for _, st in steps],
        False,
        models,
    )
    wall, raw_off = clocks.node_offsets(0, true_ns)
    return raw_off if raw else wall


def _final(m: ClockModel, drift_ppm: float) -> tuple[int, int]:
    """(lost, adj) of finite model ``m`` once done: a second after its end."""
    el = np.asarray([m.end_ns + S - m.start_ns], np.int64)
    lost = int(np.rint(m.lost(el, drift_ppm))[0])
    return lost, int(np.rint(m.adj(el, drift_ppm, np.zeros(1)))[0])


class _ModelPlan:
    """Where and when the clock models happen (module docstring), deterministic in the seed
    and the window; a model's parameters come from the spec or its own rng."""

    def __init__(
        self,
        spec: FaultSpec,
        seed: int,
        start_ns: int,
        window_ns: int,
        interval_ns: int,
        node_names: list[str],
        phase: np.ndarray,
        idle: np.ndarray | None,
    ) -> None:
        self.spec, self.seed, self.start = spec, seed, start_ns
        self.window_ns, self.iv, self.names = window_ns, interval_ns, node_names
        self.phase, self.idle = phase, idle
        self.taken: set[int] = set()  # the clock fault's nodes and the run's models'
        self.per_window: list[tuple[FaultKind, Callable[..., list[ClockModel]]]] = [
            (K.CHRONY_SLEW, self._slew),
            (K.NTPD_SLEW, self._slew),
            (K.STEPS, self._steps),
            (K.VM_PAUSE, self._pause),
            (K.FAST_CLOCK, self._fast),
        ]

    def for_run(self, unsynced: np.ndarray) -> list[ClockModel]:
        """The models that hold for the whole run (from before its start), on nodes the
        ``clock`` fault left alone where it can."""
        self.taken = set(map(int, np.flatnonzero(unsynced)))
        out: list[ClockModel] = []
        for no, kind in enumerate((K.PTP, K.LEAP_SMEAR)):
            if self.spec.on(kind):
                rng = np.random.default_rng([self.seed, 104729, 2, no])
                for i in self.pick(kind, rng, self.taken):
                    p = self._params(kind, rng)
                    out.append(ClockModel(i, kind, self.start - RUN_LEAD_NS, FOREVER, p))
        return out

    def window(self, w: int) -> list[ClockModel]:
        """The models of planning window ``w``, each kind on a node of its own while
        there are free nodes (:meth:`pick`)."""
        out: list[ClockModel] = []
        taken = set(self.taken)
        for no, (kind, plan) in enumerate(self.per_window):
            if self.spec.on(kind):
                rng = np.random.default_rng([self.seed, 104729, 3, w, no])
                prefer = self.idle if kind is K.VM_PAUSE else None
                for i in self.pick(kind, rng, taken, prefer):
                    out += plan(kind, rng, i, self.when(kind, rng, w), int(self.phase[i]))
        return out

    def pick(
        self, kind: FaultKind, rng: np.random.Generator, taken: set[int],
        prefer: np.ndarray | None = None,
    ) -> list[int]:  # fmt: skip
        """The nodes of one ``kind``: ``node``, else ``fraction`` of them (one by default)
        among those no other model nor the clock fault holds (any, when none is left),
        those ``prefer`` marks first; they join ``taken``."""
        v = self.spec.param(kind, "node")
        n = len(self.names)
        if v is not None:
            i = self.names.index(v) if v in self.names else int(v)
            if not 0 <= i < n:
                raise ConfigError(f"--faults: {kind}: no node {v!r}")
            return [i]
        count = max(1, round(self.spec.fparam(kind, "fraction", 0.0) * n))
        free = [i for i in range(n) if i not in taken]
        pool = [i for i in free if prefer is None or prefer[i]] or free or list(range(n))
        chosen = sorted(int(x) for x in rng.choice(pool, min(count, len(pool)), replace=False))
        taken.update(chosen)
        return chosen

    def when(self, kind: FaultKind, rng: np.random.Generator, w: int) -> int:
        st = self.spec.param(kind, "start")
        if st is not None and w == 0:
            return self.start + int(self.spec.fparam(kind, "start", 0.0) * S)
        return self.start + w * self.window_ns + int(rng.uniform(0.1, 0.5) * self.window_ns)

    def num(self, kind: FaultKind, name: str, default: float, positive: bool = True) -> float:
        v = self.spec.fparam(kind, name, default)
        if positive and not v > 0:
            raise ConfigError(f"--faults: {kind}:{name}={v} must be positive")
        return v

    def _params(self, kind: FaultKind, rng: np.random.Generator) -> dict[str, float]:
        if kind is K.PTP:
            return {
                "offset_ns": self.num(kind, "offset", float(rng.uniform(-200, 200)), False),
                "wander_ns": self.num(kind, "wander", 300.0, False),
                "p1_s": float(rng.uniform(10, 30)),
                "p2_s": float(rng.uniform(1, 4)),
                "phi1": float(rng.uniform(0, 2 * math.pi)),
                "phi2": float(rng.uniform(0, 2 * math.pi)),
            }
        return {"ppm": self.num(kind, "ppm", -1e6 / 86_400, False)}

    def _slew(
        self, kind: FaultKind, rng: np.random.Generator, i: int, at: int, _phase: int
    ) -> list[ClockModel]:
        chrony = kind is K.CHRONY_SLEW
        lo, hi = (0.05, 0.5) if chrony else (0.01, 0.1)
        x = self.num(kind, "offset", float(rng.uniform(lo, hi) * rng.choice([-1, 1])), False)
        if chrony:
            cap = self.num(kind, "maxslewrate", CHRONY_MAX_PPM)
            corr = self.num(kind, "correction", CHRONY_CORRECTION)
            p = {"offset_s": x, "maxslewrate_ppm": cap, "correction_s2": corr}
            took = chrony_duration(abs(x), cap * 1e-6, corr)
        else:
            rate = self.num(kind, "rate", 500.0)
            p = {"offset_s": x, "rate_ppm": rate}
            took = abs(x) / (rate * 1e-6)
        return [ClockModel(i, kind, at, at + int(took * S), p)]

    def _steps(
        self, kind: FaultKind, rng: np.random.Generator, i: int, at: int, phase: int
    ) -> list[ClockModel]:
        """Steps on the node's ticks (its phase): one each ``every`` s, then the pair 0.2 and
        0.2 + ``gap`` ticks in (between its sends, which follow each tick's last sample)."""
        tick = self.start + (at - self.start) // self.iv * self.iv + int(phase)
        sizes = self.sizes(kind, "sizes", "30|-120|5000")
        pair = self.sizes(kind, "pair", "1588|-1548")
        every = int(self.num(kind, "every", 2.0) * S)
        gap = int(self.num(kind, "gap", 0.3) * S)
        times = [tick + n * every + self.iv // 4 for n in range(len(sizes))]
        first = tick + len(sizes) * every + self.iv // 5
        times += [first + n * gap for n in range(len(pair))]
        return [
            ClockModel(i, kind, t, t, {"size_ns": float(round(us * 1_000))})
            for t, us in zip(times, sizes + pair, strict=True)
        ]

    def sizes(self, kind: FaultKind, name: str, default: str) -> list[float]:
        text = self.spec.param(kind, name) or default
        try:
            return [float(x) for x in text.split("|") if x.strip()]
        except ValueError as e:
            raise ConfigError(f"--faults: {kind}:{name}={text!r}: µs values, |-separated") from e

    def _pause(
        self, kind: FaultKind, rng: np.random.Generator, i: int, at: int, _phase: int
    ) -> list[ClockModel]:
        pause = self.num(kind, "pause", float(rng.uniform(0.5, 2.0)))
        delay = self.num(kind, "delay", 1.0, False)
        cap = self.num(kind, "maxslewrate", CHRONY_MAX_PPM)
        corr = self.num(kind, "correction", CHRONY_CORRECTION)
        step = pause > 1.0  # chrony's makestep 1.0: a step past a second, else a slew
        took = 0.0 if step else chrony_duration(pause, cap * 1e-6, corr)
        p = {
            "pause_ns": float(round(pause * S)),
            "delay_ns": float(round(delay * S)),
            "step": float(step),
            "maxslewrate_ppm": cap,
            "correction_s2": corr,
        }
        return [ClockModel(i, kind, at, at + int((pause + delay + took) * S), p)]

    def _fast(
        self, kind: FaultKind, rng: np.random.Generator, i: int, at: int, _phase: int
    ) -> list[ClockModel]:
        ppm = self.num(kind, "ppm", float(1000.0 * rng.choice([-1, 1])), False)
        dur = int(self.num(kind, "dur", 60.0) * S)
        return [ClockModel(i, kind, at, at + dur, {"ppm": ppm, "dur_ns": float(dur)})]
