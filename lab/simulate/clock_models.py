"""Clock models: how real clock discipline moves a node's wall clock (used by :mod:`.clocks`).

Each :class:`ClockModel` is a fault kind of its own (parameters in :mod:`.faults`), on one node
by default (a synced one no other model holds); ``x`` is the offset a daemon has left to
correct (s):

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

A model is zero before its start; its effect stops changing at its end. :class:`ModelPlan`
places them, :class:`ModelTrack` evaluates one node's at any true time, and
:func:`truth_offsets` rebuilds a node's clocks from its row of the clocks truth.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from lab.simulate.faults import FaultKind, FaultSpec, S
from schemas.errors import ConfigError

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


class ModelTrack:
    """One node's clock models and the ``clock`` fault's steps (``(at_ns, step_ns)``), indexed
    for any true time: the finite models by start (the longest lasts ``longest``), those held
    for the run (``forever``), and the effect of the finite ones once done (after their end
    and a second: :meth:`ClockModel.adj` no longer changes), summed in order of that instant."""

    def __init__(
        self, models: list[ClockModel], drift_ppm: float, steps: Sequence[tuple[int, int]] = ()
    ) -> None:
        mine = sorted(models, key=lambda m: m.start_ns)
        self.drift_ppm = drift_ppm
        self.finite = [m for m in mine if m.end_ns < FOREVER]
        self.forever = [m for m in mine if m.end_ns >= FOREVER]
        self.longest = max((m.end_ns + S - m.start_ns for m in self.finite), default=0)
        by_end = sorted(self.finite, key=lambda m: m.end_ns)
        done = [(0, 0)] + [_final(m, drift_ppm) for m in by_end]
        self.done_at = np.asarray([m.end_ns + S for m in by_end], np.int64)  # ascending
        self.done = np.cumsum(np.asarray(done, np.int64), axis=0)  # (F + 1, 2): lost, adj
        ordered = sorted(steps)
        self.step_at = np.asarray([a for a, _ in ordered], np.int64)
        self.step_cum = np.cumsum([0] + [z for _, z in ordered], dtype=np.int64)

    def offsets(self, t: np.ndarray, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The node's (wall, raw) offsets at ``t`` (1-D, int64, not empty) from ``raw``, its
        oscillator's."""
        adj = np.zeros(t.shape, np.int64)
        if self.finite or self.forever:
            lo, hi, d = int(t.min()), int(t.max()), self.drift_ppm
            done = self.done[np.searchsorted(self.done_at, t, side="left")]
            a = bisect_left(self.finite, lo - self.longest, key=lambda m: m.start_ns)
            b = bisect_right(self.finite, hi, key=lambda m: m.start_ns)
            live = [m for m in self.finite[a:b] if m.end_ns + S >= lo] + self.forever
            lost = done[:, 0].copy()
            for m in live:  # the done ones are in ``done``, the others from their start
                on = t <= m.end_ns + S
                lost += np.where(on, np.rint(m.lost(t - m.start_ns, d)).astype(np.int64), 0)
            osc, raw = raw, raw - lost
            adj += done[:, 1]
            for m in live:
                on = t <= m.end_ns + S
                adj += np.where(on, np.rint(m.adj(t - m.start_ns, d, osc)).astype(np.int64), 0)
        if len(self.step_at):
            adj += self.step_cum[np.searchsorted(self.step_at, t, side="right")]
        return raw + adj, raw


def _final(m: ClockModel, drift_ppm: float) -> tuple[int, int]:
    """(lost, adj) of finite model ``m`` once done: a second after its end."""
    el = np.asarray([m.end_ns + S - m.start_ns], np.int64)
    lost = int(np.rint(m.lost(el, drift_ppm))[0])
    return lost, int(np.rint(m.adj(el, drift_ppm, np.zeros(1)))[0])


def truth_offsets(
    row: Mapping[str, Any], true_ns: np.ndarray, start_ns: int, raw: bool = False
) -> np.ndarray:
    """The wall (``raw``: raw) clock error of the node of clocks truth ``row`` at each of
    ``true_ns`` (flattened), rebuilt as :class:`lab.simulate.clocks.NodeClocks` computes it;
    ``start_ns`` the run's start (the drift's origin). A row without ``models`` (an older
    truth) has none."""
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
    drift = float(row["drift_ppm"])
    t = np.asarray(true_ns, np.int64).reshape(-1)
    osc = np.int64(int(row["offset_ns"])) + (drift * 1e-6 * (t - start_ns)).astype(np.int64)
    if not len(t):
        return osc
    wall, raw_off = ModelTrack(models, drift, steps).offsets(t, osc)
    return raw_off if raw else wall


class ModelPlan:
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
