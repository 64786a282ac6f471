"""sysfs readers for the node exporter: InfiniBand/RoCE counters, net statistics, PCIe AER and
link state, thermal zones, hwmon, NVMe controller state and RAPL energy.

Walking sysfs is the expensive part, so it is done once: :func:`discover` lists every file worth
reading into a :class:`SysfsPlan` (two tiers: ``fast`` read every scrape, ``slow`` every few),
and :func:`read_entries` only opens and parses those files. Only metrics present in the catalog
are planned, so every row produced resolves in it.

IB/RDMA naming: ``ports/P/counters/F`` and ``counters_ext/F`` → ``ib.<f lowercased>``,
``hw_counters/F`` → ``rdma.<f>``, device ``"<hca>/<port>"``. Counter files are parsed exactly
into ``raw`` (uint64) with ``value = float(raw)``; anything non-numeric (``N/A (no PMA)``) goes
to ``text`` with NULL value. Files without a trailing newline and negative readings are fine.
Nothing here raises for any file content; a vanished file adds nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

from schemas.catalog import Catalog, Kind
from services.exporters.procfs import SampleBuffer, read_bytes


class Mode(IntEnum):
    """How a planned file's content is parsed."""

    COUNTER = 0  # an integer counter → raw + value; else text
    GAUGE = 1  # an integer or float → value; else text
    PREFIX_NUMBER = 2  # "4: ACTIVE" → 4
    LEADING_NUMBER = 3  # "400 Gb/sec (4X NDR)" → 400, "16.0 GT/s PCIe" → 16.0
    AER = 4  # "RxErr 0\nBadTLP 0\n...TOTAL_ERR_COR 0" → one counter per line
    NVME_STATE = 5  # "live" → enum code
    OPERSTATE = 6  # "up" → enum code


@dataclass(frozen=True, slots=True)
class Entry:
    path: str
    metric: str
    device: str
    mode: Mode


@dataclass(slots=True)
class SysfsPlan:
    """What to read: ``fast`` every scrape, ``slow`` every ``slow_every`` scrapes."""

    fast: list[Entry] = field(default_factory=list)
    slow: list[Entry] = field(default_factory=list)


_NVME_STATES = {
    b"new": 1,
    b"live": 2,
    b"resetting": 3,
    b"connecting": 4,
    b"deleting": 5,
    b"deleting (no IO)": 6,
    b"dead": 7,
}
_OPERSTATES = {
    b"unknown": 0,
    b"notpresent": 1,
    b"down": 2,
    b"lowerlayerdown": 3,
    b"testing": 4,
    b"dormant": 5,
    b"up": 6,
}
_AER_METRIC = {
    "aer_dev_correctable": "pcie.aer_correctable",
    "aer_dev_nonfatal": "pcie.aer_nonfatal",
    "aer_dev_fatal": "pcie.aer_fatal",
}
_HWMON_INPUTS = {
    "temp": "hwmon.temp",
    "fan": "hwmon.fan_speed",
    "in": "hwmon.voltage",
    "curr": "hwmon.current",
    "power": "hwmon.power",
    "energy": "hwmon.energy",
    "freq": "hwmon.freq",
    "humidity": "hwmon.humidity",
}
_NET_EXTRA = (
    "rx_crc_errors",
    "rx_length_errors",
    "rx_missed_errors",
    "rx_over_errors",
    "rx_nohandler",
    "tx_aborted_errors",
    "tx_heartbeat_errors",
    "tx_window_errors",
)


def _ls(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _isdir(path: str) -> bool:
    return os.path.isdir(path)


class _Planner:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.plan = SysfsPlan()

    def add(
        self, path: str, metric: str, device: str, mode: Mode | None = None, *, slow: bool = False
    ) -> None:
        if metric not in self.catalog:
            return
        if mode is None:
            mode = Mode.COUNTER if self.catalog[metric].kind is Kind.COUNTER else Mode.GAUGE
        (self.plan.slow if slow else self.plan.fast).append(Entry(path, metric, device, mode))


def _plan_infiniband(p: _Planner, root: str) -> None:
    base = f"{root}/class/infiniband"
    for hca in _ls(base):
        for port in _ls(f"{base}/{hca}/ports"):
            pdir = f"{base}/{hca}/ports/{port}"
            dev = f"{hca}/{port}"
            for group, prefix in (
                ("counters", "ib."),
                ("counters_ext", "ib."),
                ("hw_counters", "rdma."),
            ):
                for name in _ls(f"{pdir}/{group}"):
                    p.add(f"{pdir}/{group}/{name}", prefix + name.lower(), dev)
            p.add(f"{pdir}/state", "ib.port_state", dev, Mode.PREFIX_NUMBER)
            p.add(f"{pdir}/phys_state", "ib.phys_state", dev, Mode.PREFIX_NUMBER)
            p.add(f"{pdir}/rate", "ib.rate", dev, Mode.LEADING_NUMBER, slow=True)


def _plan_net(p: _Planner, root: str) -> None:
    base = f"{root}/class/net"
    for iface in _ls(base):
        d = f"{base}/{iface}"
        if not _isdir(d):
            continue  # bonding_masters is a file
        for name in _NET_EXTRA:
            if os.path.exists(f"{d}/statistics/{name}"):
                p.add(f"{d}/statistics/{name}", f"net.{name}", iface, slow=True)
        for name, metric in (
            ("carrier_changes", "net.carrier_changes"),
            ("speed", "net.speed"),
            ("mtu", "net.mtu"),
        ):
            if os.path.exists(f"{d}/{name}"):
                p.add(f"{d}/{name}", metric, iface, slow=True)
        if os.path.exists(f"{d}/operstate"):
            p.add(f"{d}/operstate", "net.oper_state", iface, Mode.OPERSTATE, slow=True)


def _plan_pci(p: _Planner, root: str) -> None:
    base = f"{root}/bus/pci/devices"
    for addr in _ls(base):
        d = f"{base}/{addr}"
        aer = [f for f in _AER_METRIC if os.path.exists(f"{d}/{f}")]
        if not aer:
            continue
        for f in aer:
            p.add(f"{d}/{f}", _AER_METRIC[f], addr, Mode.AER, slow=True)
        for name, mode in (
            ("current_link_speed", Mode.LEADING_NUMBER),
            ("current_link_width", Mode.GAUGE),
            ("max_link_speed", Mode.LEADING_NUMBER),
            ("max_link_width", Mode.GAUGE),
        ):
            if os.path.exists(f"{d}/{name}"):
                metric = "pcie." + name.removeprefix("current_")
                p.add(f"{d}/{name}", metric, addr, mode, slow=True)


def _plan_thermal(p: _Planner, root: str) -> None:
    base = f"{root}/class/thermal"
    for name in _ls(base):
        d = f"{base}/{name}"
        if name.startswith("thermal_zone"):
            p.add(f"{d}/temp", "thermal.zone_temp", name)
        elif name.startswith("cooling_device"):
            p.add(f"{d}/cur_state", "thermal.cooling_state", name, slow=True)
            p.add(f"{d}/max_state", "thermal.cooling_max_state", name, slow=True)


def _plan_hwmon(p: _Planner, root: str) -> None:
    base = f"{root}/class/hwmon"
    for hw in _ls(base):
        d = f"{base}/{hw}"
        files = [f for f in _ls(d) if "_" in f]
        if not any(f.endswith("_input") for f in files):
            d = f"{d}/device"  # old drivers keep the attributes one level down
            files = [f for f in _ls(d) if "_" in f]
        for f in files:
            sensor, _, attr = f.partition("_")
            kind = sensor.rstrip("0123456789")
            if kind == sensor:
                continue  # no index: not a sensor attribute
            if attr == "input" and kind in _HWMON_INPUTS:
                p.add(f"{d}/{f}", _HWMON_INPUTS[kind], f"{hw}/{sensor}")
            elif kind == "temp" and attr in ("max", "crit"):
                p.add(f"{d}/{f}", f"hwmon.temp_{attr}", f"{hw}/{sensor}", slow=True)


def _plan_nvme(p: _Planner, root: str) -> None:
    base = f"{root}/class/nvme"
    for ctrl in _ls(base):
        p.add(f"{base}/{ctrl}/state", "nvme.state", ctrl, Mode.NVME_STATE, slow=True)


def _plan_powercap(p: _Planner, root: str) -> None:
    base = f"{root}/class/powercap"
    for zone in _ls(base):
        if ":" not in zone:
            continue  # "intel-rapl" is the control type, not a zone
        d = f"{base}/{zone}"
        p.add(f"{d}/energy_uj", "power.rapl_energy", zone)
        p.add(f"{d}/max_energy_range_uj", "power.rapl_max_energy", zone, slow=True)
        for f in _ls(d):
            if f.startswith("constraint_") and f.endswith("_power_limit_uw"):
                idx = f.removeprefix("constraint_").removesuffix("_power_limit_uw")
                raw_name = read_bytes(f"{d}/constraint_{idx}_name")
                cname = raw_name.decode("utf-8", "replace").strip() if raw_name else idx
                p.add(f"{d}/{f}", "power.rapl_power_limit", f"{zone}/{cname or idx}", slow=True)


def discover(sysfs: Path, catalog: Catalog) -> SysfsPlan:
    """List every file the node exporter reads under ``sysfs`` (the ``/sys`` root)."""
    p = _Planner(catalog)
    root = str(sysfs)
    _plan_infiniband(p, root)
    _plan_net(p, root)
    _plan_pci(p, root)
    _plan_thermal(p, root)
    _plan_hwmon(p, root)
    _plan_nvme(p, root)
    _plan_powercap(p, root)
    return p.plan


def _leading_number(s: bytes) -> float | None:
    head = s.split(None, 1)[0] if s.strip() else b""
    try:
        return float(head)
    except ValueError:
        return None


def _read_aer(data: bytes, e: Entry, ts: int, buf: SampleBuffer) -> None:
    for line in data.split(b"\n"):
        name, _, num = line.strip().rpartition(b" ")
        if not name:
            continue
        try:
            n = int(num)
        except ValueError:
            continue
        if name.startswith(b"TOTAL_ERR"):
            buf.counter(ts, f"{e.metric}_total", e.device, n)
        else:
            buf.counter(ts, e.metric, f"{e.device}/{name.decode('ascii', 'replace')}", n)


class OpenFiles:
    """Keeps sysfs attribute files open between scrapes and re-reads them with ``pread`` at
    offset 0 (sysfs regenerates an attribute on every read from offset 0, as procps does with
    ``/proc/stat``): one syscall per reading instead of three. At most ``max_open`` descriptors
    are held; beyond that, files are opened per read. A failing descriptor (device gone) is
    closed and forgotten. Call :meth:`close` when done."""

    def __init__(self, max_open: int = 512) -> None:
        self.max_open = max_open
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def read(self, path: str) -> bytes | None:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.max_open:
                return read_bytes(path)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
            self._fds[path] = fd
        try:
            return os.pread(fd, 65536, 0)
        except OSError:
            self._forget(path)
            return None

    def _forget(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def retain(self, paths: set[str]) -> None:
        """Close descriptors of files no longer planned (after a rescan)."""
        for path in [p for p in self._fds if p not in paths]:
            self._forget(path)

    def close(self) -> None:
        for path in list(self._fds):
            self._forget(path)


def read_entries(
    entries: list[Entry], ts: int, buf: SampleBuffer, files: OpenFiles | None = None
) -> None:
    """Read and parse every planned file; unreadable ones (gone, EACCES) add nothing.
    With ``files``, descriptors stay open between calls."""
    read = files.read if files is not None else read_bytes
    for e in entries:
        data = read(e.path)
        if data is None:
            continue
        mode = e.mode
        if mode is Mode.COUNTER:
            buf.reading(ts, e.metric, e.device, data, True)
        elif mode is Mode.GAUGE:
            buf.reading(ts, e.metric, e.device, data, False)
        elif mode is Mode.PREFIX_NUMBER:
            head = data.split(b":", 1)[0].strip()
            if head.isdigit():
                buf.gauge(ts, e.metric, e.device, int(head))
            else:
                buf.text_reading(ts, e.metric, e.device, data.strip().decode("utf-8", "replace"))
        elif mode is Mode.LEADING_NUMBER:
            v = _leading_number(data)
            if v is not None:
                buf.gauge(ts, e.metric, e.device, v)
        elif mode is Mode.AER:
            _read_aer(data, e, ts, buf)
        else:
            table = _NVME_STATES if mode is Mode.NVME_STATE else _OPERSTATES
            buf.gauge(ts, e.metric, e.device, table.get(data.strip(), 0))
