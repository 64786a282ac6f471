"""``ibnetdiscover`` output → switches (leaf/spine by level), host adapters and links.

Input is the default ``ibnetdiscover`` text: blocks of ``vendid=…``/``devid=…`` headers, then a
``Switch <nports> "S-<guid>" # "<desc>" … lid N`` or ``Ca <nports> "H-<guid>" # "<desc>"`` line
and one line per connected port::

    [1]	"H-e09d7303007a4bd8"[1](e09d7303007a4bd8) 		# "a08-p1-dgx-04-c01 mlx5_5" lid 647 4xNDR
    [1](e09d7303007a5a68) 	"S-2c5eab0300b87b40"[17]		# lid 657 lmc 0 "MF0;A09-…" lid 73 4xNDR

Both ends list a host link; they are merged on (CA guid, CA port). A host adapter whose
description is ``"<host> <device>"`` (``a08-p1-dgx-04-c01 mlx5_5``) gets node and device from
it; a node map (:func:`load_node_map`) overrides by GUID or description. The SHARP "Aggregation
Node" CAs inside switches are kept as NICs with ``attrs.kind = "aggregation_node"``.

Switch level: leaves are switches with at least one host (non-aggregation) CA; every other
switch's level is 1 + its hop distance from the nearest leaf. Roles: 1 leaf, 2 spine, ≥3 core.
Switch names come from the description (``MF0;A09-P1-IBLEAF-04-04:MQM9701/U1`` →
``A09-P1-IBLEAF-04-04``; director ASICs keep their ``/L01``/``/S01`` part), else the GUID.

Anything that cannot be placed (a CA with no port line, a port to a device never described,
truncated input) is named in :attr:`TopologyImport.problems`; the rest still imports.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import ConfigError
from schemas.records import EntityKind, TopologyEntity
from services.topology.topofile import (
    TopologyImport,
    host_link_id,
    load_document,
    nic_id,
    switch_id,
    switch_link_id,
)

SOURCE = "ibnetdiscover"

_NODE_RE = re.compile(
    r'^(Switch|Ca|Rt)\s+(\d+)\s+"([SHR])-([0-9A-Fa-fx]+)"\s*(?:#\s*"([^"]*)"(.*))?$'
)
_PORT_RE = re.compile(
    r'^\[(\d+)\](?:\(([0-9A-Fa-f]+)\))?\s*"([SHR])-([0-9A-Fa-fx]+)"\[(\d+)\]'
    r"(?:\(([0-9A-Fa-f]+)\))?\s*(?:#\s*(.*))?$"
)
_DESC_RE = re.compile(r'"([^"]*)"')
_LID_RE = re.compile(r"\blid (\d+)")
_SPEED_RE = re.compile(r"\b(\d+x[A-Z]+)\b")


def norm_guid(text: str) -> str:
    """``0xff08c43213b3f30``, ``0ff08c43213b3f30``, ``FF08…`` → ``0x0ff08c43213b3f30``."""
    return f"0x{int(text, 16):016x}"


NodeMap = Mapping[str, tuple[str, str | None]]


def load_node_map(path: Path) -> dict[str, tuple[str, str | None]]:
    """GUID or node description → (node, device or None).

    Accepts a YAML/JSON mapping (``"0xe09d…": "host1/mlx5_0"``, ``"MT4129 …": "host2"`` or
    ``{node: host1, device: mlx5_0}``), or ``ibstat``-style text pairs (``VM_hostname <host>``
    then its port GUIDs, one a line). GUID keys are normalised."""
    text = path.read_text()
    if text.lstrip().startswith("VM_hostname") or re.match(r"^\S+ \S+\n[0-9a-fA-Fx]+\n", text):
        out: dict[str, tuple[str, str | None]] = {}
        host: str | None = None
        for raw in text.splitlines():
            parts = raw.split()
            if len(parts) == 2:
                host = parts[1]
            elif len(parts) == 1 and host is not None:
                out[norm_guid(parts[0])] = (host, None)
        return out
    doc: Any = load_document(path)
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: node map must be a mapping of GUID/description to node")
    result: dict[str, tuple[str, str | None]] = {}
    for k, v in doc.items():
        key = str(k)
        if re.fullmatch(r"(0x)?[0-9A-Fa-f]{1,16}", key):
            key = norm_guid(key)
        if isinstance(v, Mapping):
            node, dev = str(v.get("node", "")), v.get("device")
            result[key] = (node, None if dev is None else str(dev))
        else:
            node, _, dev = str(v).partition("/")
            result[key] = (node, dev or None)
        if not result[key][0]:
            raise ConfigError(f"{path}: node map entry {k!r} names no node")
    return result


@dataclass
class _Port:
    port: int
    peer_type: str
    peer_guid: str
    peer_port: int
    port_guid: str | None
    comment: str


@dataclass
class _Device:
    type: str  # Switch | Ca | Rt
    guid: str
    desc: str
    lid: int | None
    ports: list[_Port] = field(default_factory=list)


def _parse(lines: list[str], problems: list[str]) -> dict[str, _Device]:
    devices: dict[str, _Device] = {}
    cur: _Device | None = None
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#") or "=" in line.split(" ", 1)[0]:
            if not line:
                cur = None
            continue
        m = _NODE_RE.match(line)
        if m:
            typ, guid = m.group(1), norm_guid(m.group(4))
            lid = _LID_RE.search(m.group(6) or "")
            cur = _Device(typ, guid, m.group(5) or "", int(lid.group(1)) if lid else None)
            devices[guid] = cur
            continue
        p = _PORT_RE.match(line)
        if p and cur is not None:
            cur.ports.append(
                _Port(
                    port=int(p.group(1)),
                    peer_type=p.group(3),
                    peer_guid=norm_guid(p.group(4)),
                    peer_port=int(p.group(5)),
                    port_guid=norm_guid(p.group(2)) if p.group(2) else None,
                    comment=p.group(7) or "",
                )
            )
            continue
        problems.append(f"line {n}: not understood: {line[:80]!r}")
    return devices


def switch_name(desc: str, guid: str) -> str:
    """``MF0;A09-P1-IBLEAF-04-04:MQM9701/U1`` → ``A09-P1-IBLEAF-04-04``; empty → the GUID."""
    if not desc:
        return guid
    name = desc.split(";", 1)[1] if ";" in desc else desc
    base, _, model = name.partition(":")
    parts = model.split("/")
    if len(parts) > 2:  # director chassis: MCS8500/L01/U1 → keep the ASIC's position
        base = base + "/" + "/".join(parts[1:-1])
    return base.strip() or guid


def _host_of(desc: str) -> tuple[str | None, str | None]:
    parts = desc.split()
    if len(parts) == 2 and not parts[0].startswith("MT") and re.match(r"^[\w.-]+$", parts[0]):
        return parts[0], parts[1]
    return None, None


def parse_ibnetdiscover(
    text: str, node_map: NodeMap | None = None, valid_from: int = 0
) -> TopologyImport:
    """Parse ``ibnetdiscover`` text; never raises on bad input (see :attr:`problems`)."""
    problems: list[str] = []
    devices = _parse(text.splitlines(), problems)
    nm = node_map or {}
    switches = {g: d for g, d in devices.items() if d.type == "Switch"}
    cas = {g: d for g, d in devices.items() if d.type == "Ca"}
    for d in devices.values():
        if d.type == "Rt":
            problems.append(f"router {d.guid} ({d.desc!r}) skipped: routers are not modelled")
    if not switches and not cas:
        problems.append("no Switch or Ca blocks found: not ibnetdiscover output?")
        return TopologyImport([], problems)

    names: dict[str, str] = {}
    taken: set[str] = set()
    for g, d in switches.items():
        name = switch_name(d.desc, g)
        names[g] = f"{name}@{g}" if name in taken else name
        taken.add(names[g])

    host_links, sw_links = _links(switches, cas, problems)
    aggregation = {g for g, d in cas.items() if "Aggregation Node" in d.desc}
    leaves = {sw for (ca, _), (sw, _, _) in host_links.items() if ca not in aggregation}
    level = _levels(set(switches), leaves, sw_links.values())
    out = _switch_entities(switches, names, level, sw_links, valid_from, problems)
    out.extend(_host_entities(cas, host_links, names, nm, aggregation, valid_from, problems))
    return TopologyImport(out, problems)


_HostLinks = dict[tuple[str, int], tuple[str, int, str]]
_SwitchLinks = dict[str, tuple[str, int, str, int, str]]


def _links(
    switches: dict[str, _Device], cas: dict[str, _Device], problems: list[str]
) -> tuple[_HostLinks, _SwitchLinks]:
    """The host links keyed by (ca guid, ca port) → (switch guid, switch port, comment), and
    the switch links by link id → (switch, port, peer switch, peer port, comment)."""
    host_links: _HostLinks = {}
    sw_links: _SwitchLinks = {}
    for g, d in switches.items():
        for p in d.ports:
            if p.peer_type == "H":
                host_links.setdefault((p.peer_guid, p.peer_port), (g, p.port, p.comment))
            elif p.peer_type == "S":
                lid = switch_link_id(g, p.port, p.peer_guid, p.peer_port)
                sw_links.setdefault(lid, (g, p.port, p.peer_guid, p.peer_port, p.comment))
    for g, d in cas.items():
        if not d.ports:
            problems.append(
                f"CA {g} ({d.desc!r}) has no port lines: input truncated or the adapter is down"
            )
        for p in d.ports:
            if p.peer_type != "S":
                problems.append(f"CA {g} port {p.port} links to a non-switch {p.peer_guid}")
                continue
            host_links[(g, p.port)] = (p.peer_guid, p.peer_port, p.comment)
    return host_links, sw_links


def _switch_entities(
    switches: dict[str, _Device],
    names: dict[str, str],
    level: dict[str, int],
    sw_links: _SwitchLinks,
    valid_from: int,
    problems: list[str],
) -> list[TopologyEntity]:
    """The switches (with their level's role) and the links between them."""
    out: list[TopologyEntity] = []
    for g, d in switches.items():
        lv = level.get(g)
        if lv is None:
            problems.append(f"switch {names[g]} is not connected to any leaf: level unknown")
        role = None if lv is None else ("leaf", "spine")[lv - 1] if lv <= 2 else "core"
        out.append(
            TopologyEntity(
                id=switch_id(names[g]),
                kind=EntityKind.SWITCH,
                valid_from=valid_from,
                device=names[g],
                role=role,
                guid=g,
                attrs={"level": lv, "lid": d.lid, "description": d.desc, "ports": len(d.ports)},
                source=SOURCE,
            )
        )
    for lid, (a, pa, b, pb, comment) in sorted(sw_links.items()):
        if a not in switches or b not in switches:
            problems.append(f"switch link {lid}: peer switch never described (truncated input?)")
            continue
        speed = _SPEED_RE.search(comment)
        out.append(
            TopologyEntity(
                id=switch_link_id(names[a], pa, names[b], pb),
                kind=EntityKind.LINK,
                valid_from=valid_from,
                switch=names[a],
                switch_port=str(pa),
                peer=names[b],
                attrs={"peer_port": pb, "speed": speed.group(1) if speed else None},
                source=SOURCE,
            )
        )
    return out


def _host_entities(
    cas: dict[str, _Device],
    host_links: dict[tuple[str, int], tuple[str, int, str]],
    names: dict[str, str],
    nm: NodeMap,
    aggregation: set[str],
    vf: int,
    problems: list[str],
) -> list[TopologyEntity]:
    out: list[TopologyEntity] = []
    by_ca: dict[str, list[tuple[int, str, int, str]]] = {}
    for (ca, port), (sw, sp, comment) in sorted(host_links.items()):
        by_ca.setdefault(ca, []).append((port, sw, sp, comment))
    for g in sorted(set(cas) | set(by_ca)):
        d = cas.get(g)
        desc = d.desc if d else ""
        if d is None:
            problems.append(f"CA {g} seen from a switch port but never described")
        node, dev = _host_of(desc)
        mapped = nm.get(g) or nm.get(desc)
        if mapped is not None:
            node, dev = mapped[0], mapped[1] or dev
        ports = by_ca.get(g, [])
        first = ports[0] if ports else None
        attrs: dict[str, Any] = {"description": desc, "lid": d.lid if d else None}
        if g in aggregation:
            attrs["kind"] = "aggregation_node"
        elif node is None:
            attrs["unmapped"] = "no host name in the node description; give a node map"
        common: dict[str, Any] = {"valid_from": vf, "node": node, "source": SOURCE}
        out.append(
            TopologyEntity(
                id=nic_id(node, dev, g),
                kind=EntityKind.NIC,
                device=dev,
                guid=g,
                switch=names.get(first[1]) if first else None,
                switch_port=str(first[2]) if first else None,
                attrs=attrs,
                **common,
            )
        )
        for port, sw, sp, comment in ports:
            if sw not in names:
                problems.append(f"CA {g} port {port}: switch {sw} never described")
                continue
            speed = _SPEED_RE.search(comment)
            descs = _DESC_RE.findall(comment)
            out.append(
                TopologyEntity(
                    id=host_link_id(node, dev, port, g),
                    kind=EntityKind.LINK,
                    device=f"{dev}/{port}" if dev else None,
                    switch=names[sw],
                    switch_port=str(sp),
                    guid=g,
                    attrs={
                        "ca_port": port,
                        "speed": speed.group(1) if speed else None,
                        "switch_guid": sw,
                        "switch_description": descs[-1] if descs else None,
                        **({"kind": "aggregation_node"} if g in aggregation else {}),
                    },
                    **common,
                )
            )
    return out


def _levels(switches: set[str], leaves: set[str], links: Any) -> dict[str, int]:
    adj: dict[str, set[str]] = {s: set() for s in switches}
    for a, _, b, _, _ in links:
        if a in adj and b in adj:
            adj[a].add(b)
            adj[b].add(a)
    level = {s: 1 for s in leaves if s in adj}
    queue = deque(level)
    while queue:
        s = queue.popleft()
        for t in adj[s]:
            if t not in level:
                level[t] = level[s] + 1
                queue.append(t)
    return level


def import_ibnetdiscover(
    path: Path, node_map: NodeMap | None = None, valid_from: int = 0
) -> TopologyImport:
    """Read and parse a file; an unreadable file raises ConfigError."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    return parse_ibnetdiscover(text, node_map, valid_from)
