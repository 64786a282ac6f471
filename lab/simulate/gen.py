"""Vectorized value generators for the three exporters: node (cpu, mem), gpu, nic.

Each generator keeps the state of every node in numpy arrays and advances all of them at once:
``step(fx) -> (value, raw)`` of shape ``(N, S, E)`` for the tick described by ``fx`` (the only
Python loop is over the few substeps of a tick). Values stay within catalog units and ranges:

- gpu (H100 SXM-like): sm_clock 1980 MHz at load, 345 idle; mem_clock 2619; temp 60-75 °C at
  load, ~35 idle, ~90 when thermally throttled; power ~610 W at load (700 W cap), ~72 W idle;
  energy in mJ (64-bit); util 0-100 %; fb_used MiB of 81559; clock_event_reasons bitmask.
- nic (ConnectX-7, NDR 400 Gb/s = 12.5e9 four-byte words/s): data counters at 55-85 % of line
  rate for busy nodes (RDMA counters on ``mlx5_k/1``; PFC counters named as ``ethtool -S``
  names them, on interface ``eth<k>``: ``eth<k>/prio3``); PFC pauses, pause duration (µs),
  ECN marks, CNPs and XmitWait rise on a stormed NIC; a NIC whose link is down stalls.
  rdma.out_of_sequence wraps at 2^32, ib.port_xmit_wait saturates at 2^32 - 1.
- node: /proc/stat ticks (USER_HZ = 100) per CPU, mem.available_bytes of 2 TiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.simulate.layout import Layout

LINE_WORDS_PER_S = 400e9 / 8 / 4
U32 = (1 << 32) - 1
FB_TOTAL_MIB = 81_559
MEM_TOTAL = 2 * 1024**4

GPU_METRICS = (
    ("gpu.sm_clock", False),
    ("gpu.mem_clock", False),
    ("gpu.temp", False),
    ("gpu.power", False),
    ("gpu.energy", True),
    ("gpu.util", False),
    ("gpu.fb_used", False),
    ("gpu.clock_event_reasons", False),
    ("gpu.pcie_replay", True),
)
NIC_PORT_METRICS = (
    "ib.port_rcv_data",
    "ib.port_xmit_data",
    "ib.port_xmit_wait",
    "rdma.np_cnp_sent",
    "rdma.rp_cnp_handled",
    "rdma.np_ecn_marked_roce_packets",
    "rdma.out_of_sequence",
)
NIC_PRIO_METRICS = ("nic.rx_prio_pause", "nic.rx_prio_pause_duration", "nic.tx_prio_pause")
CPU_METRICS = ("cpu.user_seconds", "cpu.system_seconds", "cpu.idle_seconds")


@dataclass
class Effects:
    """What the faults and jobs do during one tick; masks are per substep where it matters."""

    dt_s: float  # seconds per substep
    busy_node: np.ndarray  # (N,) bool
    storm: np.ndarray  # (S, N, K) float 0..1
    link_down: np.ndarray  # (S, N, K) bool
    throttle: np.ndarray  # (S, N, G) int bitmask added by throttling


def netdev_of(nic: int) -> str:
    """The network interface of NIC ``mlx5_<nic>`` (a ``netdev`` topology fact links them)."""
    return f"eth{nic}"


def gpu_layout(gpus: int, substeps: int) -> Layout:
    ent = [(f"gpu{g}", m, c) for g in range(gpus) for m, c in GPU_METRICS]
    return Layout(*_unzip(ent), substeps=substeps)


def nic_layout(nics: int, substeps: int) -> Layout:
    ent = [(f"mlx5_{k}/1", m, True) for k in range(nics) for m in NIC_PORT_METRICS]
    # ethtool -S names per-priority rows by interface: eth<k> is mlx5_<k>'s netdev
    ent += [(f"{netdev_of(k)}/prio3", m, True) for k in range(nics) for m in NIC_PRIO_METRICS]
    return Layout(*_unzip(ent), substeps=substeps)


def node_layout(cpus: int) -> Layout:
    ent = [(f"cpu{c}", m, True) for c in range(cpus) for m in CPU_METRICS]
    ent.append(("mem", "mem.available_bytes", False))
    return Layout(*_unzip(ent), substeps=1)


def _unzip(
    ent: list[tuple[str, str, bool]],
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[bool, ...]]:
    return tuple(e[0] for e in ent), tuple(e[1] for e in ent), tuple(e[2] for e in ent)


def _uptime_s(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(3600.0, 30 * 86400.0, n)


class GpuGen:
    """GPU exporter values; state: temperature, energy and PCIe replay counters."""

    def __init__(self, n: int, gpus: int, busy_gpu: np.ndarray, rng: np.random.Generator) -> None:
        self.n, self.g, self.rng, self.busy = n, gpus, rng, busy_gpu
        self.bias = rng.normal(0.0, 3.0, (n, gpus))
        self.temp = np.where(busy_gpu, 66.0, 34.0) + self.bias
        self.energy = np.zeros((n, gpus), np.uint64)
        self.pcie = np.zeros((n, gpus), np.uint64)
        self.reset(np.ones(n, bool), _uptime_s(rng, n))

    def reset(self, nodes: np.ndarray, uptime_s: np.ndarray) -> None:
        """Counters of ``nodes`` restart as if the node had been up ``uptime_s`` seconds."""
        avg_w = np.where(self.busy, 500.0, 72.0)
        e = (avg_w * uptime_s[:, None] * 1000.0).astype(np.uint64)
        self.energy[nodes] = e[nodes]
        self.pcie[nodes] = self.rng.poisson(uptime_s[:, None] / 86400.0, (self.n, self.g))[nodes]

    def step(self, fx: Effects, substeps: int) -> tuple[np.ndarray, np.ndarray]:
        n, g, r, busy = self.n, self.g, self.rng, self.busy
        val = np.empty((n, substeps, g, len(GPU_METRICS)))
        raw = np.zeros((n, substeps, g, len(GPU_METRICS)), np.uint64)
        alpha, fast = 1.0 - np.exp(-fx.dt_s / 20.0), 1.0 - np.exp(-fx.dt_s / 2.0)
        for s in range(substeps):
            th = fx.throttle[s]
            thermal, power_cap = (th & 0x60) != 0, (th & 0x84) != 0
            util = np.where(
                busy, np.clip(r.normal(96.0, 2.5, (n, g)), 0, 100), r.integers(0, 2, (n, g))
            )
            target = np.where(busy, 66.0 + self.bias, 34.0 + self.bias / 2)
            target = np.where(thermal, 91.0, target)
            # a thermal incident is a cooling fault: the die heats within seconds
            rate = np.where(thermal, fast, alpha)
            self.temp += (target - self.temp) * rate + r.normal(0.0, 0.3, (n, g))
            power = np.where(
                busy, np.clip(r.normal(610.0, 35.0, (n, g)), 300, 700), r.normal(72.0, 3.0, (n, g))
            )
            power = np.where(power_cap, np.clip(r.normal(698.0, 2.0, (n, g)), 690, 700), power)
            steps15 = r.integers(0, 3, (n, g)) * 15.0
            sm = np.where(busy, 1980.0 - steps15, 345.0)
            sm = np.where(thermal, 1410.0 + 15.0 * r.integers(0, 8, (n, g)), sm)
            sm = np.where(power_cap & ~thermal, 1005.0 + 15.0 * r.integers(0, 20, (n, g)), sm)
            reasons = np.where(busy, 0, 0x1) | th
            self.energy += (power * fx.dt_s * 1000.0).astype(np.uint64)
            self.pcie += (r.random((n, g)) < 1e-4).astype(np.uint64)
            fb = np.where(
                busy, 71_000.0 + r.integers(0, 400, (n, g)), r.integers(0, 4, (n, g)) * 1.0
            )
            val[:, s] = np.stack(
                [
                    sm,
                    np.full((n, g), 2619.0),
                    np.round(self.temp),
                    np.round(power, 3),
                    self.energy.astype(np.float64),
                    np.round(util),
                    fb,
                    reasons.astype(np.float64),
                    self.pcie.astype(np.float64),
                ],
                axis=-1,
            )
            raw[:, s, :, 4] = self.energy
            raw[:, s, :, 8] = self.pcie
        return val.reshape(n, substeps, -1), raw.reshape(n, substeps, -1)


class NicGen:
    """NIC exporter values: 7 port counters on mlx5_k/1, 3 PFC counters on eth<k>/prio3."""

    def __init__(self, n: int, nics: int, busy_node: np.ndarray, rng: np.random.Generator) -> None:
        self.n, self.k, self.rng = n, nics, rng
        self.busy = np.repeat(busy_node[:, None], nics, axis=1)
        self.load = np.where(self.busy, rng.uniform(0.55, 0.85, (n, nics)), 0.001)
        self.port = np.zeros((n, nics, len(NIC_PORT_METRICS)), np.uint64)
        self.prio = np.zeros((n, nics, len(NIC_PRIO_METRICS)), np.uint64)
        self.oos_rate = np.where(self.busy, 3.0, 0.0)
        self.reset(np.ones(n, bool), _uptime_s(rng, n))

    def reset(self, nodes: np.ndarray, uptime_s: np.ndarray) -> None:
        u = uptime_s[:, None]
        words = self.load * 0.5 * LINE_WORDS_PER_S * u
        base = np.stack(
            [
                words,
                words * 1.01,
                np.minimum(u * 2e5 * self.busy, U32),
                u * 5 * self.busy,
                u * 4 * self.busy,
                u * 5 * self.busy,
                u * self.oos_rate,
            ],
            axis=-1,
        )
        self.port[nodes] = base.astype(np.uint64)[nodes]
        prio = (u[..., None] * np.array([0.01, 0.1, 0.01])) * np.ones((1, self.k, 1))
        self.prio[nodes] = prio.astype(np.uint64)[nodes]

    def start_wrap(self, node: int, nic: int, seconds_to_wrap: float) -> None:
        """Make rdma.out_of_sequence of one NIC reach 2^32 after about ``seconds_to_wrap``."""
        self.oos_rate[node, nic] = 100.0
        self.port[node, nic, 6] = np.uint64(max(0, int(U32 + 1 - 100.0 * seconds_to_wrap)))

    def step(self, fx: Effects, substeps: int) -> tuple[np.ndarray, np.ndarray]:
        n, k, r, dt = self.n, self.k, self.rng, fx.dt_s
        np_, nq = len(NIC_PORT_METRICS), len(NIC_PRIO_METRICS)
        raw = np.empty((n, substeps, k * (np_ + nq)), np.uint64)
        self.load = np.clip(self.load + r.normal(0, 0.02, (n, k)) * self.busy, 0.001, 0.95)
        for s in range(substeps):
            st = fx.storm[s]
            up = ~fx.link_down[s]
            thr = self.load * (1.0 - 0.85 * st) * LINE_WORDS_PER_S * dt * up
            inc = (
                np.stack(
                    [
                        thr * r.uniform(0.97, 1.03, (n, k)),
                        thr * r.uniform(0.97, 1.03, (n, k)),
                        (2e5 * self.busy + 2.0e8 * st) * dt * r.uniform(0.8, 1.2, (n, k)),
                        r.poisson(20 * dt * self.busy + 3.8e4 * dt * st),
                        r.poisson(15 * dt * self.busy + 3.0e4 * dt * st),
                        r.poisson(22 * dt * self.busy + 4.0e4 * dt * st),
                        r.poisson(self.oos_rate * dt),
                    ],
                    axis=-1,
                )
                * up[..., None]
            )
            self.port += inc.astype(np.uint64)
            self.port[..., 2] = np.minimum(self.port[..., 2], U32)  # PortXmitWait saturates
            self.port[..., 6] &= np.uint64(U32)  # out_of_sequence wraps
            pinc = (
                np.stack(
                    [
                        r.poisson(0.01 * dt + 1.2e5 * dt * st),
                        st * r.uniform(0.75, 0.95, (n, k)) * 1e6 * dt,
                        r.poisson(0.01 * dt * self.busy, (n, k)),
                    ],
                    axis=-1,
                )
                * up[..., None]
            )
            self.prio += pinc.astype(np.uint64)
            raw[:, s, : k * np_] = self.port.reshape(n, -1)
            raw[:, s, k * np_ :] = self.prio.reshape(n, -1)
        return raw.astype(np.float64), raw


class NodeGen:
    """Node exporter values: per-CPU user/system/idle ticks and available memory."""

    def __init__(self, n: int, cpus: int, busy_node: np.ndarray, rng: np.random.Generator) -> None:
        self.n, self.c, self.rng, self.busy = n, cpus, rng, busy_node
        self.ticks = np.zeros((n, cpus, 3), np.uint64)
        self.reset(np.ones(n, bool), _uptime_s(rng, n))

    def reset(self, nodes: np.ndarray, uptime_s: np.ndarray) -> None:
        frac = np.where(self.busy[:, None], [0.25, 0.04, 0.71], [0.01, 0.005, 0.985])
        t = (uptime_s[:, None, None] * 100.0 * frac[:, None, :]) * np.ones((1, self.c, 1))
        self.ticks[nodes] = t.astype(np.uint64)[nodes]

    def step(self, fx: Effects) -> tuple[np.ndarray, np.ndarray]:
        n, c, r = self.n, self.c, self.rng
        total = round(100 * fx.dt_s)
        pu = np.where(fx.busy_node, 0.25, 0.01)[:, None] * np.ones((1, c))
        user = r.binomial(total, np.clip(pu + r.normal(0, 0.03, (n, c)), 0, 0.9))
        system = r.binomial(total - user, np.where(fx.busy_node, 0.05, 0.005)[:, None])
        idle = total - user - system
        self.ticks += np.stack([user, system, idle], axis=-1).astype(np.uint64)
        avail = np.where(fx.busy_node, 1.25 * 1024**4, 1.9 * 1024**4) + r.normal(0, 2e9, n)
        raw = np.zeros((n, 1, c * 3 + 1), np.uint64)
        raw[:, 0, :-1] = self.ticks.reshape(n, -1)
        val = raw.astype(np.float64)
        val[:, 0, -1] = np.clip(avail, 0, MEM_TOTAL).round()
        return val, raw
