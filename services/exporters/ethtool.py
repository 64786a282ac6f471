"""``ethtool -S IFACE`` text → SAMPLES_SCHEMA rows (PFC per priority, pause, discards, ECN/CNP).

Names (mlx5 kernel doc, ``counters.rst``) and the metrics they become:

- per priority ``{rx,tx}_prio<p>_<kind>`` → ``nic.{rx,tx}_prio_<kind>`` with device
  ``<iface>/prio<p>``; kinds: bytes, packets, pause, pause_duration (µs), pause_transition,
  discards, buf_discard (rx only where the driver has it);
- globals ``rx_pause_ctrl_phy`` … ``rx_out_of_buffer`` → ``nic.<name>``, device ``<iface>``;
- RoCE congestion ``np_cnp_sent``, ``rp_cnp_handled``, ``np_ecn_marked_roce_packets`` →
  ``rdma.<name>`` where a driver exposes them through ethtool;
- any other counter → ``nic.<sanitised name>`` only if that name is in the catalog passed in;
  otherwise it is skipped and counted (:attr:`EthtoolStats.skipped`). Nothing is invented.

Every row is a counter: ``raw`` is the exact uint64, ``value`` the same as float. Traps handled
(node_exporter fixtures): names with dots or spaces are sanitised (``port.rx_dropped`` →
``port_rx_dropped``); two names that sanitise to one (``duplicate metric`` / ``duplicate_metric``)
keep the first and count a collision; stray lines (``netlink error: …``) and comment lines are
ignored; an output that is only ``ERROR: <errno>`` is a failed stats call and raises
:class:`EthtoolError`.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import pyarrow as pa

from schemas.errors import RefineryError
from schemas.wire import SAMPLES_SCHEMA

PRIO_KINDS: dict[str, frozenset[str]] = {
    "rx": frozenset(
        {
            "bytes",
            "packets",
            "pause",
            "pause_duration",
            "pause_transition",
            "discards",
            "buf_discard",
        }
    ),
    "tx": frozenset({"bytes", "packets", "pause", "pause_duration"}),
}
GLOBALS = frozenset(
    {
        "rx_pause_ctrl_phy",
        "tx_pause_ctrl_phy",
        "rx_discards_phy",
        "tx_discards_phy",
        "rx_bytes_phy",
        "tx_bytes_phy",
        "tx_pause_storm_warning_events",
        "tx_pause_storm_error_events",
        "rx_out_of_buffer",
    }
)
ROCE_CONGESTION = frozenset({"np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets"})

_PRIO_RE = re.compile(r"^(rx|tx)_prio(\d+)_([a-z_]+)$")
_LINE_RE = re.compile(r"^\s+([^:]+?):\s+(-?\d+)\s*$")
_ERROR_RE = re.compile(r"^\s*ERROR:\s*(\d+)\s*$")
MAX_U64 = (1 << 64) - 1


class EthtoolError(RefineryError):
    """``ethtool -S`` failed for an interface (no driver stats, permission, no such device)."""


def sanitize(name: str) -> str:
    """Lower-case, and every run of characters outside ``[a-z0-9_]`` becomes ``_``."""
    return re.sub(r"[^a-z0-9_]+", "_", name.strip().lower()).strip("_")


def metric_for(name: str, iface: str, catalog: Container[str]) -> tuple[str, str] | None:
    """(metric, device) for one ethtool counter name, or None when it is not exported."""
    m = _PRIO_RE.match(name)
    if m and m.group(3) in PRIO_KINDS[m.group(1)]:
        return f"nic.{m.group(1)}_prio_{m.group(3)}", f"{iface}/prio{m.group(2)}"
    if name in GLOBALS:
        return f"nic.{name}", iface
    if name in ROCE_CONGESTION:
        return f"rdma.{name}", iface
    metric = f"nic.{name}"
    return (metric, iface) if metric in catalog else None


@dataclass
class EthtoolStats:
    """Parsed counters of one interface."""

    table: pa.Table
    skipped: list[str] = field(default_factory=list)  # not exported (not in the catalog)
    collisions: list[str] = field(default_factory=list)  # original names that collided
    bad_values: list[str] = field(default_factory=list)  # negative or over 64 bits


def parse_ethtool_stats(
    text: str, iface: str, ts_ns: int, catalog: Container[str] = frozenset()
) -> EthtoolStats:
    """Parse ``ethtool -S`` output. Raises EthtoolError if the output is an error report."""
    body = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(body) == 1 and (m := _ERROR_RE.match(body[0])):
        code = int(m.group(1))
        label = errno.errorcode.get(code, "?")
        raise EthtoolError(f"ethtool -S {iface} failed: errno {code} ({label})")
    seen: dict[str, str] = {}
    out = EthtoolStats(pa.table({n: [] for n in SAMPLES_SCHEMA.names}, schema=SAMPLES_SCHEMA))
    metrics: list[str] = []
    devices: list[str] = []
    raws: list[int] = []
    for line in body:
        m = _LINE_RE.match(line)
        if m is None:
            continue  # "NIC statistics:", "netlink error: …", anything that is not a counter
        original, value = m.group(1), int(m.group(2))
        name = sanitize(original)
        if name in seen:
            out.collisions.append(original)
            continue
        seen[name] = original
        if value < 0 or value > MAX_U64:
            out.bad_values.append(original)
            continue
        target = metric_for(name, iface, catalog)
        if target is None:
            out.skipped.append(name)
            continue
        metrics.append(target[0])
        devices.append(target[1])
        raws.append(value)
    n = len(raws)
    out.table = pa.table(
        {
            "ts_ns": pa.array([ts_ns] * n, pa.int64()),
            "metric": pa.array(metrics, pa.string()),
            "device": pa.array(devices, pa.string()),
            "value": pa.array([float(r) for r in raws], pa.float64()),
            "raw": pa.array(raws, pa.uint64()),
            "text": pa.array([None] * n, pa.string()),
        },
        schema=SAMPLES_SCHEMA,
    )
    return out


def run_ethtool(iface: str, timeout: float = 5.0) -> str:
    """Run ``ethtool -S iface`` and return its stdout. Raises EthtoolError on failure."""
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,64}", iface):
        raise EthtoolError(f"not an interface name: {iface!r}")
    try:
        proc = subprocess.run(
            ["ethtool", "-S", iface],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except FileNotFoundError as e:
        raise EthtoolError("ethtool is not installed") from e
    except subprocess.TimeoutExpired as e:
        raise EthtoolError(f"ethtool -S {iface} timed out after {timeout:g}s") from e
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise EthtoolError(f"ethtool -S {iface}: {msg[-1] if msg else proc.returncode}")
    return proc.stdout


class EthtoolSource:
    """A firmware source reading one interface; ``read`` is the seam (default: run ethtool)."""

    def __init__(
        self,
        iface: str,
        catalog: Container[str] = frozenset(),
        read: Callable[[str], str] = run_ethtool,
    ) -> None:
        self.iface = iface
        self.name = f"ethtool:{iface}"
        self._catalog = catalog
        self._read = read
        self.last: EthtoolStats | None = None

    def collect(self, now_ns: int) -> EthtoolStats:
        self.last = parse_ethtool_stats(self._read(self.iface), self.iface, now_ns, self._catalog)
        return self.last
