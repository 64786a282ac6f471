"""NCCL topology XML (``NCCL_TOPO_FILE`` / ``NCCL_TOPO_DUMP_FILE``) → GPU and NIC entities with
NUMA node and GPU↔NIC affinity, for one or more hosts of the same shape.

The XML nests ``<cpu numaid=…>`` → optional PCIe switches (``<pci class="0x060400">``) → devices:
GPUs are ``class="0x030200"`` (3D controller) or ``0x030000`` (VGA), NICs ``0x020700``
(InfiniBand) or ``0x020000`` (Ethernet), or a ``<nic>`` element under a PCI device.

Naming: GPUs are numbered in PCI bus-id order (``gpu0`` is the lowest bus id), which is the
CUDA/NVML default order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``); NICs likewise (``nic0``…) unless
``nic_names`` gives the names in bus-id order (e.g. ``mlx5_0``…). Affinity: the NIC under the
same PCIe switch, paired in document order when a switch holds several of each (Azure ND A100
v4 has two GPUs and two NICs per switch); a GPU with no NIC under its switch gets the nearest
one on the same NUMA node, paired by position; with none there, any NIC
(``attrs.nic_affinity = "remote"``); only an XML without NICs leaves ``nic`` None. A ``<nic>``
element with ``<net name=…>`` names its NIC.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ConfigError
from schemas.records import EntityKind, TopologyEntity
from services.topology.topofile import TopologyImport, gpu_id, nic_id

SOURCE = "nccl-topo"
GPU_CLASSES = frozenset({"0x030200", "0x030000"})
NIC_CLASSES = frozenset({"0x020700", "0x020000"})
BRIDGE_CLASS = "0x060400"


@dataclass
class PciDevice:
    busid: str
    kind: str  # gpu | nic
    numa: int | None
    group: str  # the PCIe switch (or cpu) it hangs from
    order: int  # document order
    name: str | None = None  # from a nested <net name=…>, when the XML has it


def _walk(el: ET.Element, numa: int | None, group: str, out: list[PciDevice]) -> None:
    for child in el:
        if child.tag == "cpu":
            nid = child.get("numaid")
            _walk(child, int(nid) if nid and nid.lstrip("-").isdigit() else None, f"cpu{nid}", out)
        elif child.tag == "nic":  # a NIC without PCI info (virtual or Ethernet), under a cpu
            for net in child.iter("net"):
                name = net.get("name") or f"net{len(out)}"
                out.append(PciDevice(f"net:{name}", "nic", numa, group, len(out), name))
        elif child.tag == "pci":
            cls = (child.get("class") or "").lower()
            bus = (child.get("busid") or "").lower()
            if cls == BRIDGE_CLASS:
                _walk(child, numa, bus or group, out)
            elif cls in GPU_CLASSES or child.find("gpu") is not None:
                out.append(PciDevice(bus, "gpu", numa, group, len(out)))
            elif cls in NIC_CLASSES or child.find("nic") is not None:
                found = child.find(".//net")
                label = found.get("name") if found is not None else None
                out.append(PciDevice(bus, "nic", numa, group, len(out), label))
            else:
                _walk(child, numa, group, out)
        else:
            _walk(child, numa, group, out)


def read_pci_devices(xml_text: str) -> list[PciDevice]:
    """The GPUs and NICs of a topology XML in document order; ConfigError if not XML."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ConfigError(f"NCCL topology XML does not parse: {e}") from e
    if root.tag != "system":
        raise ConfigError(f"NCCL topology XML: root is <{root.tag}>, expected <system>")
    out: list[PciDevice] = []
    _walk(root, None, "system", out)
    return out


def _bus_key(busid: str) -> tuple[int, ...]:
    parts = busid.replace(".", ":").split(":")
    try:
        return tuple(int(p, 16) for p in parts)
    except ValueError:
        return (1 << 62,)


def affinity(devices: Sequence[PciDevice]) -> dict[str, tuple[str, str]]:
    """GPU bus id → (affine NIC bus id, how: ``switch`` | ``numa`` | ``remote``), by the
    rules in the module docstring; a GPU is absent when the XML has no NIC at all."""
    gpus = [d for d in devices if d.kind == "gpu"]
    nics = [d for d in devices if d.kind == "nic"]
    pairs: dict[str, tuple[str, str]] = {}
    for group in dict.fromkeys(d.group for d in gpus):
        g_in = [g for g in gpus if g.group == group]
        n_in = [n for n in nics if n.group == group and not group.startswith("cpu")]
        for i, g in enumerate(g_in):
            if n_in:
                pairs[g.busid] = (n_in[i % len(n_in)].busid, "switch")
    for numa in dict.fromkeys(g.numa for g in gpus):
        left = [g for g in gpus if g.numa == numa and g.busid not in pairs]
        local = [n for n in nics if n.numa == numa]
        pool, how = (local, "numa") if local else (nics, "remote")
        for i, g in enumerate(left):
            if pool:
                pairs[g.busid] = (pool[i % len(pool)].busid, how)
    return pairs


def parse_nccl_topo(
    xml_text: str,
    nodes: Sequence[str],
    valid_from: int = 0,
    nic_names: Sequence[str] | None = None,
) -> TopologyImport:
    """Entities for every node in ``nodes`` (all of this shape). ConfigError on bad XML."""
    if not nodes:
        raise ConfigError("NCCL topology import needs the node name(s) it applies to (--node)")
    devices = read_pci_devices(xml_text)
    problems: list[str] = []
    gpus = sorted((d for d in devices if d.kind == "gpu"), key=lambda d: _bus_key(d.busid))
    nics = sorted((d for d in devices if d.kind == "nic"), key=lambda d: _bus_key(d.busid))
    if not gpus:
        problems.append("no GPU (class 0x030200/0x030000) found in the topology XML")
    if nic_names is not None and len(nic_names) != len(nics):
        raise ConfigError(f"{len(nic_names)} NIC names given for {len(nics)} NICs in the XML")
    gname = {d.busid: f"gpu{i}" for i, d in enumerate(gpus)}
    nname = {
        d.busid: (nic_names[i] if nic_names else d.name or f"nic{i}") for i, d in enumerate(nics)
    }
    pairs = affinity(devices)
    nic_gpu: dict[str, str] = {}
    for g in gpus:
        if g.busid in pairs:
            nic_gpu.setdefault(pairs[g.busid][0], g.busid)
        else:
            problems.append(f"{gname[g.busid]} ({g.busid}): the XML has no NIC to pair it with")
    out: list[TopologyEntity] = []
    for node in nodes:
        for rail, n in enumerate(nics):
            gb = nic_gpu.get(n.busid)
            out.append(
                TopologyEntity(
                    id=nic_id(node, nname[n.busid]),
                    kind=EntityKind.NIC,
                    valid_from=valid_from,
                    node=node,
                    device=nname[n.busid],
                    numa=n.numa,
                    rail=rail,
                    gpu=gname[gb] if gb else None,
                    attrs={"pci": n.busid, "pcie_switch": n.group},
                    source=SOURCE,
                )
            )
        for g in gpus:
            nb, how = pairs.get(g.busid, (None, None))
            out.append(
                TopologyEntity(
                    id=gpu_id(node, gname[g.busid]),
                    kind=EntityKind.GPU,
                    valid_from=valid_from,
                    node=node,
                    device=gname[g.busid],
                    numa=g.numa,
                    nic=nname[nb] if nb else None,
                    attrs={"pci": g.busid, "pcie_switch": g.group, "nic_affinity": how},
                    source=SOURCE,
                )
            )
    return TopologyImport(out, problems)


def import_nccl_topo(
    path: Path,
    nodes: Sequence[str],
    valid_from: int = 0,
    nic_names: Sequence[str] | None = None,
) -> TopologyImport:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    return parse_nccl_topo(text, nodes, valid_from, nic_names)
