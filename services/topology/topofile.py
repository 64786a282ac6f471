"""Refinery's own topology file (YAML or JSON) and the entity-id conventions every importer uses.

Entity ids (the compaction key of the ``topology`` topic) are stable across versions:

==========  ==============================================  ================================
kind        id                                              example
==========  ==============================================  ================================
node        ``node:<node>``                                 ``node:a08-p1-dgx-04-c01``
switch      ``switch:<name>``                               ``switch:A09-P1-IBLEAF-04-04``
nic         ``nic:<node>/<device>`` or ``nic:<guid>``       ``nic:a08-p1-dgx-04-c01/mlx5_5``
gpu         ``gpu:<node>/<device>``                         ``gpu:n01/gpu3``
netdev      ``netdev:<node>/<interface>``                   ``netdev:n01/eth2``
link        host: ``link:<node>/<device>/<port>``           ``link:a08-p1-dgx-04-c01/mlx5_5/1``
            (``link:<guid>/<port>`` when the host is unknown)
            switch↔switch: ``link:<a>/<pa>~<b>/<pb>``       ``link:L1/33~S1/1`` (ends sorted)
==========  ==============================================  ================================

The file format (``version: 1``); every section is optional::

    version: 1
    valid_from: 2025-03-01T00:00:00Z     # or ns since the epoch; default 0
    switches:
      - {name: leaf-1, role: leaf, pod: p1, guid: "0x2c5eab0300b87b40"}
      - {name: spine-1, role: spine}
    nodes:
      - name: n01
        rack: r1
        pod: p1
        nvlink_domain: nvl-1
        gpus:
          - {device: gpu0, numa: 0, nic: mlx5_0}
        nics:
          - {device: mlx5_0, port: 1, rail: 0, numa: 0, gpu: gpu0, guid: "0x…",
             switch: leaf-1, switch_port: 17, netdev: eth0}
    links:                                # switch ↔ switch
      - {switch: leaf-1, port: 33, peer: spine-1, peer_port: 1}
    entities: []                          # raw TopologyEntity objects (what --json prints)

A NIC with ``switch`` set also yields its host link (``device`` ``<nic>/<port>``, port default
1). A NIC with ``netdev`` set also yields the interface's ``netdev`` entity (the node exporter
records the same fact from sysfs), so ``ethtool -S`` rows (``eth0/prio3``) join this NIC's
port: on a RoCE fabric, which ``ibnetdiscover`` does not see, the switch ports come from here.
:func:`parse_topofile` raises :class:`~schemas.errors.ConfigError` with a one-line message
naming the offending entry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.errors import ConfigError
from schemas.records import EntityKind, TopologyEntity


@dataclass
class TopologyImport:
    """What an importer produced: the entities, and one line per thing it could not place
    (a partial result names its reason here instead of failing silently)."""

    entities: list[TopologyEntity]
    problems: list[str] = field(default_factory=list)

    def of_kind(self, kind: EntityKind) -> list[TopologyEntity]:
        return [e for e in self.entities if e.kind is kind]


# --- ids ------------------------------------------------------------------------------------


def node_id(node: str) -> str:
    return f"node:{node}"


def switch_id(name: str) -> str:
    return f"switch:{name}"


def nic_id(node: str | None, device: str | None, guid: str | None = None) -> str:
    if node and device:
        return f"nic:{node}/{device}"
    return f"nic:{guid or device}"


def netdev_id(node: str, netdev: str) -> str:
    return f"netdev:{node}/{netdev}"


def gpu_id(node: str, device: str) -> str:
    return f"gpu:{node}/{device}"


def host_link_id(node: str | None, device: str | None, port: int | str, guid: str | None) -> str:
    if node and device:
        return f"link:{node}/{device}/{port}"
    return f"link:{guid or device}/{port}"


def switch_link_id(a: str, pa: int | str, b: str, pb: int | str) -> str:
    ends = sorted([f"{a}/{pa}", f"{b}/{pb}"])
    return f"link:{ends[0]}~{ends[1]}"


# --- time -----------------------------------------------------------------------------------


def parse_time_ns(value: object) -> int:
    """ns since the epoch from an int/float (ns), a digit string, or an ISO-8601 time
    (a time without zone is taken as UTC). Raises ConfigError."""
    if isinstance(value, bool):
        raise ConfigError(f"not a time: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, str):
        s = value.strip()
        if s.lstrip("-").isdigit():
            return int(s)
        try:
            dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError as e:
            raise ConfigError(f"not a time (ISO-8601 or ns): {value!r}") from e
    else:
        raise ConfigError(f"not a time: {value!r}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


# --- file -----------------------------------------------------------------------------------


def load_document(path: Path) -> Any:
    """YAML or JSON (JSON is YAML's subset, but JSON errors read better); ConfigError."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{path}: not valid YAML/JSON: {first}") from e


def _opt_int(v: object, where: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise ConfigError(f"{where}: expected an integer, got {v!r}")
    try:
        return int(v)
    except ValueError as e:
        raise ConfigError(f"{where}: expected an integer, got {v!r}") from e


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


def _mapping(v: object, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
    return v


def _items(doc: Mapping[str, Any], key: str) -> list[Any]:
    v = doc.get(key) or []
    if not isinstance(v, list):
        raise ConfigError(f"topology file: {key!r} must be a list")
    return v


def entities_from_document(doc: object, valid_from: int | None = None) -> list[TopologyEntity]:
    """Build entities from a parsed topology document (see the module docstring)."""
    d = _mapping(doc, "topology file")
    if d.get("version", 1) != 1:
        raise ConfigError(f"topology file: unsupported version {d.get('version')!r}")
    vf = valid_from if valid_from is not None else parse_time_ns(d.get("valid_from", 0))
    out: list[TopologyEntity] = []
    for i, raw in enumerate(_items(d, "switches")):
        s = _mapping(raw, f"switches[{i}]")
        if not s.get("name"):
            raise ConfigError(f"topology file: switches[{i}] has no name")
        name = str(s["name"])
        out.append(
            TopologyEntity(
                id=switch_id(name),
                kind=EntityKind.SWITCH,
                valid_from=vf,
                device=name,
                role=_opt_str(s.get("role")),
                rack=_opt_str(s.get("rack")),
                pod=_opt_str(s.get("pod")),
                guid=_opt_str(s.get("guid")),
                source="file",
            )
        )
    for i, raw in enumerate(_items(d, "nodes")):
        out.extend(_node_entities(_mapping(raw, f"nodes[{i}]"), f"nodes[{i}]", vf))
    for i, raw in enumerate(_items(d, "links")):
        lk = _mapping(raw, f"links[{i}]")
        where = f"links[{i}]"
        if not lk.get("switch") or not lk.get("peer"):
            raise ConfigError(f"topology file: {where} needs switch and peer")
        port = _opt_int(lk.get("port"), where)
        peer_port = _opt_int(lk.get("peer_port"), where)
        out.append(
            TopologyEntity(
                id=switch_link_id(str(lk["switch"]), port or 0, str(lk["peer"]), peer_port or 0),
                kind=EntityKind.LINK,
                valid_from=vf,
                switch=str(lk["switch"]),
                switch_port=None if port is None else str(port),
                peer=str(lk["peer"]),
                attrs={"peer_port": peer_port},
                source="file",
            )
        )
    for i, raw in enumerate(_items(d, "entities")):
        try:
            ent = TopologyEntity.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "entity"
            raise ConfigError(f"topology file: entities[{i}].{loc}: {err['msg']}") from e
        out.append(ent)
    return out


def _node_entities(n: Mapping[str, Any], where: str, vf: int) -> list[TopologyEntity]:
    if not n.get("name"):
        raise ConfigError(f"topology file: {where} has no name")
    node = str(n["name"])
    rack, pod, dom = _opt_str(n.get("rack")), _opt_str(n.get("pod")), n.get("nvlink_domain")
    common: dict[str, Any] = {"valid_from": vf, "node": node, "source": "file"}
    out = [
        TopologyEntity(
            id=node_id(node),
            kind=EntityKind.NODE,
            rack=rack,
            pod=pod,
            nvlink_domain=_opt_str(dom),
            **common,
        )
    ]
    for j, raw in enumerate(n.get("gpus") or []):
        g = _mapping(raw, f"{where}.gpus[{j}]")
        dev = str(g.get("device") or f"gpu{j}")
        out.append(
            TopologyEntity(
                id=gpu_id(node, dev),
                kind=EntityKind.GPU,
                device=dev,
                numa=_opt_int(g.get("numa"), f"{where}.gpus[{j}].numa"),
                nic=_opt_str(g.get("nic")),
                nvlink_domain=_opt_str(g.get("nvlink_domain", dom)),
                rack=rack,
                pod=pod,
                **common,
            )
        )
    for j, raw in enumerate(n.get("nics") or []):
        c = _mapping(raw, f"{where}.nics[{j}]")
        w = f"{where}.nics[{j}]"
        if not c.get("device"):
            raise ConfigError(f"topology file: {w} has no device")
        dev = str(c["device"])
        sw, sp = _opt_str(c.get("switch")), _opt_int(c.get("switch_port"), w)
        fields: dict[str, Any] = {
            "rail": _opt_int(c.get("rail"), w),
            "numa": _opt_int(c.get("numa"), w),
            "gpu": _opt_str(c.get("gpu")),
            "guid": _opt_str(c.get("guid")),
            "switch": sw,
            "switch_port": None if sp is None else str(sp),
            "rack": rack,
            "pod": pod,
        }
        out.append(
            TopologyEntity(
                id=nic_id(node, dev), kind=EntityKind.NIC, device=dev, **fields, **common
            )
        )
        port = _opt_int(c.get("port"), w) or 1
        if c.get("netdev"):
            out.append(_netdev_entity(node, str(c["netdev"]), dev, port, common))
        if sw is not None:
            out.append(
                TopologyEntity(
                    id=host_link_id(node, dev, port, None),
                    kind=EntityKind.LINK,
                    device=f"{dev}/{port}",
                    **fields,
                    **common,
                )
            )
    return out


def _netdev_entity(
    node: str, netdev: str, nic: str, port: int, common: dict[str, Any]
) -> TopologyEntity:
    return TopologyEntity(
        id=netdev_id(node, netdev),
        kind=EntityKind.NETDEV,
        device=netdev,
        nic=nic,
        attrs={"port": port},
        **common,
    )


def parse_topofile(path: Path, valid_from: int | None = None) -> list[TopologyEntity]:
    """Read a Refinery topology file; ``valid_from`` overrides the file's own."""
    return entities_from_document(load_document(path), valid_from)


def dump_document(entities: list[TopologyEntity]) -> dict[str, Any]:
    """The ``entities:`` form of a topology file, which :func:`parse_topofile` reads back."""
    return {
        "version": 1,
        "entities": [e.model_dump(mode="json", exclude_defaults=True) for e in entities],
    }
