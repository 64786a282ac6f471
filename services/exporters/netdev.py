"""A node's network interfaces and the RDMA devices behind them, as topology facts.

``ethtool -S eth2`` names its per-priority rows ``eth2/prio3``; the same adapter's RDMA
counters in sysfs are ``mlx5_2/1``. The kernel links the two:

- ``/sys/class/net/<netdev>/device/infiniband/<rdma>``: the PCI function of the interface
  carries the RDMA device (``dev_port``, 0-based, gives the RDMA port: ``dev_port + 1``);
- ``/sys/class/infiniband/<rdma>/ports/<p>/gid_attrs/ndevs/<i>``: the netdev of each RoCE GID
  (this is how a bond, ``bond0`` ↔ ``mlx5_bond_0``, shows, having no PCI device of its own).

:func:`discover_netdevs` reads both; :func:`netdev_entities` turns them into ``netdev``
entities (``id`` ``netdev:<node>/<netdev>``, ``device`` the netdev, ``nic`` the RDMA device,
``attrs.port`` its port, ``attrs.link_layer``), which enrichment uses to give ``eth2/prio3``
rows the NIC, rail and switch port of ``mlx5_2/1``. Where ``lldpd`` runs, the interface's LLDP
neighbour (``lldpctl -f json0``: system name and port id) fills ``switch``/``switch_port``; an
entry in the topology file for the port wins over it. Nothing here raises for sysfs content.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.records import EntityKind, TopologyEntity
from services.topology.topofile import netdev_id

SOURCE = "sysfs"


@dataclass(frozen=True, order=True)
class NetdevLink:
    """One interface and the RDMA device and port behind it."""

    netdev: str
    rdma: str
    port: int
    link_layer: str | None = None  # "Ethernet" (RoCE) or "InfiniBand" (IPoIB)


@dataclass(frozen=True)
class Neighbour:
    """An interface's LLDP neighbour: the switch's system name and its port id."""

    switch: str
    port: str


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _ls(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _port_of(net: str) -> int:
    dev_port = _read(f"{net}/dev_port")
    return int(dev_port) + 1 if dev_port is not None and dev_port.isdigit() else 1


def discover_netdevs(sysfs: Path) -> list[NetdevLink]:
    """Every (netdev, RDMA device, port) under ``sysfs`` (the ``/sys`` root), sorted."""
    root = str(sysfs)
    ib = f"{root}/class/infiniband"
    found: dict[str, NetdevLink] = {}
    for netdev in _ls(f"{root}/class/net"):
        net = f"{root}/class/net/{netdev}"
        for rdma in _ls(f"{net}/device/infiniband"):
            port = _port_of(net)
            layer = _read(f"{ib}/{rdma}/ports/{port}/link_layer")
            found.setdefault(netdev, NetdevLink(netdev, rdma, port, layer))
    for rdma in _ls(ib):
        for p in _ls(f"{ib}/{rdma}/ports"):
            if not p.isdigit():
                continue
            ndevs = f"{ib}/{rdma}/ports/{p}/gid_attrs/ndevs"
            for gid in _ls(ndevs):
                name = _read(f"{ndevs}/{gid}")
                if name and name not in found:
                    layer = _read(f"{ib}/{rdma}/ports/{p}/link_layer")
                    found[name] = NetdevLink(name, rdma, int(p), layer)
    return sorted(found.values())


def _values(node: Any, key: str) -> list[Any]:
    """``node[key]`` as a list (json0 wraps every value in a list; json does not)."""
    v = node.get(key) if isinstance(node, dict) else None
    if v is None:
        return []
    return v if isinstance(v, list) else [v]


def _scalar(node: Any, key: str) -> str | None:
    for v in _values(node, key):
        if isinstance(v, dict) and "value" in v:
            return str(v["value"])
        if isinstance(v, str | int):
            return str(v)
    return None


def _interfaces(doc: Any) -> list[tuple[str, Any]]:
    """(name, interface) pairs from ``lldpctl -f json0`` or ``-f json`` output."""
    out: list[tuple[str, Any]] = []
    for lldp in _values(doc, "lldp"):
        for item in _values(lldp, "interface"):
            if not isinstance(item, dict):
                continue
            if "name" in item:  # json0: {"name": "eth2", "chassis": [...], "port": [...]}
                out.append((str(item["name"]), item))
            else:  # json: {"eth2": {"chassis": {...}, "port": {...}}}
                out.extend((str(k), v) for k, v in item.items() if isinstance(v, dict))
    return out


def _switch(iface: Any) -> str | None:
    chassis = (_values(iface, "chassis") or [None])[0]
    if not isinstance(chassis, dict):
        return None
    if "name" in chassis or "id" in chassis:  # json0: {"name": [{"value": "leaf-1"}], ...}
        return _scalar(chassis, "name") or _scalar(chassis, "id")
    named = next(iter(chassis), None)  # json: {"leaf-1": {"id": {...}, ...}}
    return str(named) if named else None


def parse_lldpctl(text: str) -> dict[str, Neighbour]:
    """Interface → LLDP neighbour from ``lldpctl -f json0`` (or ``-f json``) output. The
    switch is the chassis' system name (its id when unnamed); the port is the port id, or
    its description when the id is a MAC address. Malformed output gives ``{}``."""
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    out: dict[str, Neighbour] = {}
    for name, iface in _interfaces(doc):
        switch = _switch(iface)
        port = (_values(iface, "port") or [None])[0]
        ids = _values(port, "id")
        pid = ids[0] if ids else None
        kind = pid.get("type") if isinstance(pid, dict) else None
        port_name = _scalar(port, "id") if kind != "mac" else None
        port_name = port_name or _scalar(port, "descr")
        if switch and port_name:
            out[name] = Neighbour(str(switch), port_name)
    return out


def run_lldpctl(timeout: float = 5.0) -> dict[str, Neighbour]:
    """LLDP neighbours from the local ``lldpd``; ``{}`` when it is not installed, not
    running, or does not answer within ``timeout``."""
    try:
        proc = subprocess.run(
            ["lldpctl", "-f", "json0"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_lldpctl(proc.stdout) if proc.returncode == 0 else {}


def netdev_entities(
    node: str,
    links: list[NetdevLink],
    neighbours: dict[str, Neighbour] | None = None,
    valid_from: int = 0,
) -> list[TopologyEntity]:
    """One ``netdev`` entity per interface with an RDMA device, and per interface with an
    LLDP neighbour (its own NIC then)."""
    nb = neighbours or {}
    out: list[TopologyEntity] = []
    linked = {lk.netdev for lk in links}
    for lk in links:
        n = nb.get(lk.netdev)
        attrs: dict[str, Any] = {"port": lk.port}
        if lk.link_layer:
            attrs["link_layer"] = lk.link_layer
        out.append(
            TopologyEntity(
                id=netdev_id(node, lk.netdev),
                kind=EntityKind.NETDEV,
                valid_from=valid_from,
                node=node,
                device=lk.netdev,
                nic=lk.rdma,
                switch=n.switch if n else None,
                switch_port=n.port if n else None,
                attrs=attrs,
                source="lldp" if n else SOURCE,
            )
        )
    for netdev in sorted(set(nb) - linked):
        n = nb[netdev]
        out.append(
            TopologyEntity(
                id=netdev_id(node, netdev),
                kind=EntityKind.NETDEV,
                valid_from=valid_from,
                node=node,
                device=netdev,
                switch=n.switch,
                switch_port=n.port,
                source="lldp",
            )
        )
    return out


def boot_time_ns(procfs: Path) -> int:
    """The node's boot time (``btime`` of ``/proc/stat``) in ns; 0 when unreadable. Interface
    links hold from boot, so the facts are valid from then (stable across exporter restarts)."""
    for line in (_read(f"{procfs}/stat") or "").splitlines():
        if line.startswith("btime "):
            head = line.split()[1]
            return int(head) * 1_000_000_000 if head.isdigit() else 0
    return 0


class NetdevFacts:
    """The node's current netdev entities, and whether they changed since last published."""

    def __init__(self, sysfs: Path, node: str, *, valid_from: int = 0, lldp: bool = True) -> None:
        self.sysfs, self.node, self.valid_from, self.lldp = sysfs, node, valid_from, lldp
        self.published: list[TopologyEntity] | None = None

    def current(self) -> list[TopologyEntity]:
        neighbours = run_lldpctl() if self.lldp else {}
        return netdev_entities(self.node, discover_netdevs(self.sysfs), neighbours, self.valid_from)

    def changed(self) -> list[TopologyEntity] | None:
        """The entities when they differ from the last :meth:`mark_published` ones, else None."""
        now = self.current()
        return None if now == self.published else now

    def mark_published(self, entities: list[TopologyEntity]) -> None:
        self.published = entities
